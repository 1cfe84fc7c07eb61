"""vision.cad_drawing (questions on a part's engineering drawing) and the image-caption rows of the
alignment stage: exact answers from the part's parameters, strict scoring, deterministic disjoint
splits shared with cad.modeling, nothing in the text for a text-only model; captions from the ground
truth, written as JSONL that `posttrain sft` trains a tiny VLM on."""

from __future__ import annotations

import asyncio
import io
import json
import re

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from posttrain.cli import app
from posttrain.envs import get_domain
from posttrain.envs.base import split_of
from posttrain.envs.domains.cad_drawing import DESCRIPTION, render_part
from posttrain.envs.domains.vision_captions import CAPTION_PROMPT, caption_of, caption_rows
from posttrain.envs.scripted import check_reference, run_episode
from posttrain.orchestrator.offline.sft import load_jsonl
from posttrain.telemetry import read_metrics
from posttrain.types import Task

runner = CliRunner()


def _episode(domain, task, text):
    return asyncio.run(run_episode(domain.make_env(), task, [text]))


def test_references_score_one_and_wrong_malformed_and_unit_answers_lower():
    domain = get_domain("vision.cad_drawing")
    for level in domain.difficulties:
        for i in range(3):
            task = domain.task("heldout", level, i)
            answer = task.meta["answer"]
            assert asyncio.run(check_reference(domain, task)).reward == 1.0
            off_by_one = _episode(domain, task, f"<answer>{int(answer) + 1}</answer>")
            assert off_by_one.reward == pytest.approx(0.15) and off_by_one.rewards["success"] == 0.0
            assert _episode(domain, task, "<answer>").reward == 0.0
            assert _episode(domain, task, "").rewards["success"] == 0.0
            # strict: a diameter answered with its sign is not the number asked for
            assert _episode(domain, task, f"<answer>Ø{answer}</answer>").rewards["success"] == 0.0


def test_answers_are_the_parts_parameters_and_the_hole_count():
    domain = get_domain("vision.cad_drawing")
    for i in range(12):
        zero = domain.task("train", 0, i)
        numbers = [int(n) for n in re.findall(r"(\d+) mm", zero.meta["part"])]
        assert int(zero.meta["answer"]) in numbers and zero.meta["family"] in ("box", "cylinder")
        holes = domain.task("train", 1, i)
        assert holes.meta["asked"] == "holes" and int(holes.meta["answer"]) == holes.meta["holes"] >= 1
        part = holes.meta["part"]
        if holes.meta["family"] == "plate_with_holes":
            assert int(holes.meta["answer"]) == part.count("), (") + 1  # one (x, y) per hole
        if holes.meta["family"] == "flange":
            bolts = int(re.search(r"and (\d+) bolt holes", part).group(1))
            assert int(holes.meta["answer"]) == bolts + 1  # the bolt holes and the bore
        for level in (2, 3):
            t = domain.task("train", level, i)
            assert t.meta["answer"] == t.meta["dimensions"][t.meta["asked"]]


def test_the_image_is_the_parts_drawing_and_the_text_gives_nothing_away():
    domain = get_domain("vision.cad_drawing")
    tasks = [domain.task("train", level, i) for level in domain.difficulties for i in range(6)]
    for t in tasks:
        (img,) = t.prompt[0].images
        assert img.description == DESCRIPTION
        assert t.meta["answer"] not in re.findall(r"\d+", t.prompt[0].text)
    t = tasks[0]
    with Image.open(io.BytesIO(t.prompt[0].images[0].png)) as im:
        shown = np.asarray(im.convert("RGB"))
    family, dims = t.meta["family"], t.meta["part"]
    numbers = tuple(int(n) for n in re.findall(r"(\d+) mm", dims))
    dims = numbers if family == "box" else (numbers[0], numbers[1])
    assert np.array_equal(shown, render_part(family, dims).pixels)


def test_deterministic_and_split_by_the_part_like_cad_modeling():
    domain = get_domain("vision.cad_drawing")
    for level in domain.difficulties:
        train = [domain.task("train", level, i) for i in range(10)]
        again = [domain.task("train", level, i) for i in range(3)]
        assert [t.prompt[0].images[0].png for t in train[:3]] == [t.prompt[0].images[0].png for t in again]
        held = [domain.task("heldout", level, i) for i in range(10)]
        assert not {t.meta["content_key"] for t in held} & {t.meta["content_key"] for t in train}
        assert all(split_of(t.meta["content_key"]) == "heldout" for t in held)
        assert len({t.meta["answer"] for t in train}) > 1


def _task(domain: str, meta: dict) -> Task:
    return Task("x", domain, 0, [], meta=meta)


