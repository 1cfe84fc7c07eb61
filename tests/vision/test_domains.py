"""The vision.* domains: references score 1.0, wrong and malformed answers lower; deterministic,
disjoint splits; the render holds exactly the ground truth; the text description gives nothing away."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
from PIL import Image
from scipy import ndimage

from posttrain.envs import get_domain
from posttrain.envs.domains.vision_common import COLOURS, Shape, score_answer, shape_mask
from posttrain.envs.scripted import check_reference, run_episode

LEVELS = {"vision.shapes": [0, 1, 2, 3], "vision.views": [0, 1], "vision.chart": [0, 1, 2]}


def _pixels(task) -> np.ndarray:
    (img,) = task.prompt[0].images
    with Image.open(io.BytesIO(img.png)) as im:
        return np.asarray(im.convert("RGB"))


@pytest.mark.parametrize("name", sorted(LEVELS))
def test_references_score_one_and_wrong_answers_lower(name):
    domain = get_domain(name)
    for level in LEVELS[name]:
        task = domain.task("heldout", level, 0)
        assert asyncio.run(check_reference(domain, task)).reward == 1.0
        wrong = asyncio.run(run_episode(domain.make_env(), task, ["<answer>banana</answer>"]))
        assert wrong.reward == pytest.approx(0.15) and wrong.rewards["success"] == 0.0
        untagged = asyncio.run(run_episode(domain.make_env(), task, [f"The answer is {task.meta['answer']}"]))
        assert untagged.reward == pytest.approx(0.85) and untagged.rewards["success"] == 1.0
        assert asyncio.run(run_episode(domain.make_env(), task, [""])).reward == 0.0


@pytest.mark.parametrize("name", sorted(LEVELS))
def test_deterministic_disjoint_and_the_description_gives_nothing_away(name):
    domain = get_domain(name)
    for level in LEVELS[name]:
        a = [domain.task("train", level, i) for i in range(8)]
        assert [t.prompt[0].images[0].png for t in a[:3]] == [
            domain.task("train", level, i).prompt[0].images[0].png for i in range(3)
        ]
        held = {domain.task("heldout", level, i).meta["content_key"] for i in range(8)}
        assert not held & {t.meta["content_key"] for t in a}
        # one description for every task: what a text-only model reads in the image's place is constant
        assert len({t.prompt[0].images[0].description for t in a}) == 1
        assert len({t.meta["answer"] for t in a}) > 1
        for t in a:
            assert f"<answer>{t.meta['answer']}" not in t.prompt[0].text


def test_shape_masks_cover_the_hand_counted_pixels():
    assert int(shape_mask(Shape("square", "red", 5, 5, 2), 11).sum()) == 25  # 5 x 5
    assert int(shape_mask(Shape("circle", "red", 5, 5, 2), 11).sum()) == 13  # x^2 + y^2 <= 4
    # triangle r=2: rows y=3..7 have half-widths 0, .5, 1, 1.5, 2 -> 1 + 1 + 3 + 3 + 5 pixels
    assert int(shape_mask(Shape("triangle", "red", 5, 5, 2), 11).sum()) == 13


def test_shape_counts_match_the_rendered_image():
    domain = get_domain("vision.shapes")
    for i in range(6):
        for level in (0, 1):
            task = domain.task("train", level, i)
            pix = _pixels(task)
            shapes = task.meta["shapes"]
            if level == 0:
                blobs = ndimage.label((pix != 245).any(-1))[1]
                assert blobs == len(shapes) == int(task.meta["answer"])
            else:
                colour = task.meta["question"].split()[2]
                blobs = ndimage.label((pix == COLOURS[colour]).all(-1))[1]
                assert blobs == int(task.meta["answer"])


def test_chart_answers_follow_the_table():
    domain = get_domain("vision.chart")
    t0 = domain.task("train", 0, 3)
    table = {int(k): v for k, v in t0.meta["table"].items()}
    assert t0.meta["answer"] == str(max(table, key=table.get))
    t2 = domain.task("train", 2, 3)
    years = [int(w.rstrip(",")) for w in t2.meta["question"].split() if w.rstrip(",").isdigit()]
    table = {int(k): v for k, v in t2.meta["table"].items()}
    assert t2.meta["answer"] == str(table[years[1]] - table[years[0]])
    assert _pixels(t2).shape == (144, 192, 3)


def test_score_answer_normalises_numbers_and_case():
    assert score_answer("<answer>7.0</answer>", "7")[1]["success"] == 1.0
    assert score_answer("<answer>RED</answer>", "red")[1]["success"] == 1.0
    assert score_answer("<answer>-15</answer>", "15")[1]["success"] == 0.0
