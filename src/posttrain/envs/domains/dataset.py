"""`dataset`: your own prompt/answer data (JSONL, JSON, CSV or Parquet, or a Hugging Face Hub dataset) as
a single-turn domain, scored by a reward function you name by Python path, like TRL's `reward_funcs`, or
by answer matching.

    envs:
      domains:
        - name: dataset
          options: {path: data/train.jsonl, reward_fn: my_rewards:exact, prompt_key: prompt, answer_key: answer}
        - name: dataset
          options: {hub: openai/gsm8k, config: main, split: train, prompt_key: question}

A Hub dataset (`hub: org/name`, or `org/name@revision`) is read through `datasets` from its cache
(`HF_HOME/datasets`), downloaded there when the Hub is reachable and HF_HUB_OFFLINE is unset; `split`
(default `train`) is the Hub split read, `config` its configuration.

A row's prompt is a string (sent as one user message) or a list of `{role, content}` messages. Splits:
rows carry a `split_key` column ("train"; "heldout", "test", "validation" or "eval" for held out), or
else each row's split is the hash of its content (20% held out), so train and held-out never share a
row. Levels: an integer `difficulty_key` column, or one level 0. Task `index` walks the split's rows in
an order shuffled by `seed`, cycling.

`reward_fn` is `package.module:function` or `path/to/file.py:function` with TRL's signature,
`fn(prompts, completions, **columns) -> list[float]`, called with batches of one (a prompt/completion
is a string, or a message list when the prompt is one). It returns a reward, any finite number (a
penalty of -1 is a reward; GRPO's advantages do not need [0, 1]), or a dict with `reward` and optionally
`success`. Without one, the answer is extracted as in `math` (`<answer>` tags first) and compared with the
row's answer (numbers after normalisation, text case-insensitively): reward = 0.85 correct + 0.15 format,
success = correct. Success (eval's accuracy) is the function's `success` when it gives one, else
reward >= 1. A reward function that raises, or returns no finite number (nan, inf, a string), is a user
error: the episode's `info["reward_fn_error"]` names the function, the row and the exception, the
episode is never trained on, and the run stops (orchestrator.max_reward_fn_errors). It is a bug of the
function, neither a mistake of the model nor an infrastructure failure.
"""

from __future__ import annotations

import csv
import json
import math
import random
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.envs.base import (
    HELDOUT,
    TRAIN,
    Domain,
    Environment,
    Observation,
    StepResult,
    check_difficulty,
    check_split,
    content_digest,
    split_of,
    stable_hash,
)
from posttrain.envs.extract import extract_answer, normalize_number
from posttrain.envs.registry import import_target, register_env
from posttrain.types import Message, Task

W_CORRECT, W_FORMAT = 0.85, 0.15
DEFAULT_INSTRUCTION = "Put the final answer between <answer> and </answer>."
HELDOUT_NAMES = {"heldout", "test", "validation", "valid", "val", "eval", "dev"}
ROLES = {"system", "user", "assistant"}


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a .jsonl / .json (a list of objects) / .csv / .parquet file; errors name the file and line."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"dataset: no such file '{p}'")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        rows = []
        with p.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"dataset: {p}:{lineno} is not valid JSON ({err.msg})") from None
                if not isinstance(row, dict):
                    raise ValueError(
                        f"dataset: {p}:{lineno} is a {type(row).__name__}, expected a JSON object"
                    )
                rows.append(row)
    elif suffix == ".json":
        try:
            rows = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"dataset: {p} is not valid JSON ({err.msg} at line {err.lineno})") from None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"dataset: {p} must hold a JSON list of objects")
    elif suffix == ".csv":
        with p.open(encoding="utf-8", newline="") as fh:
            rows = list(csv.DictReader(fh))
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:  # pragma: no cover - pyarrow is pinned in requirements.lock
            raise ValueError("dataset: reading .parquet needs pyarrow (pip install pyarrow)") from None
        rows = pq.read_table(p).to_pylist()
    else:
        raise ValueError(
            f"dataset: unsupported file type '{p.suffix}' for '{p}' (use .jsonl, .json, .csv or .parquet)"
        )
    if not rows:
        raise ValueError(f"dataset: '{p}' has no rows")
    return rows


