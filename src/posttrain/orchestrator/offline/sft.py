"""Supervised fine-tuning runs: the data (a JSONL chat file, or an environment's reference solutions
replayed through it for the tool observations), its held-out split, and the loop that feeds the
Learner and writes the run directory RL runs write (config.yaml, metrics.jsonl, checkpoints/,
policy/). Tokenizing a conversation and the loss are `train`'s; this module only moves data.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.config import RunConfig, save_config
from posttrain.orchestrator.checkpoint import save_checkpoint
from posttrain.orchestrator.signals import stop_on_signals
from posttrain.telemetry import MetricsLogger, Progress, RunDir
from posttrain.types import ContentError, ContentPart, Message, TextPart, ToolSpec, content_from_openai

LEARNER_DIR = "learner"
SFT_STATE = "sft_state.json"
ROLES = ("system", "user", "assistant", "tool")


class SFTDataError(ValueError):
    """Bad SFT data; the message names the file and line (or the task) and what a row must look like."""


@dataclass
class ChatExample:
    """One training conversation; `source` says where it came from (`file:line` or a task id)."""

    messages: list[Message]
    tools: list[ToolSpec] = field(default_factory=list)
    source: str = ""


# ------------------------------------------------------------------------------------------------
# JSONL chat files

ROW_SHAPES = (
    '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]} '
    '(roles system/user/assistant/tool, assistant "tool_calls" in the OpenAI shape, optional "tools") '
    'or {"prompt": "...", "completion": "..."}'
)


def _text(content: Any, where: str) -> str | list[ContentPart]:
    """A message's content: a string, null, or a list of OpenAI content parts (text parts joined into a
    string; with an image part - a PNG data URL or our `image` part - the parts as they are)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        try:
            parts = content_from_openai(content, f"{where}: content")
        except ContentError as err:
            raise SFTDataError(str(err)) from None
        if all(isinstance(p, TextPart) for p in parts):
            return "".join(p.text for p in parts)
        return parts
    raise SFTDataError(
        f"{where}: content must be a string, null or a list of content parts, got {type(content).__name__}"
    )


