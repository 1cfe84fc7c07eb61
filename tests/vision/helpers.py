"""Helpers for the vision tests: images, and a domain whose episodes show an image in turns 1 and 3."""

from __future__ import annotations

import numpy as np

from posttrain.envs.base import Domain, Environment, Observation, StepResult
from posttrain.envs.images import image_part
from posttrain.types import ImagePart, Message, Task, TextPart


def noise_image(seed: int, h: int = 40, w: int = 50, description: str = "noise"):
    return image_part(np.random.RandomState(seed).randint(0, 255, (h, w, 3)).astype(np.uint8), description)


class RenderEnv(Environment):
    """Turn 2's observation is text, turn 3's shows `render`; the episode ends with reward 0.5."""

    max_turns = 3

    def __init__(self, render: ImagePart) -> None:
        self.render = render

    async def reset(self, task: Task) -> Observation:
        self.turn = 0
        return Observation(list(task.prompt))

    async def step(self, assistant_text: str) -> StepResult:
        self.turn += 1
        if self.turn == 1:
            return StepResult([Message("user", "Look again.")], None, False)
        if self.turn == 2:
            parts = [TextPart("Your part:"), self.render, TextPart("Fix it.")]
            return StepResult([Message("user", parts)], None, False)
        return StepResult([], 0.5, True)


class DrawingDomain(Domain):
    """One task whose brief shows `drawing` (turn 1); its episodes show `render` in turn 3."""

    name = "test.vision"

    def __init__(self, drawing: ImagePart, render: ImagePart) -> None:
        self.drawing, self.render = drawing, render

    def task(self, split: str, difficulty: int, index: int, seed: int = 0) -> Task:
        return Task("v:0", self.name, 0, [Message("user", [TextPart("Make this:"), self.drawing])])

    def reference(self, task: Task) -> list[str]:
        return []

    def make_env(self, sandbox=None, chat_format="smollm2") -> Environment:
        return RenderEnv(self.render)
