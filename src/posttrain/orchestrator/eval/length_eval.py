"""Held-out accuracy of long-context domains per task and length, the task average per length, and the
effective length (RULER's: the longest length up to which the task average stays above a threshold).

`evaluate_lengths` splits each domain into its tasks (`split_tasks`: RULER's 13, the hardness levels of
`longctx.hard`, the question kinds of `longctx.codebase`), scores each task at each length level through
a scorer the caller gives (our engine or an endpoint, `orchestrator.eval.evaluate`), and `length_table`
aggregates: per cell strict accuracy with a bootstrap interval, per length the mean over tasks of their
accuracies (RULER averages its tasks) with a stratified bootstrap interval. Does not load models.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from posttrain.orchestrator.eval.evaluate import BOOTSTRAP_RESAMPLES, EvalReport, bootstrap_ci

RULER_THRESHOLD = 85.6  # percent: RULER's effective-length threshold (Llama-2-7B's score at 4k)
LENGTH_MARGIN_TOKENS = 128  # the chat template and the question around a haystack of `tokens`


def engine_for_length(engine_cfg: Any, tokens: int) -> Any:
    """The engine config that runs a prompt of `tokens` (plus LENGTH_MARGIN_TOKENS) and its reply:
    max_model_len raised to that where shorter, and the KV pool to at least one such sequence's blocks
    plus one (a sequence that can never fit would fail as an infrastructure error)."""
    need = tokens + engine_cfg.max_new_tokens + LENGTH_MARGIN_TOKENS
    blocks = -(-need // engine_cfg.block_size) + 1
    return engine_cfg.model_copy(
        update={
            "max_model_len": max(engine_cfg.max_model_len, need),
            "num_kv_blocks": max(engine_cfg.num_kv_blocks, blocks),
        }
    )


def task_average_ci(
    per_task: Sequence[Sequence[float]], seed: int = 0, resamples: int = BOOTSTRAP_RESAMPLES
) -> tuple[float, float, float]:
    """(mean over tasks of each task's mean, 95% interval): each resample redraws every task's scores
    from its own (stratified), so every task keeps its weight. Tasks with no score are left out."""
    tasks = [np.asarray(t, dtype=float) for t in per_task if len(t)]
    if not tasks:
        return float("nan"), float("nan"), float("nan")
    value = float(np.mean([t.mean() for t in tasks]))
    rng = np.random.default_rng(seed)
    means = np.zeros(resamples)
    for t in tasks:
        means += t[rng.integers(0, len(t), size=(resamples, len(t)))].mean(axis=1)
    means /= len(tasks)
    return value, float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def effective_length(averages: dict[int, float | None], threshold_pct: float) -> int | None:
    """The longest length up to which every task average (a fraction; None: nothing scored) is above
    `threshold_pct` percent; None when the shortest length is not."""
    best = None
    for n in sorted(averages):
        value = averages[n]
        if value is None or not value * 100.0 > threshold_pct:
            break
        best = n
    return best


def length_table(
    scores: dict[str, dict[str, dict[int, Sequence[float | None]]]],
    thresholds: Sequence[float],
    seed: int = 0,
) -> dict[str, Any]:
    """`scores[domain][task][tokens]` = per-task strict success (None: infrastructure failure) ->
    {"tasks": domain -> task -> tokens -> {accuracy, ci_low, ci_high, n, infra_failures},
     "task_average": domain -> tokens -> {value, ci_low, ci_high},
     "effective_length": domain -> str(threshold) -> tokens or None}; figures of cells with nothing
    scored are None."""
    out: dict[str, Any] = {"tasks": {}, "task_average": {}, "effective_length": {}}
    for dom, tasks in scores.items():
        out["tasks"][dom] = {}
        lengths = sorted({n for per in tasks.values() for n in per})
        for task, per in tasks.items():
            cells = {}
            for n in lengths:
                got = [s for s in per.get(n, []) if s is not None]
                lo, hi = bootstrap_ci(np.asarray(got, dtype=float), seed) if got else (None, None)
                cells[str(n)] = {
                    "accuracy": float(np.mean(got)) if got else None,
                    "ci_low": lo,
                    "ci_high": hi,
                    "n": len(got),
                    "infra_failures": sum(s is None for s in per.get(n, [])),
                }
            out["tasks"][dom][task] = cells
        averages: dict[int, float | None] = {}
        out["task_average"][dom] = {}
        for n in lengths:
            per_task = [[s for s in per.get(n, []) if s is not None] for per in tasks.values()]
            figures = task_average_ci(per_task, seed) if any(per_task) else (None, None, None)
            out["task_average"][dom][str(n)] = dict(zip(("value", "ci_low", "ci_high"), figures, strict=True))
            averages[n] = figures[0]
        out["effective_length"][dom] = {f"{t:g}": effective_length(averages, t) for t in thresholds}
    return out


Scorer = Callable[[dict[str, Any], list[Any], int], EvalReport]


def evaluate_lengths(
    domains: dict[str, Any],
    levels: Sequence[int],
    score: Scorer,
    thresholds: Sequence[float] = (RULER_THRESHOLD,),
    seed: int = 0,
) -> dict[str, Any]:
    """Score every task of every domain at every length level with `score(domains, arms, tokens)` (one
    call per level: its domains are keyed `domain/task`, its arms at the task's difficulty for the level,
    `tokens` the level's length) and aggregate with `length_table`."""
    from posttrain.curriculum import Arm
    from posttrain.envs.domains.longctx_common import LEVEL_TOKENS

    for name, domain in domains.items():
        if not hasattr(domain, "split_tasks"):
            raise ValueError(f"--lengths needs long-context domains (longctx.*); {name} has no length levels")
    scores: dict[str, dict[str, dict[int, Sequence[float | None]]]] = {}
    for level in levels:
        tokens = LEVEL_TOKENS[level]
        sub: dict[str, Any] = {}
        arms = []
        for name, domain in domains.items():
            for task, one in domain.split_tasks():
                key = f"{name}/{task}"
                sub[key] = one
                arms.append(Arm(key, one.difficulty_at(level)))
        report = score(sub, arms, tokens)
        for key in sub:
            name, task = key.split("/", 1)
            scores.setdefault(name, {}).setdefault(task, {})[tokens] = report.per_task.get(key, [])
    result = length_table(scores, thresholds, seed)
    result["lengths"] = [LEVEL_TOKENS[level] for level in levels]
    result["thresholds"] = list(thresholds)
    return result