def read_hub_rows(hub: str, split: str = "train", config: str | None = None) -> list[dict[str, Any]]:
    """The rows of split `split` of the Hub dataset `hub` (`org/name[@revision]`), through `datasets`;
    errors name the dataset and how to fetch it."""
    repo, _, revision = hub.partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")) or (revision == "" and hub.endswith("@")):
        raise ValueError(
            f"dataset: options.hub must be a Hub dataset id ORG/NAME or ORG/NAME@REVISION, got {hub!r}"
        )
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is pinned in requirements.lock
        raise ValueError(
            "dataset: options.hub needs the `datasets` package (the hub extra: pip install datasets==5.2.0)"
        ) from None
    fetch = (
        f"load it once where the Hub is reachable, with the same HF_HOME: `posttrain tasks sample dataset "
        f"--option hub={hub} --option split={split}" + (f" --option config={config}" if config else "") + "`"
    )
    try:
        table = datasets.load_dataset(repo, config, split=split, revision=revision or None)
    except datasets.exceptions.DatasetNotFoundError as err:  # missing, gated (the message says which)
        raise ValueError(f"dataset: Hub dataset '{hub}': {err}") from None
    except (ConnectionError, FileNotFoundError) as err:  # offline or unreachable, and not in the cache
        raise ValueError(f"dataset: Hub dataset '{hub}' is not in the cache ({err}); {fetch}") from None
    except ValueError as err:  # a split or config it does not have
        raise ValueError(f"dataset: Hub dataset '{hub}': {err}") from None
    rows = table.to_list()
    if not rows:
        raise ValueError(f"dataset: Hub dataset '{hub}' split '{split}' has no rows")
    return rows


