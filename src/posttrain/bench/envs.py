"""`posttrain bench envs`: how fast the environments verify, how fast CAD scripts go through the warm
sandbox pool against an import per script, and how often the base model succeeds per domain and level.

- Verifier episodes/s: every registered domain (those needing options are listed as skipped) runs its
  reference solutions on `--episodes` tasks of its first split and level, `--clients` at a time, after
  one untimed pass (which fills per-task caches, such as `cad.modeling`'s target meshes).
- CAD scripts/s: `--clients` closed-loop clients grade reference scripts of every `cad.modeling` level
  through the `cad` profile (build, tessellate, return the mesh, then IoU, Chamfer and the CAD-Recode
  IoU) for `--seconds`; p50/p99 latency, and the CPU time per script of this process and the pool's
  workers (cpuacct), whence `cad_cpu_bound_per_s` = CPUs / CPU time: the rate the CPUs allow when
  nothing else runs (a bound, not a measured rate). The baseline in the same run: the same runner program in a
  fresh `python` per script (no jail), which imports CadQuery each time, graded the same way, for
  `--baseline-scripts` scripts at the same concurrency; the ratio is pool / baseline.
- Base rate: strict accuracy (`success`) per domain and level of `--model` on held-out tasks, sampled
  at T=1, `--samples` per task over `--tasks` tasks, first attempt only (`envs.max_turns=1`), with 95%
  bootstrap intervals; `--samples 0` skips it.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from posttrain.bench import BenchUsageError
from posttrain.bench.sandbox import closed_loop_async, metered_pool

CAD = "cad.modeling"
CAD_TARGET_PER_S = 20.0


def parse_domain_levels(spec: str) -> list[tuple[str, list[int] | None]]:
    """`"cad.modeling,docs.financial:0+1"` -> [("cad.modeling", None), ("docs.financial", [0, 1])]
    (None: every level). BenchUsageError names a malformed entry."""
    out: list[tuple[str, list[int] | None]] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        name, sep, levels = item.partition(":")
        if not sep:
            out.append((name, None))
            continue
        try:
            out.append((name, [int(x) for x in levels.split("+")]))
        except ValueError:
            raise BenchUsageError(
                f"--base-domains entry {item!r}: levels are integers joined by '+', e.g. docs.financial:0+1"
            ) from None
    if not out:
        raise BenchUsageError("--base-domains is empty; give e.g. cad.modeling,docs.financial:0")
    return out


async def _reference_rate(domain: Any, sandbox: Any, episodes: int, clients: int) -> dict[str, Any]:
    from posttrain.envs import check_reference

    split, level = domain.splits[0], domain.difficulties[0]
    tasks = [domain.task(split, level, i) for i in range(episodes)]
    gate = asyncio.Semaphore(clients)
    box = sandbox if domain.requires_sandbox else None

    async def one(task: Any) -> Any:
        async with gate:
            return await check_reference(domain, task, box)

    await asyncio.gather(*(one(t) for t in tasks))  # untimed: fills per-task caches
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(t) for t in tasks))
    wall = time.perf_counter() - t0
    infra = sum(bool(r.info.get("infra_failure")) for r in results)
    full = sum(r.reward == 1.0 for r in results)
    return {
        "episodes_per_s": len(tasks) / wall if wall else 0.0,
        "episodes": len(tasks),
        "level": level,
        "split": split,
        "reference_full_marks": full,
        "infra_failures": infra,
    }


def verifier_rates(sandbox: Any, episodes: int, clients: int, console: Any) -> tuple[dict, dict]:
    """({domain: figures}, {domain: why skipped}) over every registered domain."""
    from posttrain.envs import get_domain, list_domains
    from posttrain.envs.registry import domain_class

    rates: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for name in list_domains():
        try:
            cls = domain_class(name)
            if cls.required_options:
                skipped[name] = f"needs options: {', '.join(cls.required_options)}"
                continue
            domain = get_domain(name)
            console.print(f"[dim]verifier: {name} ...[/]")
            rates[name] = asyncio.run(_reference_rate(domain, sandbox, episodes, clients))
        except Exception as err:  # noqa: BLE001 - one domain that cannot run is reported, not fatal
            skipped[name] = f"{type(err).__name__}: {err}"[:300]
    return rates, skipped


def cad_tasks(per_level: int) -> list[Any]:
    from posttrain.envs import get_domain

    d = get_domain(CAD)
    return [d.task("heldout", lvl, i) for lvl in d.difficulties for i in range(per_level)]


async def _cad_pool(
    sandbox: Any, tasks: list[Any], clients: int, seconds: float, meter: Any
) -> dict[str, Any]:
    from posttrain.envs.domains import cad_modeling as cad

    domain = cad.CadModelingDomain()
    refs = {t.id: domain.reference(t)[0] for t in tasks}
    for t in tasks:  # warm: every worker forked once, every target built
        await cad.grade(sandbox, t, refs[t.id])
    turn = iter(range(1 << 62))

    async def one() -> bool:
        task = tasks[next(turn) % len(tasks)]
        graded = await cad.grade(sandbox, task, refs[task.id])
        return graded.rewards.get("success") == 1.0

    before = meter.usage_ns()
    summary = await closed_loop_async(one, clients, seconds)
    after = meter.usage_ns()
    if before is not None and after is not None and summary["n"]:
        summary["cpu_ms"] = (after - before) / 1e6 / summary["n"]  # this process and the pool's workers
    return summary


def _cad_import_per_script(sandbox: Any, tasks: list[Any], n: int, clients: int) -> dict[str, Any]:
    """The runner in a fresh interpreter per script (imports CadQuery each time), graded as in the pool
    against the same targets (already built: `target_solid` answers from its cache)."""
    from posttrain.envs.domains import cad_modeling as cad
    from posttrain.sandbox.api import ExecResult, ExecStatus

    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    targets = {
        t.id: asyncio.run(cad.target_solid(sandbox, t.meta["reference_code"])).solid for t in tasks[:n]
    }

    def one(task: Any) -> tuple[float, bool]:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            Path(tmp, "part.py").write_text(task.meta["reference_code"])
            proc = subprocess.run(
                [sys.executable, "-c", cad.runner_source()],
                cwd=tmp,
                env={**env, "HOME": tmp},
                capture_output=True,
                timeout=300,
            )
            files = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.name.startswith("cad_")}
        status = ExecStatus.OK if proc.returncode == 0 else ExecStatus.RUNTIME_ERROR
        built = cad.read_build(
            ExecResult(status, proc.returncode, None, proc.stdout, proc.stderr, files=files)
        )
        ok = False
        if built.solid is not None:
            cmp, _ = cad.measure(targets[task.id], built.solid)
            ok = cmp.iou >= cad.SUCCESS_IOU
        return time.perf_counter() - t0, ok

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one, tasks[:n]))
    wall = time.perf_counter() - t0
    lat = sorted(r[0] for r in results)
    return {
        "per_s": len(results) / wall,
        "p50_ms": statistics.median(lat) * 1000,
        "n": len(results),
        "errors": sum(not r[1] for r in results),
    }


def base_rates(opts: Any, sandbox: Any, console: Any) -> dict[str, Any]:
    """Accuracy per domain and level of `opts.model` (T=1, `opts.samples` per task), with intervals."""
    from posttrain.config import load_config
    from posttrain.curriculum import Arm
    from posttrain.envs import get_domain
    from posttrain.orchestrator.eval.evaluate import evaluate_local

    cfg = load_config(None, ["envs.max_turns=1", f"engine.max_new_tokens={opts.max_new_tokens}"])
    domains: dict[str, Any] = {}
    arms: list[Any] = []
    skipped: dict[str, str] = {}
    for name, levels in parse_domain_levels(opts.base_domains):
        try:
            domain = get_domain(name)
            bad = [lvl for lvl in levels or [] if lvl not in domain.difficulties]
            if bad:
                raise BenchUsageError(f"{name} has no level {bad[0]} (levels: {domain.difficulties})")
            domain.task(
                "heldout" if "heldout" in domain.splits else domain.splits[-1],
                (levels or domain.difficulties)[0],
                0,
            )
        except BenchUsageError:
            raise
        except Exception as err:  # noqa: BLE001 - a domain that cannot make tasks here is reported
            skipped[name] = f"{type(err).__name__}: {err}"[:300]
            continue
        domains[name] = domain
        arms += [Arm(name, lvl) for lvl in levels or domain.difficulties]
    if not arms:
        return {"base_rate": {}, "base_rate_detail": {}, "base_rate_skipped": skipped}
    console.print(
        f"[dim]base rate: {opts.model}, {len(arms)} levels x {opts.tasks} tasks x {opts.samples} samples ...[/]"
    )
    t0 = time.perf_counter()
    report = evaluate_local(
        opts.model,
        cfg,
        domains,
        arms,
        opts.tasks,
        opts.seed,
        sandbox,
        temperature=1.0,
        samples=opts.samples,
        by_arm=True,
    )
    rate: dict[str, dict[str, float]] = {}
    detail: dict[str, dict[str, Any]] = {}
    for arm in arms:
        entry = report.per_domain.get(arm.key, {})
        rate.setdefault(arm.domain, {})[str(arm.difficulty)] = entry.get("accuracy", float("nan"))
        detail.setdefault(arm.domain, {})[str(arm.difficulty)] = {
            k: entry.get(k)
            for k in ("accuracy", "ci_low", "ci_high", "n", "samples", "mean_reward", "mean_components")
        }
    return {
        "base_rate": rate,
        "base_rate_detail": detail,
        "base_rate_skipped": skipped,
        "base_rate_wall_s": time.perf_counter() - t0,
        "base_rate_failures": report.failures[:10],
    }


def main(opts: Any) -> dict[str, Any]:
    """Run the benchmark with the options of `posttrain bench envs` (see its --help)."""
    from rich.console import Console
    from rich.table import Table

    from posttrain.envs.domains.cad_modeling import INSTALL_HINT, cadquery_available

    if opts.samples < 0 or opts.tasks < 1 or opts.episodes < 1 or opts.seconds <= 0:
        raise BenchUsageError("--samples >= 0, --tasks >= 1, --episodes >= 1 and --seconds > 0 are required")
    console = Console(stderr=True)
    load_start = os.getloadavg()
    meter, sandbox = metered_pool(opts.pool_size)
    pool = sandbox.settings.pool_size
    clients = opts.clients or 2 * pool
    out: dict[str, Any] = {"pool_size": pool, "clients": clients, "cpus": os.cpu_count()}
    try:
        out["verifier"], out["verifier_skipped"] = verifier_rates(sandbox, opts.episodes, clients, console)
        out["verifier_episodes_per_s"] = {k: v["episodes_per_s"] for k, v in out["verifier"].items()}
        if cadquery_available():
            tasks = cad_tasks(opts.cad_tasks_per_level)
            console.print(f"[dim]CAD scripts through the warm pool for {opts.seconds:g} s ...[/]")
            warm = asyncio.run(_cad_pool(sandbox, tasks, clients, opts.seconds, meter))
            console.print(f"[dim]CAD baseline: {opts.baseline_scripts} scripts, an import each ...[/]")
            cold = _cad_import_per_script(sandbox, tasks, min(opts.baseline_scripts, len(tasks)), clients)
            out.update(
                cad_scripts_per_s=warm["per_s"],
                cad_p50_ms=warm["p50_ms"],
                cad_p99_ms=warm["p99_ms"],
                cad_scripts=warm["n"],
                cad_cpu_ms_per_script=warm.get("cpu_ms"),
                cad_cpu_bound_per_s=(os.cpu_count() or 1) * 1000 / warm["cpu_ms"]
                if warm.get("cpu_ms")
                else None,
                cad_errors=warm["errors"],
                cad_import_per_script_per_s=cold["per_s"],
                cad_import_per_script_p50_ms=cold["p50_ms"],
                cad_import_per_script_errors=cold["errors"],
                cad_speedup=warm["per_s"] / cold["per_s"] if cold["per_s"] else float("nan"),
                cad_target_per_s=CAD_TARGET_PER_S,
            )
        else:
            out["cad_skipped"] = INSTALL_HINT
        if opts.samples:
            out.update(base_rates(opts, sandbox, console))
        else:
            out.update(base_rate={}, base_rate_skipped={"*": "--samples 0"})
    finally:
        sandbox.close_blocking()
        meter.close()
    out["load_avg_start"] = list(load_start)
    out["load_avg_end"] = list(os.getloadavg())

    table = Table(
        title=f"bench envs: pool {pool}, {clients} clients, {os.cpu_count()} CPUs, load {load_start[0]:.1f}"
    )
    for col in ("figure", "value"):
        table.add_column(col)
    for name, fig in out["verifier"].items():
        table.add_row(f"verifier {name} (level {fig['level']})", f"{fig['episodes_per_s']:.1f} episodes/s")
    for name, why in out["verifier_skipped"].items():
        table.add_row(f"verifier {name}", f"skipped: {why}")
    if "cad_scripts_per_s" in out:
        table.add_row(
            "CAD scripts/s, warm pool (incl. IoU)",
            f"{out['cad_scripts_per_s']:.1f} (p50 {out['cad_p50_ms']:.0f} ms, p99 {out['cad_p99_ms']:.0f} ms; "
            f"target >= {CAD_TARGET_PER_S:g})",
        )
        table.add_row(
            "CAD scripts/s, import per script",
            f"{out['cad_import_per_script_per_s']:.2f} (p50 {out['cad_import_per_script_p50_ms']:.0f} ms)",
        )
        table.add_row("CAD speed-up (pool / import)", f"{out['cad_speedup']:.1f}x")
        if out["cad_cpu_ms_per_script"]:
            table.add_row(
                "CAD CPU time per script (grader + sandbox)",
                f"{out['cad_cpu_ms_per_script']:.0f} ms: {out['cad_cpu_bound_per_s']:.1f}/s on idle CPUs",
            )
    for dom, levels in out.get("base_rate", {}).items():
        for lvl, acc in levels.items():
            d = out["base_rate_detail"][dom][lvl]
            table.add_row(
                f"base rate {dom} level {lvl}",
                f"{acc:.3f} [{d['ci_low']:.3f}, {d['ci_high']:.3f}] n={d['n']}",
            )
    console.print(table)
    return out
