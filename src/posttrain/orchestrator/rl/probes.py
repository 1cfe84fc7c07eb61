"""Held-out probes during training: when the sampler asks for one, score the arms it names on held-out
tasks (greedy) and record the scores into it, the retention signal behind forgetting-aware curricula.
Owns when a probe runs and what it reports; the scoring itself is `orchestrator.eval.evaluate`'s."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from posttrain.engine import Engine, SamplingParams
    from posttrain.orchestrator.rl.tasks import TaskSource
    from posttrain.rollout import EpisodeLimits


def probe_if_due(
    engine: Engine,
    tokenizer: Any,
    tasks: TaskSource,
    sandbox: Any,
    sampling: SamplingParams,
    limits: EpisodeLimits,
    *,
    step: int,
    probe_every: int,
    size: int,
    seed: int,
    loop: asyncio.AbstractEventLoop,
) -> dict[str, float]:
    """`probe` when probes are on and the sampler wants one at `step` (else {}), timed; the KV cache is
    freed after it."""
    if not (probe_every and tasks.sampler.probe_due(step)):
        return {}
    t0 = time.perf_counter()
    out = probe(
        engine, tokenizer, tasks, sandbox, sampling, limits, step=step, size=size, seed=seed, loop=loop
    )
    # cached prefix KV from the probe would make the next step's numerics depend on whether the run was
    # resumed here (a resumed engine starts cold); start every step from a cold cache
    engine.release_kv_cache()
    out["timeline/probe_s"] = time.perf_counter() - t0
    return out


def probe(
    engine: Engine,
    tokenizer: Any,
    tasks: TaskSource,
    sandbox: Any,
    sampling: SamplingParams,
    limits: EpisodeLimits,
    *,
    step: int,
    size: int,
    seed: int,
    loop: asyncio.AbstractEventLoop,
) -> dict[str, float]:
    """Held-out probes of the arms the sampler names (`size` tasks each), scored into it. The caller
    charges out["heldout/generated_tokens"] to the run's probe_tokens counter."""
    from posttrain.orchestrator.eval.evaluate import evaluate_engine

    with tasks.lock:
        arms = (
            tasks.sampler.probe_arms(step) or tasks.arms
        )  # the sampler may skip arms its training groups measured
    usage: dict[str, float] = {}
    results = evaluate_engine(
        engine,
        tokenizer,
        tasks.domains,
        arms,
        size,
        sandbox,
        sampling,
        limits,
        seed=seed,
        loop=loop,
        usage=usage,
    )
    out: dict[str, float] = {"heldout/generated_tokens": usage.get("generated_tokens", 0.0)}
    for arm, scores in results.items():
        score = float(np.mean(scores)) if scores else 0.0
        if scores:
            with tasks.lock:
                tasks.sampler.record_probe(step, arm, score, n=len(scores))
        out[f"heldout/{arm.domain}:{arm.difficulty}"] = score
    doms: dict[str, list[float]] = {}
    for arm, scores in results.items():
        doms.setdefault(arm.domain, []).extend(scores)
    for d, s in doms.items():
        out[f"heldout/{d}"] = float(np.mean(s))
    return out
