"""What the `vision.*` domains share: a headless numpy rasteriser for coloured shapes, the single-turn
answer environment and its scorer, and the prompt (one image part whose text-only description never
holds the answer). Each domain module owns its scenes and questions.

Reward = 0.85 * correct + 0.15 * format (`<answer>` tags), as `math`; `success` is strict: the exact
answer (numbers compared after normalisation, words case-insensitively).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from posttrain.envs.base import Domain, Environment, SingleTurnEnv
from posttrain.envs.extract import extract_answer, normalize_number
from posttrain.envs.images import image_part
from posttrain.types import Message, Task, TextPart

W_CORRECT, W_FORMAT = 0.85, 0.15
INSTRUCTION = "Put the final answer between <answer> and </answer>."

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
}
KINDS = ("circle", "square", "triangle")
BACKGROUND = (245, 245, 245)


@dataclass(frozen=True)
class Shape:
    kind: str  # circle | square | triangle
    colour: str
    cx: int
    cy: int
    r: int  # half the side of its bounding square


def shape_mask(shape: Shape, size: int) -> np.ndarray:
    """`[size, size]` bool: the pixels the shape covers."""
    y, x = np.mgrid[0:size, 0:size]
    dx, dy = x - shape.cx, y - shape.cy
    if shape.kind == "circle":
        return dx * dx + dy * dy <= shape.r * shape.r
    if shape.kind == "square":
        return (np.abs(dx) <= shape.r) & (np.abs(dy) <= shape.r)
    if shape.kind == "triangle":  # apex up: the half-width grows linearly from the top edge
        top = shape.cy - shape.r
        inside_y = (y >= top) & (y <= shape.cy + shape.r)
        half = (y - top) / 2.0
        return inside_y & (np.abs(dx) <= half)
    raise ValueError(f"unknown shape kind {shape.kind!r}")


def render_shapes(shapes: list[Shape], size: int) -> np.ndarray:
    """`[size, size, 3]` uint8: the shapes painted in order on a light background."""
    img = np.empty((size, size, 3), dtype=np.uint8)
    img[:] = BACKGROUND
    for s in shapes:
        img[shape_mask(s, size)] = COLOURS[s.colour]
    return img


def place_shapes(
    rng: random.Random, specs: list[tuple[str, str]], size: int, radius: int, margin: int = 2
) -> list[Shape] | None:
    """Shapes of the given (kind, colour) at random places without overlap (bounding squares apart by
    `margin`); None when they do not fit after a bounded number of tries."""
    placed: list[Shape] = []
    for kind, colour in specs:
        for _ in range(200):
            cx = rng.randint(radius + 1, size - radius - 2)
            cy = rng.randint(radius + 1, size - radius - 2)
            if all(
                abs(cx - p.cx) > radius + p.r + margin or abs(cy - p.cy) > radius + p.r + margin
                for p in placed
            ):
                placed.append(Shape(kind, colour, cx, cy, radius))
                break
        else:
            return None
    return placed


def shapes_key(shapes: list[Shape]) -> str:
    return ";".join(f"{s.kind},{s.colour},{s.cx},{s.cy},{s.r}" for s in shapes)


def vision_prompt(question: str, pixels: np.ndarray, description: str) -> list[Message]:
    """The user turn: the question, the image (with a description that does not give the answer away)
    and the answer instruction."""
    return [Message("user", [TextPart(question), image_part(pixels, description), TextPart(INSTRUCTION)])]


def answers_equal(given: str, expected: str) -> bool:
    a, b = normalize_number(given), normalize_number(expected)
    return a.strip().lower() == b.strip().lower()


def score_answer(text: str, expected: str) -> tuple[float, dict[str, float], dict[str, Any]]:
    """(reward, components, info) of one answer text; never raises on any text."""
    extracted = extract_answer(text if isinstance(text, str) else "")
    fmt = 1.0 if extracted.method == "tags" else 0.0
    correct = 1.0 if extracted.text is not None and answers_equal(extracted.text[:200], expected) else 0.0
    info = {
        "extracted": extracted.text,
        "extract_method": extracted.method,
        "unparseable": int(extracted.text is None),
    }
    return W_CORRECT * correct + W_FORMAT * fmt, {"correct": correct, "format": fmt, "success": correct}, info


class AnswerDomain(Domain):
    """A vision domain whose reference is the tagged answer and whose episode is one `SingleTurnEnv` turn;
    subclasses generate the tasks."""

    def reference(self, task: Task) -> list[str]:
        return [f"<answer>{task.meta['answer']}</answer>"]

    def make_env(self, sandbox: Any = None, chat_format: str = "smollm2") -> Environment:
        return SingleTurnEnv(lambda text, meta: score_answer(text, str(meta["answer"])))