def _call(raw: Any, where: str) -> tuple[str, dict[str, Any]]:
    """An OpenAI tool call {"type": "function", "function": {"name", "arguments"}} (or {"name",
    "arguments"}) -> (name, arguments); arguments may be a JSON string, as OpenAI writes them."""
    fn = raw.get("function", raw) if isinstance(raw, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise SFTDataError(f'{where}: a tool call needs {{"function": {{"name": ..., "arguments": ...}}}}')
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise SFTDataError(
                f"{where}: the arguments of tool call '{name}' are a string that is not JSON"
            ) from None
    if not isinstance(args, dict):
        raise SFTDataError(f"{where}: the arguments of tool call '{name}' must be a JSON object")
    return name, args


def _tool_spec(raw: Any, where: str) -> ToolSpec:
    fn = raw.get("function", raw) if isinstance(raw, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise SFTDataError(
            f'{where}: a tool needs {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}'
        )
    params = fn.get("parameters", {"type": "object", "properties": {}})
    return ToolSpec(fn["name"], str(fn.get("description", "")), params)


def parse_row(row: Any, where: str, chat_format: str = "smollm2") -> ChatExample:
    """One JSONL row -> a `ChatExample`. Assistant `tool_calls` become the tool-call markup of
    `chat_format` after the message's text, as the policy writes them in the RL loop."""
    from posttrain.envs.parsers import get_parser

    if not isinstance(row, dict):
        raise SFTDataError(f"{where}: a row must be a JSON object: {ROW_SHAPES}")
    if "messages" in row:
        raw_messages = row["messages"]
        if not isinstance(raw_messages, list) or not raw_messages:
            raise SFTDataError(f"{where}: 'messages' must be a non-empty list")
    elif "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        raw_messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if isinstance(row.get("system"), str):
            raw_messages.insert(0, {"role": "system", "content": row["system"]})
        raw_messages += (
            list(completion)
            if isinstance(completion, list)
            else [{"role": "assistant", "content": completion}]
        )
    else:
        raise SFTDataError(f"{where}: a row needs 'messages' or both 'prompt' and 'completion': {ROW_SHAPES}")
    fmt = get_parser(chat_format)
    messages: list[Message] = []
    for j, raw in enumerate(raw_messages):
        at = f"{where}: message {j}"
        if not isinstance(raw, dict):
            raise SFTDataError(f"{at}: a message must be a JSON object with 'role' and 'content'")
        role = raw.get("role")
        if role not in ROLES:
            raise SFTDataError(f"{at}: unknown role {role!r} (valid roles: {', '.join(ROLES)})")
        text = _text(raw.get("content"), at)
        if not isinstance(text, str):  # image parts
            if role == "assistant":
                raise SFTDataError(f"{at}: an assistant message cannot hold images (only the prompt side)")
            messages.append(Message(role, text))
            continue
        calls = raw.get("tool_calls")
        if calls:
            if role != "assistant":
                raise SFTDataError(f"{at}: only assistant messages carry tool_calls")
            if not isinstance(calls, list):
                raise SFTDataError(f"{at}: tool_calls must be a list")
            markup = fmt.format_calls([_call(c, at) for c in calls])
            text = f"{text}\n{markup}" if text.strip() else markup
        if role == "assistant" and not text.strip():
            raise SFTDataError(f"{at}: an assistant message with no content and no tool_calls")
        messages.append(Message(role, text))
    if not any(m.role == "assistant" for m in messages):
        raise SFTDataError(f"{where}: the row has no assistant turn, so there is nothing to train on")
    if messages[0].role == "assistant":
        raise SFTDataError(
            f"{where}: the conversation starts with an assistant turn; it needs a prompt before it"
        )
    raw_tools = row.get("tools") or []
    if not isinstance(raw_tools, list):
        raise SFTDataError(f"{where}: 'tools' must be a list of OpenAI function tools")
    tools = [_tool_spec(t, f"{where}: tools[{k}]") for k, t in enumerate(raw_tools)]
    return ChatExample(messages, tools, where)


def jsonl_rows(path: str | Path, error: type[ValueError], what: str, shape: str) -> list[tuple[Any, str]]:
    """Every non-blank line of the JSONL file `path`, parsed, with its `file:line`; a missing file, a line
    that is not JSON or a file without rows raises `error` naming the file (and line), `what` one line
    holds and the row `shape`."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{p}: no such file (give a JSONL file with one {what} per line: {shape})")
    out: list[tuple[Any, str]] = []
    with open(p, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                out.append((json.loads(line), where))
            except json.JSONDecodeError as err:
                raise error(
                    f"{where}: not valid JSON ({err.msg} at column {err.colno}); each line must be one JSON "
                    f"object: {shape}"
                ) from None
    if not out:
        raise error(f"{p}: the file holds no rows")
    return out


def load_jsonl(path: str | Path, chat_format: str = "smollm2") -> list[ChatExample]:
    """Every non-blank line of `path` as a `ChatExample`; the first bad line raises `SFTDataError`."""
    rows = jsonl_rows(path, SFTDataError, "conversation", ROW_SHAPES)
    return [parse_row(row, where, chat_format) for row, where in rows]


# ------------------------------------------------------------------------------------------------
# environments' reference solutions


def _reference_texts(domain: Any, task: Any, chat_format: str) -> list[str]:
    if "chat_format" in inspect.signature(domain.reference).parameters:
        return list(domain.reference(task, chat_format=chat_format))
    return list(domain.reference(task))


async def replay_reference(
    domain: Any, task: Any, sandbox: Any = None, chat_format: str = "smollm2"
) -> ChatExample:
    """The conversation of `task`'s reference solution: the environment's prompt, each reference text
    as an assistant turn, and between turns the observations the environment answers it with (tool
    results), exactly as a rollout would see them. Raises SFTDataError if the reference does not finish
    the episode with success."""
    env = domain.make_env(sandbox, chat_format=chat_format)
    obs = await env.reset(task)
    messages = list(obs.messages)
    result = None
    for text in _reference_texts(domain, task, chat_format):
        result = await env.step(text)
        messages.append(Message("assistant", text))
        if result.done:
            break
        messages.extend(result.observations)
    if result is None or not result.done:
        raise SFTDataError(f"{task.id}: the reference solution ends before the episode does")
    if result.info.get("infra_failure"):
        raise SFTDataError(
            f"{task.id}: the sandbox failed while replaying the reference: {result.info.get('infra_error')}"
        )
    if result.info.get("reward_fn_error"):
        raise SFTDataError(f"{task.id}: {result.info['reward_fn_error']}")
    success = result.rewards.get("success", result.reward)
    if not success:
        raise SFTDataError(f"{task.id}: the reference solution does not succeed (rewards {result.rewards})")
    return ChatExample(messages, list(obs.tools), task.id)


async def aexamples_from_env(
    domain: Any,
    levels: list[int],
    n: int,
    split: str = "train",
    seed: int = 0,
    sandbox: Any = None,
    chat_format: str = "smollm2",
) -> list[ChatExample]:
    """`n` reference conversations of `domain`: tasks 0, 1, ... of `split`, round-robin over `levels`
    (task i is level levels[i % len], index i // len)."""
    bad = [lvl for lvl in levels if lvl not in domain.difficulties]
    if bad:
        raise SFTDataError(
            f"domain '{domain.name}' has no difficulty {bad[0]} (valid: {domain.difficulties})"
        )
    out = []
    for i in range(n):
        task = domain.task(split, levels[i % len(levels)], i // len(levels), seed)
        out.append(await replay_reference(domain, task, sandbox, chat_format))
    return out


def examples_from_env(
    name: str,
    levels: list[int],
    n: int,
    split: str = "train",
    seed: int = 0,
    chat_format: str = "smollm2",
    options: dict[str, Any] | None = None,
) -> list[ChatExample]:
    """`aexamples_from_env` of the registered domain `name` (no sandbox: for domains without one)."""
    from posttrain.envs import get_domain

    domain = get_domain(name, **(options or {}))
    return asyncio.run(aexamples_from_env(domain, levels, n, split, seed, None, chat_format))


def split_heldout(
    examples: list[ChatExample], frac: float, seed: int
) -> tuple[list[ChatExample], list[ChatExample]]:
    """(train, heldout) by a seeded shuffle: round(frac x len) rows held out (at least one when frac > 0
    and there are two rows or more)."""
    k = round(frac * len(examples))
    if frac > 0 and len(examples) >= 2:
        k = max(k, 1)
    k = min(k, len(examples) - 1)
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    held = set(order[:k])
    return [e for i, e in enumerate(examples) if i not in held], [
        e for i, e in enumerate(examples) if i in held
    ]


def build_examples(cfg: RunConfig) -> tuple[list[ChatExample], list[ChatExample]]:
    """(train, heldout) examples of `cfg.sft`'s source. An environment that runs code gets a sandbox
    (cfg.sandbox) for the replay."""
    s = cfg.sft
    if s.data is not None:
        return split_heldout(load_jsonl(s.data, s.chat_format), s.heldout_frac, cfg.seed)
    if s.from_env is None:
        raise SFTDataError(
            "no SFT data: give --data FILE.jsonl or --from-env DOMAIN (sft.data / sft.from_env)"
        )
    from posttrain.envs import get_domain

    options = {d.name: d.options for d in cfg.envs.domains}.get(s.from_env, {})
    domain = get_domain(s.from_env, **options)
    n_held = math.ceil(s.heldout_frac * s.n) if s.heldout_frac > 0 and "heldout" in domain.splits else 0

    async def build() -> tuple[list[ChatExample], list[ChatExample]]:
        sandbox = None
        if domain.requires_sandbox:
            from posttrain.sandbox import make_sandbox

            sandbox = make_sandbox(cfg.sandbox)
        try:
            train = await aexamples_from_env(domain, s.levels, s.n, "train", cfg.seed, sandbox, s.chat_format)
            held = await aexamples_from_env(
                domain, s.levels, n_held, "heldout", cfg.seed, sandbox, s.chat_format
            )
        finally:
            if sandbox is not None:
                await sandbox.close()
        return train, held

    train, held = asyncio.run(build())
    if n_held == 0 and s.heldout_frac > 0:  # the domain has no heldout split: hold out training rows
        return split_heldout(train, s.heldout_frac, cfg.seed)
    return train, held


# ------------------------------------------------------------------------------------------------
# the run


def encode_examples(
    tokenizer: Any, examples: list[ChatExample], max_tokens: int, images: Any = None
) -> tuple[list[Any], int]:
    """(samples, skipped): each example as the Learner's `Sample`; longer than `max_tokens` skipped. A
    vision model's images go into the `images` store (an `ImageStore`)."""
    from posttrain.train import sft_sample

    out, skipped = [], 0
    for ex in examples:
        try:
            sample = sft_sample(tokenizer, ex.messages, ex.tools, images)
        except ValueError as err:
            raise SFTDataError(f"{ex.source}: {err}") from None
        if len(sample.token_ids) > max_tokens:
            skipped += 1
            continue
        out.append(sample)
    return out, skipped


def total_steps(cfg: RunConfig, n_train: int) -> int:
    s = cfg.sft
    return s.steps or s.epochs * math.ceil(n_train / s.batch_size)


def batches(n: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """Row indices of each step's batch: epochs of a seeded shuffle, cut into batches of `batch_size`
    (an epoch's last batch may be smaller), for `steps` steps."""
    out: list[list[int]] = []
    epoch = 0
    while len(out) < steps:
        order = list(range(n))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        for start in range(0, n, batch_size):
            if len(out) == steps:
                break
            out.append(order[start : start + batch_size])
        epoch += 1
    return out


class SFTRun:
    """A supervised fine-tuning run: `SFTRun(cfg, run_dir).train()` -> summary; the policy is
    written to `run_dir/policy` as a HF folder that `model.spec` and `posttrain eval` load."""

    def __init__(self, cfg: RunConfig, run_dir: RunDir, *, show_progress: bool | None = None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.show_progress = cfg.telemetry.progress if show_progress is None else show_progress
        self.step = 0
        self.stop_signal: int | None = None

    def build(self, train: list[ChatExample], heldout: list[ChatExample]) -> None:
        """Tokenize the examples and build the Learner (trainer.lr_decay_steps defaults to the run's steps)."""
        import torch

        from posttrain.models import load_tokenizer
        from posttrain.models.vision import ImageStore, image_inputs
        from posttrain.train import Learner

        cfg = self.cfg
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.tokenizer = load_tokenizer(cfg.model.spec)
        images = (
            ImageStore(self.run_dir.path / "images") if image_inputs(self.tokenizer) is not None else None
        )
        self.train_samples, skipped = encode_examples(self.tokenizer, train, cfg.sft.max_seq_tokens, images)
        self.heldout_samples, skipped_held = encode_examples(
            self.tokenizer, heldout, cfg.sft.max_seq_tokens, images
        )
        self.skipped = skipped + skipped_held
        if not self.train_samples:
            raise SFTDataError(
                f"no training example fits sft.max_seq_tokens={cfg.sft.max_seq_tokens} ({skipped} skipped)"
            )
        self.steps = total_steps(cfg, len(self.train_samples))
        if cfg.trainer.lr_schedule != "constant" and cfg.trainer.lr_decay_steps == 0:
            cfg.trainer.lr_decay_steps = self.steps
        self.learner = Learner(cfg.model, cfg.trainer, cfg.algorithm, seed=cfg.seed, batch_cfg=cfg.batch)
        if images is not None:
            self.learner.attach_image_store(images)

    def heldout_loss(self) -> dict[str, float]:
        if not self.heldout_samples:
            return {}
        out = self.learner.sft_loss(self.heldout_samples)
        return {"heldout/loss": out["loss"], "heldout/tokens": out["tokens"]}

    def save(self) -> Path:
        def write(tmp: Path) -> None:
            self.learner.save(str(tmp / LEARNER_DIR))
            (tmp / SFT_STATE).write_text(json.dumps({"step": self.step, "steps": self.steps}))

        return save_checkpoint(
            self.run_dir.checkpoints, self.step, write, keep=self.cfg.orchestrator.keep_checkpoints
        )

    def _record_stop(self, signum: int) -> None:
        self.stop_signal = signum

    def train(self) -> dict[str, Any]:
        """Train for the configured steps, logging train loss/tokens every step and the held-out loss
        every sft.eval_every steps and at the end; checkpoint; export the policy. Stops checkpointed
        on SIGINT/SIGTERM (no policy export then)."""
        from posttrain.orchestrator.eval.export import save_hf_folder

        cfg, s = self.cfg, self.cfg.sft
        save_config(cfg, self.run_dir.config)  # with trainer.lr_decay_steps as resolved
        logger = MetricsLogger(
            self.run_dir.metrics if cfg.telemetry.jsonl else None,
            self.run_dir.tb if cfg.telemetry.tensorboard else None,
        )
        plan = batches(len(self.train_samples), s.batch_size, self.steps, cfg.seed)
        initial = self.heldout_loss()
        last: dict[str, float] = {}
        t0 = time.perf_counter()
        with (
            stop_on_signals(self._record_stop),
            Progress(self.steps, "sft", enabled=self.show_progress) as progress,
        ):
            try:
                for rows in plan:
                    m = self.learner.sft_step([self.train_samples[i] for i in rows])
                    self.step += 1
                    metrics = {f"train/{k}": v for k, v in m.items()}
                    metrics["epoch"] = self.step * s.batch_size / len(self.train_samples)
                    if s.eval_every and (self.step % s.eval_every == 0 or self.step == self.steps):
                        metrics.update(self.heldout_loss())
                    metrics["time/elapsed_s"] = time.perf_counter() - t0
                    logger.log(self.step, metrics)
                    last = metrics
                    due = s.checkpoint_every and self.step % s.checkpoint_every == 0
                    if due or self.step == self.steps or self.stop_signal is not None:
                        self.save()
                    figures = {"loss": m["loss"]}
                    if "heldout/loss" in metrics:
                        figures["heldout"] = metrics["heldout/loss"]
                    progress.advance(1, figures)
                    if self.stop_signal is not None:
                        break
            finally:
                logger.close()
        if self.stop_signal is None:
            save_hf_folder(self.learner.weights(), cfg.model.spec, self.run_dir.path / "policy")
        return {
            "step": self.step,
            "steps": self.steps,
            "interrupted": self.stop_signal is not None,
            "signal": self.stop_signal,
            "train_examples": len(self.train_samples),
            "heldout_examples": len(self.heldout_samples),
            "skipped_long": self.skipped,
            "heldout_loss_start": initial.get("heldout/loss"),
            "last": last,
            "wall_s": time.perf_counter() - t0,
        }
