"""Token exactness of the agent loop: the training tokens are the engine's ids plus the appended
observation glue, never a re-tokenized conversation, and they decode to the rendered conversation."""

from __future__ import annotations

import asyncio

from posttrain.engine import SamplingParams
from posttrain.envs import get_domain
from posttrain.models import render_messages
from posttrain.rollout import EpisodeLimits, run_episode
from posttrain.types import Message, Pick, TrajectoryStatus

from .conftest import ScriptedEngine


def _conversation(domain, task, script):
    """Replay the script through a fresh environment to get the messages a renderer would show."""

    async def go():
        env = domain.make_env(None)
        obs = await env.reset(task)
        msgs = list(obs.messages)
        for text in script:
            res = await env.step(text)
            msgs.append(Message("assistant", text))
            if res.done:
                break
            msgs.extend(res.observations)
        return msgs, obs.tools

    return asyncio.run(go())


def _run(engine, tokenizer, domain, task, max_turns=8):
    params = SamplingParams(max_tokens=256, stop_token_ids=[tokenizer.eos_token_id])
    return asyncio.run(
        run_episode(engine, tokenizer, domain, task, None, params, EpisodeLimits(max_turns, 4096, 256))
    )


def test_multi_turn_tool_episode_is_token_exact(tokenizer):
    domain = get_domain("tools.apis")
    task = domain.task("train", 0, 3)
    script = domain.reference(task)
    assert len(script) >= 2, "tools.apis reference must take more than one turn"
    engine = ScriptedEngine(tokenizer, script)
    traj = _run(engine, tokenizer, domain, task)

    assert traj.status == TrajectoryStatus.OK and traj.reward == 1.0
    assert traj.turns == len(script)
    # every engine request is exactly the trajectory prefix, and every output sits right after it, masked 1
    for req, out in zip(engine.requests, engine.outputs, strict=True):
        assert traj.token_ids[: len(req)] == req
        assert traj.token_ids[len(req) : len(req) + len(out)] == out
        assert traj.loss_mask[len(req) : len(req) + len(out)] == [1] * len(out)
        assert traj.behavior_logprobs[len(req) : len(req) + len(out)] == [-0.25] * len(out)
    assert sum(traj.loss_mask) == sum(len(o) for o in engine.outputs)
    assert all(lp == 0.0 for lp, m in zip(traj.behavior_logprobs, traj.loss_mask, strict=True) if m == 0)
    # the whole token sequence decodes to the conversation as the chat template renders it
    messages, tools = _conversation(domain, task, script)
    rendered = render_messages(tokenizer, messages, tools, add_generation_prompt=False)
    assert tokenizer.decode(traj.token_ids) + "\n" == rendered


def test_single_turn_episode_is_token_exact(tokenizer):
    domain = get_domain("math")
    task = domain.task("train", 0, 0)
    script = domain.reference(task)
    engine = ScriptedEngine(tokenizer, script)
    traj = _run(engine, tokenizer, domain, task)
    assert traj.turns == 1 and traj.reward == 1.0
    assert traj.token_ids == engine.requests[0] + engine.outputs[0]
    assert traj.loss_mask == [0] * len(engine.requests[0]) + [1] * len(engine.outputs[0])
    assert traj.prompt_len == len(engine.requests[0])


def test_wrong_answer_is_scored_not_crashed(tokenizer):
    domain = get_domain("math")
    task = domain.task("train", 0, 0)
    engine = ScriptedEngine(tokenizer, ["\x00\x01 <tool_call>{not json</tool_call> I refuse."])
    traj = _run(engine, tokenizer, domain, task)
    assert traj.status == TrajectoryStatus.OK and traj.reward < 1.0


def test_turn_limit_truncates_and_scores(tokenizer):
    domain = get_domain("tools.apis")
    task = domain.task("train", 0, 3)
    script = domain.reference(task)
    engine = ScriptedEngine(tokenizer, script)
    traj = _run(engine, tokenizer, domain, task, max_turns=1)
    assert traj.status == TrajectoryStatus.TRUNCATED
    assert traj.turns == 1 and traj.reward < 1.0


