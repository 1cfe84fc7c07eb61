"""`posttrain bench vision-probe`: the probe separates planted separable features and falls back to the
majority class on uninformative ones, the features are the projector output transformers computes,
a short run on tiny:llava reports its figures, and bad input exits 2 with the problem named."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from posttrain.bench.vision_probe import (
    Probe,
    domain_images,
    encoder_features,
    pixel_features,
    pooled,
    probe_figures,
)
from posttrain.cli.bench import run_bench
from posttrain.envs.registry import get_domain
from posttrain.models.vision import image_inputs, tiny_llava


def _planted(n_per_class: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """4 classes in 8 dimensions: class c is the unit vector e_c plus N(0, 0.05^2) noise, so the classes
    are apart by ~1.41 against noise of 0.05: linearly separable with a wide margin."""
    y = torch.arange(4).repeat_interleave(n_per_class)
    x = torch.nn.functional.one_hot(y, 8).double() + 0.05 * torch.randn(len(y), 8, generator=generator)
    return x, y


def test_the_probe_separates_planted_separable_features():
    g = torch.Generator().manual_seed(0)
    x_train, y_train = _planted(10, g)
    x_test, y_test = _planted(5, g)
    fig = probe_figures(x_train, y_train, x_test, y_test, 4)
    assert fig["dim"] == 8 and fig["train_accuracy"] == 1.0
    assert fig["correct"] == 20 and fig["accuracy"] == 1.0
    # Wilson 95% for 20/20: centre (1 + z^2/40) / (1 + z^2/20) = 0.91944, half 0.08052
    assert fig["ci95"] == pytest.approx([0.83887, 1.0], abs=1e-4)
    # the same features with the labels shuffled carry nothing the held-out split can use
    shuffled = y_train[torch.randperm(len(y_train), generator=g)]
    assert probe_figures(x_train, shuffled, x_test, y_test, 4)["accuracy"] < 0.6


def test_uninformative_features_give_the_majority_class_and_unseen_answers_miss():
    x_train = torch.zeros(12, 5)
    y_train = torch.tensor([0] * 6 + [1] * 3 + [2] * 3)
    probe = Probe(l2=0.1).fit(x_train, y_train, 3)
    assert probe.predict(torch.zeros(4, 5)).tolist() == [0, 0, 0, 0]
    # held-out labels 0, 1, 2 and -1 (an answer never seen in training): only the 0 is right
    fig = probe_figures(x_train, y_train, torch.zeros(4, 5), torch.tensor([0, 1, 2, -1]), 3)
    assert fig["correct"] == 1 and fig["accuracy"] == 0.25


def test_with_more_features_than_rows_the_fit_is_the_full_dimensional_optimum():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20, 50, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (20,), generator=g)
    probe = Probe(l2=0.1).fit(x, y, 4)
    # the gradient of the full 50-dimensional objective vanishes at the fitted W, b (strictly convex: the minimiser)
    w, b = probe.w.clone().requires_grad_(), probe.b.clone().requires_grad_()
    z = (x - x.mean(0)) / x.std(0, unbiased=False)
    loss = torch.nn.functional.cross_entropy(z @ w + b, y) + 0.05 * (w**2).sum()
    gw, gb = torch.autograd.grad(loss, (w, b))
    assert w.shape == (50, 4) and gw.abs().max() < 1e-6 and gb.abs().max() < 1e-6


def test_features_are_the_projector_output_transformers_computes():
    model, tok = tiny_llava(0)
    images, answers = domain_images("vision.shapes", "heldout", 0, 3, 0)
    task = get_domain("vision.shapes").task("heldout", 0, 2, seed=0)
    assert answers[2] == task.meta["answer"] and images[2] == task.prompt[0].content[1]
    feats = encoder_features(model, tok, images)
    pixels = image_inputs(tok).hf_inputs(images)["pixel_values"]
    with torch.no_grad():
        ref = model.get_image_features(
            pixel_values=pixels,
            vision_feature_layer=model.config.vision_feature_layer,
            vision_feature_select_strategy=model.config.vision_feature_select_strategy,
        ).pooler_output
    assert [f.shape for f in feats] == [(16, 64)] * 3  # 16 placeholders x the text hidden size
    for mine, theirs in zip(feats, ref, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    torch.testing.assert_close(
        pooled(feats, "mean"), torch.stack([r.mean(0) for r in ref]), rtol=0, atol=1e-6
    )
    assert pooled(feats, "flat").shape == (3, 16 * 64)
    torch.testing.assert_close(pixel_features(tok, images), pixels.reshape(3, -1))  # 3 x 32 x 32
    with pytest.raises(ValueError, match=r"one token count per image; the images give \[2, 3\]"):
        pooled([torch.zeros(2, 4), torch.zeros(3, 4)], "flat")


def test_a_short_run_on_tiny_llava_reports_probes_against_the_constant_answer():
    out = run_bench("vision-probe", ["--models", "tiny:llava", "--train", "12", "--heldout", "8"])
    dom = get_domain("vision.shapes")
    train = [dom.task("train", 0, i, seed=0).meta["answer"] for i in range(12)]
    test = [dom.task("heldout", 0, i, seed=0).meta["answer"] for i in range(8)]
    constant = Counter(train).most_common(1)[0][0]
    assert out["classes"] == sorted(set(train))
    assert out["constant"]["answer"] == constant
    assert out["constant"]["accuracy"] == sum(a == constant for a in test) / 8
    arms = [(p["model"], p["features"], p["dim"]) for p in out["probes"]]
    assert arms == [("tiny:llava", "mean", 64), ("tiny:llava", "flat", 1024), ("tiny:llava", "pixels", 3072)]
    for p in out["probes"]:
        assert p["accuracy"] == p["correct"] / 8 and p["ci95"][0] <= p["accuracy"] <= p["ci95"][1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--models", "tiny:llava,tiny:llama"],
            "--models 'tiny:llama': not a vision model (use graft, tiny:llava",
        ),
        (["--models", " , "], "--models takes a comma list of vision model specs"),
        (["--domain", "math"], "has no image part or no meta['answer']"),
        (["--domain", "vision.nope"], "vision.nope"),
        (["--difficulty", "7"], "difficulty"),
        (["--train", "5"], "--train must be >= 6"),
        (["--heldout", "0"], "--heldout >= 1"),
    ],
)
def test_bad_input_exits_2_naming_the_problem(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        run_bench("vision-probe", ["--models", "tiny:llava", "--train", "6", "--heldout", "2", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
