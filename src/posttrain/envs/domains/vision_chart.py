"""`vision.chart`: read a value from a bar chart of a small financial table (a company's yearly
revenue in $M), rendered headless with matplotlib (Agg); the ground truth is the table. Single turn,
answer in `<answer>` tags (vision_common.py).

Levels: 0 the year with the highest revenue (4 years); 1 the revenue of one year (printed on top of
its bar); 2 the change from one year to another (signed, $M). Values are multiples of 5 in [10, 95],
distinct within a chart. The image's text description is the same for every task: a text-only model
reads neither the values nor the years' order.
"""

from __future__ import annotations

import io
import random

import numpy as np

from posttrain.envs.domains.vision_common import AnswerDomain, vision_prompt
from posttrain.envs.registry import register_env
from posttrain.types import Task

DESCRIPTION = "a bar chart of a company's yearly revenue"
WIDTH_PX, HEIGHT_PX = 192, 144
FIRST_YEARS = range(2015, 2022)


def render_chart(years: list[int], values: list[int], labels: bool) -> np.ndarray:
    """`[HEIGHT_PX, WIDTH_PX, 3]` uint8 of the bar chart (bar values printed on top when `labels`)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure
    from PIL import Image

    fig = Figure(figsize=(WIDTH_PX / 48, HEIGHT_PX / 48), dpi=48)
    ax = fig.add_axes((0.16, 0.14, 0.8, 0.78))
    bars = ax.bar([str(y) for y in years], values, color="#3060c0")
    ax.set_ylim(0, 110)
    ax.set_yticks([0, 50, 100])
    ax.tick_params(labelsize=7)
    if labels:
        ax.bar_label(bars, fontsize=7)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=48)
    with Image.open(io.BytesIO(buf.getvalue())) as im:
        return np.asarray(im.convert("RGB"))


def _question(rng: random.Random, level: int) -> tuple[list[int], list[int], str, str]:
    first = rng.choice(list(FIRST_YEARS))
    years = [first + i for i in range(4)]
    values = rng.sample(range(10, 100, 5), 4)
    if level == 0:
        return years, values, "In which year was revenue highest?", str(years[values.index(max(values))])
    if level == 1:
        i = rng.randrange(4)
        return years, values, f"What was revenue in {years[i]}, in $M?", str(values[i])
    i, j = sorted(rng.sample(range(4), 2))
    q = f"By how much did revenue change from {years[i]} to {years[j]}, in $M (negative for a fall)?"
    return years, values, q, str(values[j] - values[i])


@register_env("vision.chart")
class ChartDomain(AnswerDomain):
    description = "read values from a bar chart of a small financial table (image input)"
    difficulties = [0, 1, 2]

    def task(self, split: str, difficulty: int, index: int, seed: int = 0) -> Task:
        def make(rng: random.Random):
            years, values, question, answer = _question(rng, difficulty)

            def build() -> Task:
                pixels = render_chart(years, values, labels=difficulty > 0)
                meta = {
                    "answer": answer,
                    "question": question,
                    "table": dict(zip(years, values, strict=True)),
                }
                return Task(
                    "", self.name, difficulty, vision_prompt(question, pixels, DESCRIPTION), meta=meta
                )

            return f"{question}|{years}|{values}", build

        return self.draw(split, difficulty, index, seed, make)