class RecordingEngine:
    """Answers every request with a fixed text after yielding to the loop; records (prompt, max_tokens)."""

    def __init__(self, tokenizer, text: str) -> None:
        self.tokenizer, self.text, self.version = tokenizer, text, 0
        self.calls: list[tuple[list[int], int]] = []

    async def agenerate(self, request):
        from posttrain.engine import Completion, GenerationOutput

        self.calls.append((list(request.prompt_token_ids), request.params.max_tokens))
        await asyncio.sleep(0.01)
        ids = self.tokenizer.encode(self.text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        ids = ids[: request.params.max_tokens]
        return GenerationOutput(
            "r", list(request.prompt_token_ids), [Completion(ids, [-0.5] * len(ids), self.text, "stop")], 0.0
        )


def test_group_prompt_is_prefilled_once_before_the_group_generates(tokenizer):
    """With share_prefill, each group sends its prompt once as a 1-token request and only then its
    group_size episode requests; the warm-up's token never enters a trajectory."""
    from posttrain.rollout import collect_groups

    domain = get_domain("math")
    tasks = [domain.task("train", 0, i, seed=0) for i in range(2)]
    params = SamplingParams(temperature=1.0, max_tokens=32, stop_token_ids=[tokenizer.eos_token_id])
    limits = EpisodeLimits(max_turns=1, max_episode_tokens=512, max_new_tokens=32)
    for share in (True, False):
        engine = RecordingEngine(tokenizer, "<answer>4</answer>")
        batch = asyncio.run(
            collect_groups(
                engine,
                tokenizer,
                [Pick(None, domain, t, i) for i, t in enumerate(tasks)],
                3,
                None,
                params,
                limits,
                0,
                0,
                0,
                share_prefill=share,
            )
        )
        warm = [c for c in engine.calls if c[1] == 1]
        assert len(warm) == (2 if share else 0) and len(engine.calls) == 6 + len(warm)
        if share:  # each group's warm-up came before any of that group's own requests
            for prompt, _ in warm:
                first = next(i for i, c in enumerate(engine.calls) if c[0] == prompt)
                assert engine.calls[first][1] == 1
        answer = tokenizer.encode("<answer>4</answer>", add_special_tokens=False) + [tokenizer.eos_token_id]
        for traj in batch.trajectories:
            assert traj.token_ids[traj.prompt_len :] == answer and sum(traj.loss_mask) == len(answer)


def test_group_prefill_makes_the_paged_engine_store_each_prompt_once():
    """Through the real paged engine: with share_prefill every episode after the warm-up finds the
    prompt's full blocks cached (2 groups x 8 episodes x 3 full blocks of 16 = 768 hit tokens)."""
    from posttrain.config import load_config
    from posttrain.engine import make_engine
    from posttrain.models import load_policy, load_tokenizer
    from posttrain.rollout import collect_groups

    tok = load_tokenizer("tiny:llama")
    cfg = load_config(None, ["model.spec=tiny:llama", "engine.dtype=float32"])
    domain = get_domain("math")
    tasks = [domain.task("train", 0, i, seed=0) for i in range(2)]
    params = SamplingParams(temperature=1.0, max_tokens=8, stop_token_ids=[tok.eos_token_id])
    stats = {}
    for share in (False, True):
        engine = make_engine(cfg.engine, load_policy("tiny:llama"), tok)
        batch = asyncio.run(
            collect_groups(
                engine,
                tok,
                [Pick(None, domain, t, i) for i, t in enumerate(tasks)],
                8,
                None,
                params,
                EpisodeLimits(1, 512, 8),
                0,
                0,
                0,
                share_prefill=share,
            )
        )
        assert {t.prompt_len for t in batch.trajectories} == {50}
        stats[share] = engine.kv_stats()
    assert stats[False]["prefix_hit_tokens"] == 0
    assert stats[True]["prefix_hit_tokens"] == 2 * 8 * 48
    assert stats[True]["peak_blocks_allocated"] < stats[False]["peak_blocks_allocated"] / 2
