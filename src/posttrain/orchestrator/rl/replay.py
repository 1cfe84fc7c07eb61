"""Replay of general data: the initial policy's own completions of general prompts outside every training
domain, mixed into each RL update as a supervised term (`algorithm.replay_fraction`, `replay_coef`).

At the start of a run the engine (still the initial policy) samples one completion of each of
`REPLAY_PROMPTS` (T=1, fixed seeds; a list disjoint from the drift probe's, so the probe stays held
out). Each update then carries `replay_count(n, fraction)` of them, taken in turn from a cursor that
is a function of the step (a resumed run replays what the uninterrupted one would have); the learner
adds `replay_coef` x their token-mean NLL to the RL loss (`Learner.step(..., replay=)`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from posttrain.orchestrator.rl.drift import GENERAL_PROMPTS, reference_completions

# general instructions of no training domain, none of them a drift probe prompt
REPLAY_PROMPTS = [
    "Write a haiku about autumn leaves.",
    "Explain how a bicycle stays upright.",
    "Give two reasons to learn a second language.",
    "Describe a busy market in the morning.",
    "Write a thank-you note to a neighbour who watered your plants.",
    "What is the difference between weather and climate?",
    "Suggest three activities for a rainy afternoon.",
    "Summarize the story of the tortoise and the hare.",
    "Why do leaves change colour in the fall?",
    "Write a short story opening about a lost key.",
    "How does a refrigerator keep food cold?",
    "Give advice to someone starting their first job.",
    "Describe the taste of a lemon to someone who never had one.",
    "What makes a good friend?",
    "Explain what a library is for.",
    "Write a two-line slogan for a bakery.",
    "How do bees make honey?",
    "What should I consider before adopting a dog?",
    "Describe a sunset over the mountains.",
    "Explain why we need sleep.",
    "Write a polite message declining an invitation.",
    "What are some ways to save water at home?",
    "Tell me about the moon in three sentences.",
    "Give a simple tip for keeping a room tidy.",
    "Why do people enjoy music?",
    "Write a short description of a quiet beach.",
    "How do you make a cup of tea?",
    "What is a good way to start the day?",
    "Explain what friendship means to a child.",
    "Describe the sound of rain on a roof.",
    "Give three ideas for a birthday present for a friend.",
    "Why is it important to wash your hands?",
]
assert not set(REPLAY_PROMPTS) & set(GENERAL_PROMPTS), "replay must not train on the drift probe's prompts"


def replay_count(sequences: int, fraction: float) -> int:
    """Replay sequences in an update of `sequences` RL sequences: fraction x sequences, rounded half up,
    at least 1 while fraction > 0."""
    if fraction <= 0:
        return 0
    return max(1, int(fraction * sequences + 0.5))


class ReplayPool:
    """The initial policy's completions of `REPLAY_PROMPTS`, handed out in turn."""

    def __init__(self, samples: list[Any]) -> None:
        if not samples:
            raise ValueError("the replay pool's reference completions are all empty")
        self.samples = samples

    @classmethod
    def build(
        cls, engine: Any, tokenizer: Any, *, max_tokens: int, seed: int, loop: asyncio.AbstractEventLoop
    ) -> ReplayPool:
        """Sample the completions with `engine`, which must still hold the initial policy."""
        # seed + 1: not the drift probe's sampling seeds
        return cls(
            reference_completions(
                engine, tokenizer, REPLAY_PROMPTS, max_tokens=max_tokens, seed=seed + 1, loop=loop
            )
        )

    def pick(self, n: int, step: int) -> list[Any]:
        """The `n` samples of `step`: the pool in order, step after step, wrapping around."""
        start = step * n
        return [self.samples[(start + i) % len(self.samples)] for i in range(n)]
