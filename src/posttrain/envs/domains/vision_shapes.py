"""`vision.shapes` (counting and attributes of coloured shapes in a rendered scene) and `vision.views`
(which of several panels matches a description), rendered headless with numpy; exact ground truth
from the scene itself. Single turn, answer in `<answer>` tags (vision_common.py).

vision.shapes levels: 0 how many shapes (1-4); 1 how many of one colour (2-5 shapes, 2 colours);
2 the colour of the one shape of a kind (2-4 shapes); 3 how many of one colour and kind (3-6 shapes,
2 colours x 2 kinds). vision.views levels: 0 two panels side by side (A, B), one shape each, the
distractor differing in colour or kind; 1 four panels (A B / C D), distractors sharing the colour or
the kind of the target. The image's text description is the same for every task of a domain: a
text-only model reads nothing that tells the answer.
"""

from __future__ import annotations

import random

import numpy as np

from posttrain.envs.domains.vision_common import (
    BACKGROUND,
    COLOURS,
    KINDS,
    AnswerDomain,
    Shape,
    place_shapes,
    render_shapes,
    shapes_key,
    vision_prompt,
)
from posttrain.envs.registry import register_env
from posttrain.types import Task

SIZE = 96
SCENE_DESCRIPTION = "a rendered scene of coloured shapes on a light background"
VIEWS_DESCRIPTION = "panels of rendered coloured shapes"


def _plural(kind: str) -> str:
    return kind + "s"


def _shapes_question(rng: random.Random, level: int) -> tuple[list[tuple[str, str]], str, str, int]:
    """(shape specs, question, answer, radius) for one candidate."""
    colours = list(COLOURS)
    if level == 0:
        n = rng.randint(1, 4)
        specs = [(rng.choice(KINDS), rng.choice(colours)) for _ in range(n)]
        return specs, "How many shapes are in the image?", str(n), 12
    if level == 1:
        two = rng.sample(colours, 2)
        n = rng.randint(2, 5)
        specs = [(rng.choice(KINDS), rng.choice(two)) for _ in range(n)]
        target = rng.choice(two)
        count = sum(c == target for _, c in specs)
        return specs, f"How many {target} shapes are in the image?", str(count), 11
    if level == 2:
        kind = rng.choice(KINDS)
        others = [k for k in KINDS if k != kind]
        colour = rng.choice(colours)
        specs = [(kind, colour)] + [
            (rng.choice(others), rng.choice(colours)) for _ in range(rng.randint(1, 3))
        ]
        rng.shuffle(specs)
        return specs, f"What colour is the {kind}?", colour, 11
    two_c, two_k = rng.sample(colours, 2), rng.sample(list(KINDS), 2)
    n = rng.randint(3, 6)
    specs = [(rng.choice(two_k), rng.choice(two_c)) for _ in range(n)]
    tk, tc = rng.choice(two_k), rng.choice(two_c)
    count = sum(k == tk and c == tc for k, c in specs)
    return specs, f"How many {tc} {_plural(tk)} are in the image?", str(count), 9


@register_env("vision.shapes")
class ShapesDomain(AnswerDomain):
    description = "count coloured shapes and read their attributes in a rendered scene (image input)"
    difficulties = [0, 1, 2, 3]

    def task(self, split: str, difficulty: int, index: int, seed: int = 0) -> Task:
        def make(rng: random.Random):
            specs, question, answer, radius = _shapes_question(rng, difficulty)
            shapes = place_shapes(rng, specs, SIZE, radius)

            def build() -> Task | None:
                if shapes is None:
                    return None
                prompt = vision_prompt(question, render_shapes(shapes, SIZE), SCENE_DESCRIPTION)
                meta = {"answer": answer, "question": question, "shapes": [s.__dict__ for s in shapes]}
                return Task("", self.name, difficulty, prompt, meta=meta)

            return f"{question}|{shapes_key(shapes or [])}", build

        return self.draw(split, difficulty, index, seed, make)


def _panel(shape: tuple[str, str], side: int) -> np.ndarray:
    kind, colour = shape
    return render_shapes([Shape(kind, colour, side // 2, side // 2, side // 3)], side)


def _views(rng: random.Random, level: int) -> tuple[list[tuple[str, str]], int]:
    """The panels' (kind, colour) and the index of the target (panel 0's spec is drawn first)."""
    colours = list(COLOURS)
    target = (rng.choice(KINDS), rng.choice(colours))
    n = 2 if level == 0 else 4
    distractors: list[tuple[str, str]] = []
    while len(distractors) < n - 1:
        if level == 0:
            d = (rng.choice(KINDS), rng.choice(colours))
        elif rng.random() < 0.5:  # same kind, another colour
            d = (target[0], rng.choice([c for c in colours if c != target[1]]))
        else:  # same colour, another kind
            d = (rng.choice([k for k in KINDS if k != target[0]]), target[1])
        if d != target and d not in distractors:
            distractors.append(d)
    panels = [target, *distractors]
    rng.shuffle(panels)
    return panels, panels.index(target)


@register_env("vision.views")
class ViewsDomain(AnswerDomain):
    description = "pick the panel of a rendered image that matches a description (image input)"
    difficulties = [0, 1]

    def task(self, split: str, difficulty: int, index: int, seed: int = 0) -> Task:
        def make(rng: random.Random):
            panels, answer_at = _views(rng, difficulty)

            def build() -> Task:
                half = SIZE // 2
                canvas = np.empty((SIZE, SIZE, 3), dtype=np.uint8)
                canvas[:] = BACKGROUND
                if difficulty == 0:  # A | B, vertically centred
                    layout = "Panel A is on the left, panel B on the right."
                    for i, spec in enumerate(panels):
                        canvas[half // 2 : half // 2 + half, i * half : (i + 1) * half] = _panel(spec, half)
                else:
                    layout = "Panels: A top left, B top right, C bottom left, D bottom right."
                    for i, spec in enumerate(panels):
                        r, c = divmod(i, 2)
                        canvas[r * half : (r + 1) * half, c * half : (c + 1) * half] = _panel(spec, half)
                canvas[:, half - 1 : half + 1] = 0  # panel borders
                if difficulty == 1:
                    canvas[half - 1 : half + 1, :] = 0
                kind, colour = panels[answer_at]
                letters = "AB" if difficulty == 0 else "ABCD"
                question = (
                    f"Which panel shows a {colour} {kind}? {layout} Answer with the panel's letter "
                    f"({', '.join(letters)})."
                )
                meta = {
                    "answer": letters[answer_at],
                    "question": question,
                    "panels": [list(p) for p in panels],
                }
                return Task(
                    "", self.name, difficulty, vision_prompt(question, canvas, VIEWS_DESCRIPTION), meta=meta
                )

            return "|".join(f"{k},{c}" for k, c in panels) + f"|{answer_at}", build

        return self.draw(split, difficulty, index, seed, make)
