"""An episode whose observations carry images stays token-exact for a text-only model: the chat
rendering reads each image's description, and the trajectory is the engine's ids plus the glue."""

from __future__ import annotations

import asyncio

import numpy as np

from posttrain.engine import SamplingParams
from posttrain.envs.base import Domain, Environment, Observation, StepResult
from posttrain.envs.images import encode_png
from posttrain.models import render_messages
from posttrain.rollout import EpisodeLimits, run_episode
from posttrain.types import ImagePart, Message, Task, TextPart, TrajectoryStatus

from .conftest import ScriptedEngine


def png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    return encode_png(np.full((height, width, 3), rgb, dtype=np.uint8))


SCRIPT = ["first try", "second try", "final"]


def _observation(turn: int) -> Message:
    img = ImagePart(png(3 + turn, 2, (turn * 40, 0, 0)), f"render {turn}: {turn + 1} faces")
    return Message("user", [TextPart(f"Feedback {turn}:"), img, TextPart("Try again.")])


class _ImageEnv(Environment):
    max_turns = 3

    async def reset(self, task: Task) -> Observation:
        self.turn = 0
        return Observation(list(task.prompt))

    async def step(self, assistant_text: str) -> StepResult:
        self.turn += 1
        if self.turn == len(SCRIPT):
            return StepResult([], 1.0, True)
        return StepResult([_observation(self.turn)], None, False)


class _ImageDomain(Domain):
    name = "test.images"

    def task(self, split: str, difficulty: int, index: int, seed: int = 0) -> Task:
        brief = Message(
            "user", [TextPart("Make this part:"), ImagePart(png(5, 5, (9, 9, 9)), "target: a 5 mm cube")]
        )
        return Task("img:0", self.name, 0, [brief])

    def reference(self, task: Task) -> list[str]:
        return list(SCRIPT)

    def make_env(self, sandbox=None, chat_format="smollm2") -> Environment:
        return _ImageEnv()


def test_image_observations_render_as_descriptions_token_exactly(tokenizer):
    domain = _ImageDomain()
    task = domain.task("train", 0, 0)
    engine = ScriptedEngine(tokenizer, SCRIPT)
    params = SamplingParams(max_tokens=64, stop_token_ids=[tokenizer.eos_token_id])
    traj = asyncio.run(run_episode(engine, tokenizer, domain, task, None, params, EpisodeLimits(3, 4096, 64)))
    assert traj.status == TrajectoryStatus.OK and traj.reward == 1.0 and traj.turns == 3
    for req, out in zip(engine.requests, engine.outputs, strict=True):
        assert traj.token_ids[: len(req)] == req
        assert traj.token_ids[len(req) : len(req) + len(out)] == out
    messages = [task.prompt[0]]
    for turn, text in enumerate(SCRIPT, start=1):
        messages.append(Message("assistant", text))
        if turn < len(SCRIPT):
            messages.append(_observation(turn))
    rendered = render_messages(tokenizer, messages, None, add_generation_prompt=False)
    assert tokenizer.decode(traj.token_ids) + "\n" == rendered
    assert "[image] target: a 5 mm cube" in rendered and "[image] render 2: 3 faces" in rendered
    assert "base64" not in rendered
