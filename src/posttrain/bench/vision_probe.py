"""`posttrain bench vision-probe`: how much of a visual task's answer a VLM's image features carry, by a
linear probe, against the constant answer and against the encoder's own input pixels, in one run.

For each `--models` spec (`graft`: the grafted embedded default built in process with `--seed`, as
`posttrain models graft-vision` saves it; or a `tiny:<family>` / HF VLM folder), the features the
paged engine puts at an image's placeholders (the tower + projector output, `engine.vision`) are
mean-pooled over the image's placeholder tokens (`mean`) and flattened (`flat`); the oracle (`pixels`)
is the first model's preprocessed input (its image processor's `pixel_values` of each image, i.e. the
image resized to the encoder's input size), flattened. A multinomial logistic regression (L2, L-BFGS,
standardised features, the penalty chosen by 3-fold cross-validation on the train images) is fitted on
`--train` images of the domain's train split and scored on `--heldout` images of its held-out split;
the classes are the train answers (a held-out answer never seen in training counts as a miss). The
baseline is the most frequent train answer, scored on the same held-out images. Accuracies are strict
(the probe's class equals the answer) with 95% Wilson intervals.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any

import torch

from posttrain.bench import BenchUsageError
from posttrain.bench.ci_fix import wilson_interval
from posttrain.types import ImagePart

L2_GRID = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)
CV_FOLDS = 3
FEATURE_BATCH = 32


def domain_images(
    domain: str, split: str, difficulty: int, n: int, seed: int
) -> tuple[list[ImagePart], list[str]]:
    """The first image and the answer (`meta["answer"]`, as a string) of tasks 0..n-1 of a domain's split
    and level; ValueError naming a task that has no image or no answer."""
    from posttrain.envs.registry import get_domain

    dom = get_domain(domain)
    images, answers = [], []
    for i in range(n):
        task = dom.task(split, difficulty, i, seed=seed)
        parts = [
            p
            for m in task.prompt
            if isinstance(m.content, list)
            for p in m.content
            if isinstance(p, ImagePart)
        ]
        if not parts or "answer" not in task.meta:
            raise ValueError(
                f"task {task.id} of '{domain}' has no image part or no meta['answer']: the probe needs an "
                "image-question domain (vision.*)"
            )
        images.append(parts[0])
        answers.append(str(task.meta["answer"]))
    return images, answers


def encoder_features(model: Any, tokenizer: Any, images: list[ImagePart]) -> list[torch.Tensor]:
    """Per image, the `[placeholder tokens, text hidden]` features the paged engine puts at its
    placeholders (the family's tower + projector, float32)."""
    from posttrain.engine.vision import VisionPrefill
    from posttrain.models.vision import image_inputs

    inputs = image_inputs(tokenizer)
    if inputs is None:
        raise ValueError(
            "the model is text-only (its tokenizer carries no image inputs): pass a vision model"
        )
    prefill = VisionPrefill(model, inputs, torch.float32, torch.device("cpu"), cache_images=FEATURE_BATCH)
    out: list[torch.Tensor] = []
    for start in range(0, len(images), FEATURE_BATCH):
        batch = images[start : start + FEATURE_BATCH]
        counts = [inputs.image_tokens(img) for img in batch]
        out.extend(f.clone() for f in prefill.features(batch).split(counts))
    return out


def pooled(features: list[torch.Tensor], how: str) -> torch.Tensor:
    """`[images, dim]`: each image's features mean-pooled over its tokens (`mean`) or flattened (`flat`,
    which needs the same token count for every image)."""
    if how == "mean":
        return torch.stack([f.float().mean(0) for f in features])
    lengths = {f.shape[0] for f in features}
    if len(lengths) > 1:
        raise ValueError(f"flat features need one token count per image; the images give {sorted(lengths)}")
    return torch.stack([f.float().flatten() for f in features])


def pixel_features(tokenizer: Any, images: list[ImagePart]) -> torch.Tensor:
    """`[images, dim]`: each image's preprocessed `pixel_values` (the encoder's input), flattened."""
    from posttrain.models.vision import image_inputs

    inputs = image_inputs(tokenizer)
    if inputs is None:
        raise ValueError(
            "the model is text-only (its tokenizer carries no image inputs): pass a vision model"
        )
    rows = [inputs.hf_inputs([img])["pixel_values"].float().flatten() for img in images]
    if len({r.numel() for r in rows}) > 1:
        raise ValueError("the image processor gives pixel tensors of different sizes: no flat pixel features")
    return torch.stack(rows)


class Probe:
    """A multinomial logistic regression on standardised features: `fit` minimises the mean cross-entropy
    plus `l2 / 2 * |W|^2` (the bias unpenalised) with L-BFGS in float64, in the span of the training rows
    when there are more features than rows."""

    def __init__(self, l2: float, max_iter: int = 200) -> None:
        if l2 < 0:
            raise ValueError(f"l2 must be >= 0, got {l2}")
        self.l2, self.max_iter = l2, max_iter

    def fit(self, x: torch.Tensor, y: torch.Tensor, n_classes: int) -> Probe:
        if x.ndim != 2 or y.shape != (x.shape[0],) or x.shape[0] == 0:
            raise ValueError(
                f"fit takes x [n, d] and y [n] with n > 0; got {tuple(x.shape)} and {tuple(y.shape)}"
            )
        if int(y.min()) < 0 or int(y.max()) >= n_classes:
            raise ValueError(f"labels must lie in 0..{n_classes - 1}")
        x = x.double()
        self.mean = x.mean(0)
        std = x.std(0, unbiased=False)
        self.scale = torch.where(std > 1e-12, std, torch.ones_like(std))
        z = (x - self.mean) / self.scale
        # with more features than rows, W's part outside the rows' span changes no training logit and only
        # adds penalty, so the optimum lies in that span: fit coordinates there (the same minimiser)
        basis = None
        if z.shape[1] > z.shape[0]:
            _, sv, vh = torch.linalg.svd(z, full_matrices=False)
            basis = vh[sv > sv.max() * 1e-10].T if sv.max() > 0 else vh[:0].T
            z = z @ basis
        w = torch.zeros(z.shape[1], n_classes, dtype=torch.float64, requires_grad=True)
        b = torch.zeros(n_classes, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS(
            [w, b],
            max_iter=self.max_iter,
            line_search_fn="strong_wolfe",
            tolerance_grad=1e-9,
            tolerance_change=1e-12,
        )

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(z @ w + b, y) + 0.5 * self.l2 * (w**2).sum()
            loss.backward()
            return loss

        with torch.enable_grad():
            opt.step(closure)
        self.w = (w if basis is None else basis @ w).detach()
        self.b = b.detach()
        return self

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return (((x.double() - self.mean) / self.scale) @ self.w + self.b).argmax(-1)


def choose_l2(x: torch.Tensor, y: torch.Tensor, n_classes: int, grid: tuple[float, ...] = L2_GRID) -> float:
    """The penalty of `grid` with the best mean accuracy over CV_FOLDS interleaved folds (the smaller on
    a tie)."""
    folds = [torch.arange(k, x.shape[0], CV_FOLDS) for k in range(CV_FOLDS)]
    best, best_acc = grid[0], -1.0
    for l2 in grid:
        correct = 0
        for held in folds:
            keep = torch.ones(x.shape[0], dtype=torch.bool)
            keep[held] = False
            probe = Probe(l2).fit(x[keep], y[keep], n_classes)
            correct += int((probe.predict(x[held]) == y[held]).sum())
        if correct / x.shape[0] > best_acc:
            best, best_acc = l2, correct / x.shape[0]
    return best


def probe_figures(
    x_train: torch.Tensor, y_train: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor, n_classes: int
) -> dict[str, Any]:
    """The probe's penalty (cross-validated), train accuracy and held-out accuracy with its 95% Wilson
    interval; a held-out label of -1 (an answer never seen in training) is always a miss."""
    l2 = choose_l2(x_train, y_train, n_classes)
    probe = Probe(l2).fit(x_train, y_train, n_classes)
    hits = int((probe.predict(x_test) == y_test).sum())
    lo, hi = wilson_interval(hits, len(y_test))
    return {
        "dim": int(x_train.shape[1]),
        "l2": l2,
        "train_accuracy": float((probe.predict(x_train) == y_train).double().mean()),
        "correct": hits,
        "accuracy": hits / len(y_test),
        "ci95": [lo, hi],
    }


def _load(spec: str, seed: int) -> tuple[Any, Any]:
    from posttrain.models.vision import graft_vision, load_vision

    return graft_vision(seed) if spec == "graft" else load_vision(spec, seed=seed)


def main(opts: Any) -> dict[str, Any]:
    """Run the benchmark with the options of `posttrain bench vision-probe` (see its --help)."""
    from rich.console import Console
    from rich.table import Table

    from posttrain.models.vision import is_vision_spec

    specs = [s.strip() for s in opts.models.split(",") if s.strip()]
    if not specs:
        raise BenchUsageError(f"--models takes a comma list of vision model specs; got {opts.models!r}")
    bad = [spec for spec in specs if spec != "graft" and not is_vision_spec(spec)]
    if bad:
        raise BenchUsageError(
            f"--models {bad[0]!r}: not a vision model (use graft, tiny:llava, tiny:idefics3, tiny:qwen2_vl or a "
            "local HF VLM folder)"
        )
    if opts.train < 2 * CV_FOLDS or opts.heldout < 1:
        raise BenchUsageError(
            f"--train must be >= {2 * CV_FOLDS} (3-fold cross-validation) and --heldout >= 1"
        )
    start = time.perf_counter()
    load_start = os.getloadavg()
    torch.manual_seed(opts.seed)
    try:
        train_images, train_answers = domain_images(
            opts.domain, "train", opts.difficulty, opts.train, opts.seed
        )
        test_images, test_answers = domain_images(
            opts.domain, "heldout", opts.difficulty, opts.heldout, opts.seed
        )
    except (KeyError, ValueError) as err:
        raise BenchUsageError(str(err)) from None
    classes = sorted(set(train_answers))
    index = {a: i for i, a in enumerate(classes)}
    y_train = torch.tensor([index[a] for a in train_answers])
    y_test = torch.tensor([index.get(a, -1) for a in test_answers])
    constant = Counter(train_answers).most_common(1)[0][0]
    c_hits = sum(a == constant for a in test_answers)
    c_acc = c_hits / len(test_answers)
    out: dict[str, Any] = {
        "domain": opts.domain,
        "difficulty": opts.difficulty,
        "n_train": opts.train,
        "n_heldout": opts.heldout,
        "classes": classes,
        "constant": {
            "answer": constant,
            "accuracy": c_acc,
            "ci95": list(wilson_interval(c_hits, len(test_answers))),
        },
        "probes": [],
    }
    console = Console(stderr=True)
    arms: list[tuple[str, str, torch.Tensor, torch.Tensor]] = []
    for k, spec in enumerate(specs):
        console.print(f"vision-probe: features of {spec} ({len(train_images)} + {len(test_images)} images)")
        try:
            model, tok = _load(spec, opts.seed)
            feats_train = encoder_features(model, tok, train_images)
            feats_test = encoder_features(model, tok, test_images)
            for how in ("mean", "flat"):
                arms.append((spec, how, pooled(feats_train, how), pooled(feats_test, how)))
            if k == 0:
                arms.append(
                    (spec, "pixels", pixel_features(tok, train_images), pixel_features(tok, test_images))
                )
        except (OSError, ValueError) as err:
            raise BenchUsageError(f"--models {spec!r}: {err}") from None
        del model
    for spec, how, x_train, x_test in arms:
        console.print(f"vision-probe: fitting {spec} {how} ({x_train.shape[1]} features)")
        fig = probe_figures(x_train, y_train, x_test, y_test, len(classes))
        fig.update(model=spec, features=how, ratio_to_constant=fig["accuracy"] / c_acc if c_acc else None)
        out["probes"].append(fig)
    out["wall_s"] = time.perf_counter() - start
    out["load_avg_start"], out["load_avg_end"] = list(load_start), list(os.getloadavg())

    table = Table(
        title=f"linear probe, {opts.domain} level {opts.difficulty}: {opts.train} train / {opts.heldout} held-out images"
    )
    for col in ("model", "features", "dim", "l2", "train acc", "held-out [95% CI]", "/ constant"):
        table.add_column(col)
    for p in out["probes"]:
        ratio = "-" if p["ratio_to_constant"] is None else f"{p['ratio_to_constant']:.2f}"
        table.add_row(
            p["model"],
            p["features"],
            str(p["dim"]),
            f"{p['l2']:g}",
            f"{p['train_accuracy']:.3f}",
            f"{p['accuracy']:.3f} [{p['ci95'][0]:.3f}, {p['ci95'][1]:.3f}]",
            ratio,
        )
    lo, hi = out["constant"]["ci95"]
    table.add_row("constant", repr(constant), "-", "-", "-", f"{c_acc:.3f} [{lo:.3f}, {hi:.3f}]", "1.00")
    Console().print(table)
    return out
