"""Scripted episodes: drive an `Environment` with canned assistant texts (a reference solution or any
list of strings) and collect the transcript. Used by `posttrain tasks check`, tests and smoke runs; the
real agent loop with an engine lives in `posttrain.rollout`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.envs.base import Domain, Environment, StepResult
from posttrain.types import Message, Task


@dataclass
class EpisodeResult:
    reward: float | None
    rewards: dict[str, float]
    info: dict[str, Any]
    done: bool
    turns: int
    transcript: list[Message] = field(default_factory=list)


async def run_episode(env: Environment, task: Task, texts: list[str]) -> EpisodeResult:
    """Feed `texts` in order until the episode ends; if they run out first, keep sending "" (which
    every environment scores as a failed turn) so an episode always terminates within max_turns."""
    obs = await env.reset(task)
    transcript = list(obs.messages)
    result: StepResult | None = None
    turns = 0
    limit = max(int(getattr(env, "max_turns", 1)), len(texts)) + 1
    while turns < limit:
        text = texts[turns] if turns < len(texts) else ""
        result = await env.step(text)
        turns += 1
        transcript.append(Message(role="assistant", content=text))
        transcript.extend(result.observations)
        if result.done:
            break
    assert result is not None
    return EpisodeResult(
        result.reward, dict(result.rewards), dict(result.info), result.done, turns, transcript
    )


async def check_reference(
    domain: Domain, task: Task, sandbox: Any = None, chat_format: str = "smollm2"
) -> EpisodeResult:
    """Run the domain's reference solution for `task` through a fresh environment."""
    return await run_episode(domain.make_env(sandbox, chat_format), task, domain.reference(task))
