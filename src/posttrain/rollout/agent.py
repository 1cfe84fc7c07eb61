"""The agent loop: engine + environment (+ sandbox, through the environment) -> a token-exact Trajectory.

The training tokens are the rendered prompt, then exactly the ids the engine sampled, then the ids of
the chat-template glue and observations appended between turns. The conversation is never re-rendered
and re-tokenized: each observation's glue is tokenized once, appended, and the engine continues from
that exact id sequence. Does not compute losses or rewards (the environment scores).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from posttrain.models.chat import render_messages
from posttrain.models.vision import encode_with_images, image_inputs, with_placeholders
from posttrain.types import ImagePart, Message, Task, ToolSpec, Trajectory, TrajectoryStatus

if TYPE_CHECKING:  # the engine package imports torch; the agent loop only needs its types
    from posttrain.engine import Engine, SamplingParams

_PLACEHOLDER = "\x00POSTTRAIN-ASSISTANT-TURN\x00"


@dataclass
class EpisodeLimits:
    max_turns: int = 4
    max_episode_tokens: int = 1024  # generated + observation tokens after the prompt
    max_new_tokens: int = 128  # per assistant turn


class GlueRenderer:
    """Computes, from the chat template, the exact text between the end of one assistant turn and the
    start of the next: closing the assistant message, the observation messages, the next header.

    It renders a conversation with a placeholder assistant turn twice (with and without the
    observations) and takes the difference, so it follows whatever template the tokenizer carries.
    """

    def __init__(self, tokenizer: Any, tools: list[ToolSpec] | None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools or None

    def glue_text(self, history: list[Message], observations: list[Message], stop_text: str | None) -> str:
        history = with_placeholders(self.tokenizer, history)  # a VLM's image parts: placeholder runs
        observations = with_placeholders(self.tokenizer, observations)
        turn = Message("assistant", _PLACEHOLDER)
        closed = render_messages(self.tokenizer, [*history, turn], self.tools, add_generation_prompt=False)
        full = render_messages(
            self.tokenizer, [*history, turn, *observations], self.tools, add_generation_prompt=True
        )
        if not full.startswith(closed):
            raise ValueError("chat template is not prefix-stable: appending messages changed earlier text")
        cut = closed.rindex(_PLACEHOLDER) + len(_PLACEHOLDER)
        tail = closed[cut:]  # e.g. "<|im_end|>\n"
        if stop_text and tail.startswith(stop_text):
            tail = tail[len(stop_text) :]  # the model already produced the end-of-turn token
        return tail + full[len(closed) :]


class GroupPrefill:
    """Lets the episodes of one GRPO group prefill their common prompt once.

    The first episode to arrive sends its prompt to the engine as a one-token greedy request, whose
    full K/V blocks then sit in the engine's prefix cache; the others wait for it, so their own
    requests find the prompt cached and prefill only its last partial block. Without this, the
    group's requests arrive in the same scheduler step, before any block is cached, and each prefills
    the whole prompt. Only useful with an engine that caches prefixes. The warm-up's output is
    discarded and never trained on; a failure in it is ignored (the episodes' own requests report
    engine errors)."""

    def __init__(self) -> None:
        self._done: asyncio.Event | None = None
        self._prompt: list[int] | None = None

    async def __call__(
        self, engine: Engine, prompt_ids: list[int], images: list[ImagePart] | None = None
    ) -> None:
        from posttrain.engine import GenerationRequest, SamplingParams

        if self._done is None:
            self._done, self._prompt = asyncio.Event(), list(prompt_ids)
            try:
                await engine.agenerate(
                    GenerationRequest(
                        prompt_token_ids=list(prompt_ids),
                        params=SamplingParams(temperature=0.0, max_tokens=1),
                        images=list(images or []),
                    )
                )
            except Exception:  # noqa: BLE001, S110 - see the class doc
                pass
            finally:
                self._done.set()
        elif self._prompt == list(prompt_ids):
            await self._done.wait()


async def run_episode(
    engine: Engine,
    tokenizer: Any,
    domain: Any,
    task: Task,
    sandbox: Any,
    sampling: SamplingParams,
    limits: EpisodeLimits,
    policy_version: int = 0,
    group_id: int = 0,
    chat_format: str = "smollm2",
    prefill_gate: GroupPrefill | None = None,
) -> Trajectory:
    """Run one episode to the end and return its trajectory. Never raises for model output.

    With a `prefill_gate` shared by the episodes of one group, their common first prompt is
    prefilled once (see `GroupPrefill`) before the first turn's request."""
    from posttrain.engine import GenerationRequest

    timings = {"generate_s": 0.0, "env_s": 0.0}
    env = domain.make_env(sandbox, chat_format=chat_format)
    t0 = time.perf_counter()
    obs = await env.reset(task)
    timings["env_s"] += time.perf_counter() - t0
    history: list[Message] = list(obs.messages)
    glue = GlueRenderer(tokenizer, obs.tools)
    prompt_ids, _ = encode_with_images(tokenizer, history, obs.tools or None)
    vision = image_inputs(tokenizer) is not None  # a VLM sees the images behind its placeholders
    token_ids = list(prompt_ids)
    loss_mask = [0] * len(prompt_ids)
    logprobs = [0.0] * len(prompt_ids)
    budget_end = len(prompt_ids) + limits.max_episode_tokens
    traj = Trajectory(
        task=task,
        token_ids=token_ids,
        loss_mask=loss_mask,
        behavior_logprobs=logprobs,
        prompt_len=len(prompt_ids),
        policy_version=policy_version,
        timings=timings,
        group_id=group_id,
        images=[img for m in history for img in m.images],
    )
    eos_ids = set(sampling.stop_token_ids)
    info: dict[str, Any] = {}
    for turn in range(limits.max_turns):
        room = budget_end - len(token_ids)
        if room <= 0:
            traj.status = TrajectoryStatus.TRUNCATED
            break
        params = replace(sampling, max_tokens=min(limits.max_new_tokens, room), n=1)
        if sampling.seed is not None:
            params = replace(params, seed=sampling.seed * 1009 + turn)
        t0 = time.perf_counter()
        if turn == 0 and prefill_gate is not None:
            await prefill_gate(engine, token_ids, traj.images if vision else None)
        try:
            images = list(traj.images) if vision else []
            out = await engine.agenerate(GenerationRequest(list(token_ids), params, images=images))
        except Exception as err:  # an engine failure is infrastructure, not a wrong answer
            traj.status = TrajectoryStatus.ENGINE_ERROR
            traj.info["error"] = f"{type(err).__name__}: {err}"
            return traj
        timings["generate_s"] += time.perf_counter() - t0
        completion = out.completions[0]
        token_ids.extend(completion.token_ids)
        loss_mask.extend([1] * len(completion.token_ids))
        logprobs.extend(float(x) for x in completion.logprobs)
        if turn == 0 or traj.routing is not None:  # MoE expert choices: the new positions this turn fed
            known = traj.routing or []
            new = completion.routing
            traj.routing = None if new is None else known + new[len(known) :]
        traj.clipped = completion.finish_reason == "length"  # cut at max_tokens: the last turn's counts
        ends_with_stop = bool(completion.token_ids) and completion.token_ids[-1] in eos_ids
        text = tokenizer.decode(completion.token_ids[:-1] if ends_with_stop else completion.token_ids)
        traj.turns = turn + 1
        t0 = time.perf_counter()
        result = await env.step(text)
        timings["env_s"] += time.perf_counter() - t0
        info = dict(result.info)
        if info.get("infra_failure"):
            traj.status = TrajectoryStatus.SANDBOX_ERROR
            traj.info = info
            return traj
        if info.get("reward_fn_error"):
            traj.status = TrajectoryStatus.REWARD_FN_ERROR
            traj.info = info
            return traj
        if result.done:
            traj.reward = float(result.reward or 0.0)
            traj.rewards = dict(result.rewards)
            traj.info = info
            return traj
        stop_text = tokenizer.decode([completion.token_ids[-1]]) if ends_with_stop else None
        glue_ids = tokenizer.encode(
            glue.glue_text(history, result.observations, stop_text), add_special_tokens=False
        )
        history.append(Message("assistant", text))
        history.extend(result.observations)
        if len(token_ids) + len(glue_ids) >= budget_end:
            traj.status = TrajectoryStatus.TRUNCATED
            break
        token_ids.extend(glue_ids)
        traj.images.extend(img for m in result.observations for img in m.images)
        loss_mask.extend([0] * len(glue_ids))
        logprobs.extend([0.0] * len(glue_ids))
    else:
        traj.status = TrajectoryStatus.TRUNCATED
    # Out of turns or tokens before the environment said done: scored as the environment finalises it.
    final = await _finalize(env)
    traj.reward = float(final.get("reward", 0.0))
    traj.rewards = dict(final.get("rewards", {"correct": 0.0, "success": 0.0}))
    traj.info = {**info, **final.get("info", {}), "truncated": True}
    if traj.info.get("infra_failure"):
        traj.status = TrajectoryStatus.SANDBOX_ERROR
    elif traj.info.get("reward_fn_error"):
        traj.status = TrajectoryStatus.REWARD_FN_ERROR
    return traj


async def _finalize(env: Any) -> dict[str, Any]:
    """Score an unfinished episode: environments may define `finalize()`; otherwise it scores 0."""
    fin = getattr(env, "finalize", None)
    if fin is None:
        return {"reward": 0.0, "rewards": {"correct": 0.0, "success": 0.0}}
    res = await fin()
    return {"reward": res.reward or 0.0, "rewards": res.rewards, "info": res.info}
