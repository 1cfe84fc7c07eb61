"""Add a task domain in one file: a generator, a reference solution and a verifier.

Run: .venv/bin/python examples/custom_domain.py
It registers `reverse.words`, plays its reference answer and a wrong one through the environment, and
prints the rewards. Train on it with
    posttrain --plugin examples/custom_domain.py train --set 'envs.domains=[{name: reverse.words}]'
or install it in a package that names it under the `posttrain.domains` entry point group.
"""

from __future__ import annotations

import asyncio
import random

from posttrain.envs import Domain, Environment, Observation, StepResult, get_domain, register_env
from posttrain.types import Message, Task

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()


class ReverseEnv(Environment):
    max_turns = 1

    async def reset(self, task: Task) -> Observation:
        self.task = task
        return Observation(task.prompt)

    async def step(self, assistant_text: str) -> StepResult:
        want = " ".join(reversed(self.task.meta["words"]))
        correct = float(assistant_text.strip().lower() == want)
        return StepResult([], correct, True, {"correct": correct, "success": correct})


@register_env("reverse.words")
class ReverseWords(Domain):
    difficulties = [0, 1]
    description = "reverse a list of words"

    def task(self, split: str, difficulty: int, index: int, seed: int = 0) -> Task:
        def make(rng: random.Random):
            words = rng.sample(WORDS, 3 + 2 * difficulty)
            prompt = [Message("user", "Reverse the order of these words: " + " ".join(words))]
            return " ".join(words), lambda: Task("", "", difficulty, prompt, meta={"words": words})

        return self.draw(split, difficulty, index, seed, make)

    def reference(self, task: Task) -> list[str]:
        return [" ".join(reversed(task.meta["words"]))]

    def make_env(self, sandbox=None, chat_format: str = "smollm2") -> Environment:
        return ReverseEnv()


async def main() -> None:
    domain = get_domain("reverse.words")
    task = domain.task("train", 0, 0)
    print(task.prompt[0].content)
    for answer in [domain.reference(task)[0], "no idea"]:
        env = domain.make_env()
        await env.reset(task)
        result = await env.step(answer)
        print(f"{answer!r:40} -> reward {result.reward}")


if __name__ == "__main__":
    asyncio.run(main())