def load_callable(spec: str) -> Callable[..., Any]:
    """`package.module:function` or `path/to/file.py:function` -> the function."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"reward_fn '{spec}' must be 'module:function' or 'file.py:function'")
    module = import_target(target, f"reward_fn '{spec}'")
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward_fn '{spec}': '{target}' has no function '{attr}'")
    return fn


def _messages(value: Any, where: str) -> list[Message]:
    if isinstance(value, str):
        return [Message(role="user", content=value)]
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        out = []
        for m in value:
            if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ValueError(
                    f"dataset: {where}: each prompt message needs a role in {sorted(ROLES)} and "
                    f"a string content, got {m!r}"[:300]
                )
            out.append(Message(role=m["role"], content=m["content"]))
        return out
    raise ValueError(f"dataset: {where}: the prompt must be a string or a list of {{role, content}} messages")


def answers_match(given: str, expected: Any) -> bool:
    return normalize_number(given).casefold() == normalize_number(str(expected)).casefold()


def default_score(text: str, answer: Any) -> tuple[float, dict[str, float], dict[str, Any]]:
    extracted = extract_answer(text)
    fmt = 1.0 if extracted.method == "tags" else 0.0
    correct = float(extracted.text is not None and answers_match(extracted.text[:2000], answer))
    info = {
        "extracted": extracted.text,
        "extract_method": extracted.method,
        "unparseable": int(extracted.text is None),
    }
    return W_CORRECT * correct + W_FORMAT * fmt, {"correct": correct, "format": fmt, "success": correct}, info


def call_reward_fn(
    fn: Callable[..., Any], prompt: Any, completion: Any, columns: dict[str, Any]
) -> dict[str, float]:
    """Call a TRL-style reward function on one (prompt, completion); returns {'reward', 'success'} (the
    reward any finite number) or raises ValueError naming what came back wrong."""
    kwargs = {k: [v] for k, v in columns.items() if k not in ("prompts", "completions")}
    value = fn(prompts=[prompt], completions=[completion], **kwargs)
    if isinstance(value, list | tuple):
        if len(value) != 1:
            raise ValueError(f"reward function returned {len(value)} values for 1 completion")
        value = value[0]
    success: Any = None
    if isinstance(value, dict):
        if "reward" not in value:
            raise ValueError(f"reward function returned a dict without 'reward': {sorted(value)}")
        success = value.get("success")
        value = value["reward"]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"reward function returned {value!r}; expected a finite number")
    reward = float(value)
    ok = float(reward >= 1.0) if success is None else float(bool(success))
    return {"reward": reward, "success": ok}


class DatasetEnv(Environment):
    max_turns = 1

    def __init__(
        self,
        reward_fn: Callable[..., Any] | None,
        conversational: bool,
        reward_fn_spec: str | None = None,
        source: str = "",
    ) -> None:
        self.reward_fn = reward_fn
        self.conversational = conversational
        self.reward_fn_spec = reward_fn_spec or getattr(reward_fn, "__name__", "reward_fn")
        self.source = source
        self._task: Task | None = None

    async def reset(self, task: Task) -> Observation:
        self._task = task
        return Observation(messages=list(task.prompt), tools=[])

    async def step(self, assistant_text: str) -> StepResult:
        if self._task is None:
            raise RuntimeError("step() before reset()")
        text = assistant_text if isinstance(assistant_text, str) else ""
        meta = self._task.meta
        if self.reward_fn is None:
            reward, rewards, info = default_score(text, meta["answer"])
            return StepResult([], reward, True, rewards, {**info, "turns": 1, "infra_failure": False})
        prompt: Any = meta["raw_prompt"]
        completion: Any = [{"role": "assistant", "content": text}] if self.conversational else text
        try:
            scored = call_reward_fn(self.reward_fn, prompt, completion, meta["row"])
        except Exception as err:  # noqa: BLE001 - the user's function failed: not the model's mistake
            detail = "".join(traceback.format_exception_only(type(err), err)).strip()
            where = f"row {meta['row_index']} of {self.source}" if self.source else f"row {meta['row_index']}"
            why = f"reward function {self.reward_fn_spec} failed on {where}: {detail}"
            return StepResult(
                [], None, True, {}, {"turns": 1, "infra_failure": False, "reward_fn_error": why[:800]}
            )
        return StepResult([], scored["reward"], True, scored, {"turns": 1, "infra_failure": False})


@register_env("dataset")
class DatasetDomain(Domain):
    description = (
        "your own prompt/answer rows (jsonl/json/csv/parquet, or `hub: org/name` instead of a path), scored by "
        "a reward function you name"
    )
    required_options = ("path",)  # or `hub`

    def __init__(
        self,
        path: str | None = None,
        reward_fn: str | None = None,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        split_key: str | None = None,
        difficulty_key: str | None = None,
        instruction: str | None = None,
        hub: str | None = None,
        split: str | None = None,
        config: str | None = None,
    ) -> None:
        if (path is None) == (hub is None):
            raise ValueError(
                "dataset: give options.path (a local file) or options.hub (a Hub dataset id ORG/NAME), "
                f"exactly one; got {'both' if path is not None else 'neither'}"
            )
        if hub is None and (split is not None or config is not None):
            raise ValueError(
                "dataset: options.split and options.config choose a Hub dataset's rows: give options.hub"
            )
        if hub is not None:
            rows = read_hub_rows(hub, split or "train", config)
            self.path = f"{hub} ({split or 'train'})"
        else:
            rows = read_rows(path)
            self.path = str(path)
        self.reward_fn_spec = reward_fn
        self.reward_fn = load_callable(reward_fn) if reward_fn else None
        self.answer_key = answer_key
        # the default scorer reads <answer> tags, so it asks for them unless told otherwise
        self.instruction = (
            instruction if instruction is not None else ("" if reward_fn else DEFAULT_INSTRUCTION)
        )
        self.by_level: dict[tuple[str, int], list[int]] = {}
        self.rows = rows
        conversational = set()
        for i, row in enumerate(rows):
            where = f"{self.path} row {i}"
            if prompt_key not in row:
                raise ValueError(
                    f"dataset: {where} has no '{prompt_key}' column (columns: {', '.join(sorted(row))}); "
                    "set options.prompt_key"
                )
            _messages(row[prompt_key], where)
            conversational.add(not isinstance(row[prompt_key], str))
            if self.reward_fn is None and answer_key not in row:
                raise ValueError(
                    f"dataset: {where} has no '{answer_key}' column, which the default scorer needs "
                    "(set options.answer_key, or give options.reward_fn)"
                )
            level = 0
            if difficulty_key is not None:
                try:
                    level = int(row[difficulty_key])
                except (KeyError, TypeError, ValueError):
                    raise ValueError(
                        f"dataset: {where}: '{difficulty_key}' must be an integer level, got "
                        f"{row.get(difficulty_key)!r}"
                    ) from None
            if split_key is not None:
                name = str(row.get(split_key, "")).strip().lower()
                split = TRAIN if name == TRAIN else HELDOUT if name in HELDOUT_NAMES else None
                if split is None:
                    raise ValueError(
                        f"dataset: {where}: '{split_key}' is {row.get(split_key)!r}; use 'train' or one of "
                        f"{', '.join(sorted(HELDOUT_NAMES))}"
                    )
            else:
                split = split_of(content_digest(json.dumps(row, sort_keys=True, default=str)))
            self.by_level.setdefault((split, level), []).append(i)
        if len(conversational) > 1:
            raise ValueError(f"dataset: {self.path} mixes string prompts and message-list prompts")
        self.conversational = conversational == {True}
        self.prompt_key = prompt_key
        self.difficulties = sorted({lvl for _, lvl in self.by_level})

    def task(self, split: str, difficulty: int, index: int, seed: int = 0) -> Task:
        check_split(split, self.splits, self.name)
        check_difficulty(difficulty, self.difficulties, self.name)
        if not isinstance(index, int) or index < 0:
            raise ValueError(f"task index must be a non-negative int, got {index!r}")
        pool = self.by_level.get((split, difficulty))
        if not pool:
            raise ValueError(f"dataset: {self.path} has no {split} rows at difficulty {difficulty}")
        order = list(pool)
        random.Random(stable_hash("dataset-order", seed, split, difficulty)).shuffle(order)
        row_index = order[index % len(order)]
        row = self.rows[row_index]
        prompt = _messages(row[self.prompt_key], f"{self.path} row {row_index}")
        if self.instruction:
            last = prompt[-1]
            prompt[-1] = Message(role=last.role, content=f"{last.content}\n{self.instruction}")
        meta = {
            "row_index": row_index,
            "row": row,
            "raw_prompt": row[self.prompt_key],
            "answer": row.get(self.answer_key),
            "content_key": content_digest(json.dumps(row, sort_keys=True, default=str)),
        }
        return Task(
            id=f"{self.name}:{split}:d{difficulty}:s{seed}:{index}",
            domain=self.name,
            difficulty=difficulty,
            prompt=prompt,
            meta=meta,
            seed=seed,
            split=split,
        )

    def reference(self, task: Task) -> list[str]:
        if task.meta["answer"] is None:
            raise ValueError(
                f"dataset: row {task.meta['row_index']} has no '{self.answer_key}' to build a reference from"
            )
        return [f"<answer>{task.meta['answer']}</answer>"]

    def make_env(self, sandbox: Any = None, chat_format: str = "smollm2") -> Environment:
        return DatasetEnv(self.reward_fn, self.conversational, self.reward_fn_spec, self.path)
