"""`posttrain bench docs`: generated `docs.financial` reports through the whole document pipeline with a
real model, on SQLite (the baseline) and on Redis + PostgreSQL, in the same run.

Per backend: ingest the batch, start `--workers` worker processes (`posttrain docs worker --until-idle`),
SIGKILL one of them while it holds a job (`--kill`, on by default) and start a replacement, then wait
for the queue to drain. Figures: documents/min (first enqueue to last result, the kill's re-lease wait
included), p50/p99 job latency (lease to commit), extraction field-F1 against the generated ground
truth, and `lost` / `duplicates` (must both be 0) - with the ratio of each backend's throughput to
SQLite's. With `--compare-model SPEC` the same documents also run through SQLite on a second model (no
kill), and the field F1 of both and their paired difference over documents (bootstrap 95%) are reported.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from posttrain.bench import BenchUsageError

BACKENDS = ("sqlite", "redis-postgres")


def _worker(queue: str, db: str, model: str, opts: Any, threads: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    cmd = [
        sys.executable, "-m", "posttrain", "docs", "worker", "--until-idle",
        "--model", model, "--queue", queue, "--db", db,
        "--visibility-timeout", str(opts.visibility_s), "--backoff", "1",
        "--max-new-tokens", str(opts.max_new_tokens), "--context-tokens", str(opts.context_tokens),
        "--concurrency", str(opts.concurrency),
    ]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def _run_backend(
    name: str,
    queue_url: str,
    db_url: str,
    batch: Any,
    opts: Any,
    work: Path,
    console: Any,
    model: str,
    kill: bool,
) -> dict[str, Any]:
    from posttrain.apps.docs.db import Database, task_key
    from posttrain.apps.docs.demo import score_batch
    from posttrain.apps.docs.pipeline import ingest, status
    from posttrain.apps.docs.queue import QueuePolicy, open_queue
    from posttrain.apps.docs.store import ObjectStore
    from posttrain.envs.domains.docs_financial import EXTRACTION_SCHEMA

    queue = open_queue(queue_url, QueuePolicy(visibility_s=opts.visibility_s))
    db = Database(db_url)
    rep = ingest(ObjectStore(str(batch.store_dir)), queue, db, EXTRACTION_SCHEMA, [], model)
    threads = max(1, (os.cpu_count() or 1) // opts.workers)
    log = work / f"{name}-workers.log"
    t0 = time.perf_counter()
    procs = [_worker(queue_url, db_url, model, opts, threads, log) for _ in range(opts.workers)]
    killed = None
    deadline = t0 + opts.timeout_s
    while any(p.poll() is None for p in procs):
        if time.perf_counter() > deadline:
            for p in procs:
                p.kill()
            raise RuntimeError(
                f"bench docs ({name}): workers still running after {opts.timeout_s} s; see {log}"
            )
        if kill and killed is None:
            running = db.select("SELECT worker FROM jobs WHERE state = 'running' AND worker IS NOT NULL")[1]
            pids = {int(w.rsplit("-", 1)[1].split("/")[0]) for (w,) in running}
            victim = next((p for p in procs if p.pid in pids and p.poll() is None), None)
            if victim is not None:
                os.kill(victim.pid, signal.SIGKILL)
                victim.wait()
                killed = victim.pid
                console.print(f"[{name}] killed worker {victim.pid} mid-job; starting a replacement")
                procs.append(_worker(queue_url, db_url, model, opts, threads, log))
        time.sleep(0.5)
    wall_s = time.perf_counter() - t0
    bad = [p.returncode for p in procs if p.pid != killed and p.returncode != 0]
    if bad:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"bench docs ({name}): worker(s) exited with {bad}; their log ends:\n{tail}")
    st = status(db, queue)
    scores = score_batch(db, batch.truth, task_key(EXTRACTION_SCHEMA, [], model), per_document=True)
    modes = dict(db.select("SELECT mode, COUNT(*) FROM extractions GROUP BY mode")[1])
    dead_errors = collections.Counter(
        (e or "")[:160] for (e,) in db.select("SELECT error FROM jobs WHERE state = 'dead'")[1]
    )
    out = {
        "enqueued": rep.enqueued,
        "docs_per_min": st["docs_per_min"],
        "latency_ms_p50": st["latency_ms_p50"],
        "latency_ms_p99": st["latency_ms_p99"],
        "wall_s": round(wall_s, 1),
        "killed_worker": killed is not None,
        "map_reduce_docs": int(modes.get("map_reduce", 0)),
        **scores,
        "dead_errors": [{"error": e, "jobs": n} for e, n in dead_errors.most_common(3)],
    }
    queue.close()
    db.dispose()
    return out


def main(opts: Any) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    from posttrain.apps.docs import services
    from posttrain.apps.docs.demo import write_batch

    backends = [b.strip() for b in opts.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        raise BenchUsageError(f"--backends: unknown {unknown or '(none)'}; choose from {', '.join(BACKENDS)}")
    try:
        tokens = [int(t) for t in opts.tokens.split(",")]
    except ValueError:
        raise BenchUsageError(f"--tokens '{opts.tokens}' is not a comma list of integers") from None
    if any(t < 256 for t in tokens):
        raise BenchUsageError("--tokens: each length must be >= 256")
    if opts.compare_model:
        from posttrain.models import ModelNotFoundError, resolve

        if opts.compare_model == opts.model:
            raise BenchUsageError(f"--compare-model is --model ({opts.model}); give another model")
        try:
            resolve(opts.compare_model)
        except ModelNotFoundError as err:
            raise BenchUsageError(f"--compare-model: {err}") from None
    console = Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="posttrain-bench-docs-") as d:
        work = Path(d)
        with console.status(f"generating {opts.n} reports of {opts.tokens} tokens"):
            batch = write_batch(work / "store", opts.n, tokens, seed=opts.seed)
        results: dict[str, dict[str, Any]] = {}
        for name in backends:
            with contextlib.ExitStack() as stack:
                if name == "sqlite":
                    urls = (f"sqlite:///{work}/queue.db", f"sqlite:///{work}/docs.db")
                else:
                    try:
                        urls = (
                            stack.enter_context(services.redis_server()),
                            stack.enter_context(services.postgres_server()),
                        )
                    except services.ServiceUnavailable as err:
                        raise BenchUsageError(f"--backends redis-postgres: {err}") from None
                console.print(f"[{name}] {opts.n} documents, {opts.workers} workers on {opts.model}")
                results[name] = _run_backend(name, *urls, batch, opts, work, console, opts.model, opts.kill)
        compare = None
        if opts.compare_model:
            console.print(f"[compare] the same {opts.n} documents on {opts.compare_model} (SQLite, no kill)")
            compare = _run_backend(
                "compare",
                f"sqlite:///{work}/compare-queue.db",
                f"sqlite:///{work}/compare-docs.db",
                batch,
                opts,
                work,
                console,
                opts.compare_model,
                False,
            )
    base = results.get("sqlite")
    for r in results.values():
        if base and base["docs_per_min"] and r["docs_per_min"]:
            r["docs_per_min_vs_sqlite"] = round(r["docs_per_min"] / base["docs_per_min"], 3)
    table = Table(
        title=f"bench docs: {opts.n} reports ({opts.tokens} tokens), {opts.workers} workers, {opts.model}"
    )
    cols = [
        "docs_per_min",
        "latency_ms_p50",
        "latency_ms_p99",
        "field_f1",
        "exact",
        "lost",
        "duplicates",
        "dead",
        "killed_worker",
        "wall_s",
    ]
    table.add_column("backend")
    for c in cols:
        table.add_column(c, justify="right")
    for name, r in results.items():
        table.add_row(name, *(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    Console().print(table)
    first = results[backends[0]]
    comparison = _comparison(opts, first, compare) if compare is not None else None
    for r in (*results.values(), *([compare] if compare else [])):
        r.pop("f1_by_url")
    if comparison:
        d = comparison["field_f1_delta"]
        Console().print(
            f"field F1: {opts.model} {comparison['field_f1'][opts.model]:.3f}, {opts.compare_model} "
            f"{comparison['field_f1'][opts.compare_model]:.3f}; difference {d['delta']:+.3f} "
            f"[{d['ci_low']:+.3f}, {d['ci_high']:+.3f}] over {d['n_documents']} documents"
        )
    return {
        "n": opts.n,
        "tokens": tokens,
        "model": opts.model,
        "workers": opts.workers,
        "docs_per_min": first["docs_per_min"],
        "field_f1": first["field_f1"],
        "lost": sum(r["lost"] for r in results.values()),
        "duplicates": sum(r["duplicates"] for r in results.values()),
        "backends": results,
        **({"compare": {**comparison, "run": compare}} if comparison else {}),
    }


def _comparison(opts: Any, base: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Field F1 of both models on the same documents, and the paired difference (other - base) with a
    bootstrap 95% interval over documents."""
    import numpy as np

    from posttrain.orchestrator.eval.evaluate import bootstrap_ci

    urls = sorted(base["f1_by_url"])
    diffs = np.array([other["f1_by_url"][u] - base["f1_by_url"][u] for u in urls])
    lo, hi = bootstrap_ci(diffs, seed=opts.seed)
    return {
        "model": opts.compare_model,
        "field_f1": {opts.model: base["field_f1"], opts.compare_model: other["field_f1"]},
        "exact": {opts.model: base["exact"], opts.compare_model: other["exact"]},
        "field_f1_delta": {
            "delta": float(diffs.mean()),
            "ci_low": lo,
            "ci_high": hi,
            "n_documents": len(urls),
        },
    }
