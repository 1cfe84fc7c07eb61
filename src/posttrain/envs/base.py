"""The environment protocol: `Domain` (task generator + reference + env factory), `Environment` (one
episode over chat messages), `Observation` and `StepResult`, plus the content-hash split rule.

Owns the shapes every domain fills in and the rollout loop consumes. Does not know any domain, engine
or sandbox backend (a `Sandbox` is injected into `make_env`).
"""

from __future__ import annotations

import hashlib
import json
import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from posttrain.types import Message, Task, ToolSpec

TRAIN = "train"
HELDOUT = "heldout"
EVAL = "eval"

# A task's split is a pure function of its content key (`content_digest` of what the generator drew):
# sha256(key) mod 100 < HELDOUT_PERCENT -> heldout.
# Generators draw candidates until one lands in the requested split, so train and heldout can never
# share a task, however many are drawn (tested per domain).
HELDOUT_PERCENT = 20
MAX_SPLIT_ATTEMPTS = 10_000


@dataclass
class Observation:
    """What the policy sees at reset: the prompt messages and the tools it may call."""

    messages: list[Message]
    tools: list[ToolSpec] = field(default_factory=list)


@dataclass
class StepResult:
    """The environment's answer to one assistant message.

    `observations` are appended to the conversation before the next assistant turn (role "tool" or
    "user"); empty when `done`. `reward` is None until `done`, then a finite number (the built-in
    domains' lie in [0, 1]) with its named components in `rewards`. `info` carries counts
    (`invalid_tool_calls`, `unparseable`, `tool_calls`, `turns`), `infra_failure: True` when the sandbox
    failed, and `reward_fn_error` (a message) when a user's reward function failed: neither episode is
    trained on.
    """

    observations: list[Message]
    reward: float | None
    done: bool
    rewards: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


def stable_hash(*parts: Any) -> int:
    """A process-independent 64-bit hash of JSON-serialisable parts (Python's hash() is salted)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "big")


def content_digest(content: str) -> str:
    """A task's identity: sha256 of its generator's canonical content string (first 32 hex digits)."""
    return hashlib.sha256(content.encode()).hexdigest()[:32]


def split_of(content_key: str) -> str:
    """The split a task with this content key belongs to: "train" or "heldout"."""
    return HELDOUT if stable_hash("split", content_key) % 100 < HELDOUT_PERCENT else TRAIN


def check_split(split: str, allowed: tuple[str, ...], domain: str) -> None:
    if split not in allowed:
        raise ValueError(f"domain '{domain}' has no split '{split}' (valid splits: {', '.join(allowed)})")


def check_difficulty(difficulty: int, allowed: list[int], domain: str) -> None:
    if difficulty not in allowed:
        raise ValueError(
            f"domain '{domain}' has no difficulty {difficulty!r} (valid difficulties: {', '.join(map(str, allowed))})"
        )


def candidate_rng(
    domain: str, split: str, difficulty: int, index: int, seed: int, attempt: int
) -> random.Random:
    """The RNG a generator uses for one candidate draw; distinct per (split, difficulty, index, seed, attempt)."""
    return random.Random(stable_hash(domain, split, difficulty, index, seed, attempt))


def clip01(x: float) -> float:
    return 0.0 if x != x else max(0.0, min(1.0, float(x)))  # x != x: NaN


class Environment(ABC):
    """One episode. Create a fresh instance per episode (`Domain.make_env`); instances are not shared
    between concurrently running episodes. `step` accepts any string and never raises on model output."""

    max_turns: int = 1

    @abstractmethod
    async def reset(self, task: Task) -> Observation: ...

    @abstractmethod
    async def step(self, assistant_text: str) -> StepResult: ...

    async def finalize(self) -> StepResult:
        """Score an episode the caller stopped early (its turn/token budget ran out before `done`).

        The default treats it as one more, empty assistant turn; tool environments override it to score
        the state as it stands, marked `truncated`."""
        return await self.step("")


class SingleTurnEnv(Environment):
    """One assistant turn, scored by `score(text, task.meta) -> (reward, rewards, info)`; a non-str
    answer is scored as "". Later steps return the same result."""

    max_turns = 1

    def __init__(
        self, score: Callable[[str, dict[str, Any]], tuple[float, dict[str, float], dict[str, Any]]]
    ):
        self._score = score
        self._task: Task | None = None
        self._final: StepResult | None = None

    async def reset(self, task: Task) -> Observation:
        self._task, self._final = task, None
        return Observation(messages=list(task.prompt), tools=[])

    async def step(self, assistant_text: str) -> StepResult:
        if self._task is None:
            raise RuntimeError("step() before reset()")
        if self._final is None:
            text = assistant_text if isinstance(assistant_text, str) else ""
            reward, rewards, info = self._score(text, self._task.meta)
            info.update(turns=1, infra_failure=False)
            self._final = StepResult(observations=[], reward=reward, done=True, rewards=rewards, info=info)
        return self._final


class Domain(ABC):
    """A task family: deterministic generator, reference solutions, and an environment factory."""

    name: str = ""
    difficulties: list[int] = [0]
    splits: tuple[str, ...] = (TRAIN, HELDOUT)
    requires_sandbox: bool = False
    description: str = ""
    required_options: tuple[
        str, ...
    ] = ()  # options without which the domain cannot be built (e.g. a data path)

    @abstractmethod
    def task(self, split: str, difficulty: int, index: int, seed: int = 0) -> Task:
        """The `index`-th task of `split` at `difficulty`; the same arguments give the same task."""

    @abstractmethod
    def reference(self, task: Task) -> list[str]:
        """Reference assistant message texts (raw model text, tool-call markup included), in order."""

    @abstractmethod
    def make_env(self, sandbox: Any = None, chat_format: str = "smollm2") -> Environment:
        """A fresh environment for one episode. `sandbox` is a `posttrain.sandbox.Sandbox` where needed."""

    def _validate(self, split: str, difficulty: int, index: int) -> None:
        check_split(split, self.splits, self.name)
        check_difficulty(difficulty, self.difficulties, self.name)
        if not isinstance(index, int) or index < 0:
            raise ValueError(f"task index must be a non-negative int, got {index!r}")

    def draw(self, split: str, difficulty: int, index: int, seed: int, make) -> Task:
        """Draw candidates `make(rng) -> (content_key, build)` until one lands in `split`; return build().

        `build` is a zero-argument callable producing the Task (so rejected candidates cost little);
        when it returns None the candidate is rejected and the next one drawn.
        """
        self._validate(split, difficulty, index)
        for attempt in range(MAX_SPLIT_ATTEMPTS):
            rng = candidate_rng(self.name, split, difficulty, index, seed, attempt)
            key, build = make(rng)
            digest = content_digest(key)
            if split_of(digest) == split:
                task: Task | None = build()
                if task is None:
                    continue
                task.id = f"{self.name}:{split}:d{difficulty}:s{seed}:{index}"
                task.domain = self.name
                task.split = split
                task.difficulty = difficulty
                task.seed = seed
                task.meta["content_key"] = digest
                return task
        raise RuntimeError(
            f"{self.name}: no {split} task found at difficulty {difficulty} (generator too narrow)"
        )
