"""Plain dataclasses shared by every layer: messages, tools, tasks and trajectories.

No behaviour beyond (de)serialisation lives here; each layer owns what it does with these.
Must not import torch (the sandbox and environments use these types without it).
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass
class Message:
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            import json

            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


@dataclass
class ToolSpec:
    """An OpenAI-style function tool: name, description, JSON-Schema parameters."""

    name: str
    description: str
    parameters: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass
class Task:
    id: str
    domain: str
    difficulty: int
    prompt: list[Message]
    tools: list[ToolSpec] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    split: str = "train"  # "train" | "heldout" | "eval"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class TrajectoryStatus(enum.StrEnum):
    """`OK`/`TRUNCATED` are scored; the *_ERROR statuses are infrastructure failures: never trained on."""

    OK = "ok"
    TRUNCATED = "truncated"  # hit the turn or token budget; still scored
    SANDBOX_ERROR = "sandbox_error"
    ENGINE_ERROR = "engine_error"
    REWARD_ERROR = "reward_error"  # the learned reward model (or its server) failed to score it

    @property
    def is_infra_failure(self) -> bool:
        return self in (
            TrajectoryStatus.SANDBOX_ERROR,
            TrajectoryStatus.ENGINE_ERROR,
            TrajectoryStatus.REWARD_ERROR,
        )


@dataclass
class Trajectory:
    """One episode as the trainer sees it.

    `token_ids[:prompt_len]` is the rendered prompt; after it come the engine's sampled ids and the ids
    of appended observations, exactly as fed to the engine. `loss_mask[i] == 1` only where the engine
    sampled token i; `behavior_logprobs[i]` is its logprob under the sampling distribution (0.0 where
    the mask is 0). All three lists have the same length.
    """

    task: Task
    token_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    prompt_len: int
    rewards: dict[str, float] = field(default_factory=dict)
    reward: float = 0.0
    turns: int = 0
    policy_version: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    status: TrajectoryStatus = TrajectoryStatus.OK
    info: dict[str, Any] = field(default_factory=dict)
    group_id: int = 0

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)