def test_captions_state_the_ground_truth():
    shapes = [
        {"kind": "square", "colour": "blue", "cx": 70, "cy": 10, "r": 9},
        {"kind": "circle", "colour": "red", "cx": 20, "cy": 50, "r": 9},
    ]
    assert (
        caption_of(_task("vision.shapes", {"shapes": shapes}))
        == "2 shapes on a light background, from left to right: a red circle and a blue square."
    )
    assert (
        caption_of(_task("vision.views", {"panels": [["triangle", "green"], ["circle", "yellow"]]}))
        == "Two panels: A shows a green triangle and B shows a yellow circle."
    )
    assert caption_of(_task("vision.chart", {"table": {2019: 95, 2020: 40}})) == (
        "A bar chart of a company's yearly revenue in $M, 2 years: 2019: 95, 2020: 40."
    )
    with pytest.raises(ValueError, match="no captions for domain 'math'"):
        caption_of(_task("math", {}))
    with pytest.raises(ValueError, match="no captions for domain 'math'"):
        caption_rows(2, domains=["math"])


def test_caption_rows_carry_each_tasks_image_round_robin_over_domains_and_levels():
    rows = caption_rows(14, seed=3)
    assert rows == caption_rows(14, seed=3)
    sources = [r["source"] for r in rows]
    names = ["vision.shapes", "vision.views", "vision.chart", "vision.cad_drawing"]
    assert sources[:4] == [f"{name}:train:d0:s3:0" for name in names]
    assert sources[4:8] == [f"{name}:train:d1:s3:0" for name in names]
    assert sources[8:13] == [
        "vision.shapes:train:d2:s3:0",
        "vision.chart:train:d2:s3:0",
        "vision.cad_drawing:train:d2:s3:0",
        "vision.shapes:train:d3:s3:0",
        "vision.cad_drawing:train:d3:s3:0",
    ]
    assert sources[13] == "vision.shapes:train:d0:s3:1"
    domain = get_domain("vision.cad_drawing")
    task = domain.task("train", 0, 0, 3)
    user, assistant = rows[3]["messages"]
    assert user["content"][0] == {"type": "text", "text": CAPTION_PROMPT}
    assert user["content"][1]["image_url"]["url"] == task.prompt[0].images[0].data_url()
    assert assistant["content"].endswith(task.meta["part"])


def test_posttrain_sft_trains_tiny_llava_on_caption_rows(tmp_path):
    data = tmp_path / "captions.jsonl"
    result = runner.invoke(app, ["tasks", "captions", "--out", str(data), "--n", "4"])
    assert result.exit_code == 0, result.output
    examples = load_jsonl(data)
    assert len(examples) == 4 and all(len(e.messages[0].images) == 1 for e in examples)  # one per domain
    result = runner.invoke(
        app,
        [
            "sft",
            "--data",
            str(data),
            "--name",
            "align",
            "--set=model.spec=tiny:llava",
            "--set=sft.heldout_frac=0",
            "--set=sft.batch_size=4",
            "--set=sft.epochs=3",
            "--set=trainer.lr=1e-2",
            "--set=telemetry.progress=false",
            "--set=telemetry.tensorboard=false",
            f"--set=telemetry.run_dir={tmp_path / 'runs'}",
        ],
    )
    assert result.exit_code == 0, result.output
    run = tmp_path / "runs" / "align"
    losses = [r["train/loss"] for r in read_metrics(run / "metrics.jsonl")]
    assert len(losses) == 3 and losses[-1] < losses[0]
    stored = {p.stem for p in (run / "images").glob("*.png")}
    assert stored == {e.messages[0].images[0].sha256 for e in examples}  # every row's image, by hash
    assert (run / "policy" / "config.json").is_file()
    json.loads((run / "policy" / "config.json").read_text())


def test_tasks_captions_refuses_unknown_domains_and_splits(tmp_path):
    out = tmp_path / "c.jsonl"
    result = runner.invoke(app, ["tasks", "captions", "--out", str(out), "--domains", "math"])
    assert result.exit_code == 2 and "no captions for domain 'math'" in result.output
    result = runner.invoke(app, ["tasks", "captions", "--out", str(out), "--split", "eval"])
    assert result.exit_code == 2 and "has no split 'eval'" in result.output
    assert not out.exists()


def test_sft_from_env_takes_the_references_with_their_drawings():
    from posttrain.orchestrator.offline.sft import examples_from_env

    domain = get_domain("vision.cad_drawing")
    examples = examples_from_env("vision.cad_drawing", [0, 1, 2, 3], 4)
    for level, ex in enumerate(examples):
        task = domain.task("train", level, 0)
        assert ex.source == task.id and [m.content for m in ex.messages[1:]] == domain.reference(task)
        assert ex.messages[0].images[0].png == task.prompt[0].images[0].png
