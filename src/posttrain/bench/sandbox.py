"""`posttrain bench sandbox`: executions/s and latency of the warm jailed pool against two baselines
measured in the same run on the same jobs: `subprocess.run([python, -c])` and one `bwrap` jail per
execution. Closed loop: C clients each submit their next job when the previous one returns.

Scenarios: (a) a trivial snippet, (b) a solution graded by 10 assert tests: the pool and the subprocess
baseline run the same grading job (the trusted runner, which starts the solution in a process of its
own and evaluates the asserts itself; `sandbox.grading`), while the bwrap baseline runs solution +
asserts as one script in its jail, which forges easily and is cheaper (its ratio is a bound, not like
for like), (c) a numpy import snippet (numpy profile). Where cgroup v1 cpuacct is writable it also reports CPU ms per execution (all
processes involved), which unlike executions/s does not depend on how busy a shared machine is.
It only measures; the pool lives in `pool`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.sandbox import isolation as iso_mod
from posttrain.sandbox.api import ExecStatus, Job, Limits
from posttrain.sandbox.grading import assert_job, grade_asserts
from posttrain.sandbox.pool import LocalSandbox

TRIVIAL = "print(sum(range(10)))"
SOLUTION = "def add(a, b):\n    return a + b\n"
TESTS = [f"assert add({i}, {i + 1}) == {2 * i + 1}" for i in range(10)]
NUMPY = "import numpy as np\nprint(int(np.arange(10).sum()))"


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _summary(latencies_s: list[float], elapsed_s: float, errors: int) -> dict:
    return {
        "per_s": len(latencies_s) / elapsed_s if elapsed_s else 0.0,
        "p50_ms": _percentile(latencies_s, 0.50) * 1000,
        "p99_ms": _percentile(latencies_s, 0.99) * 1000,
        "n": len(latencies_s),
        "errors": errors,
    }


class CpuMeter:
    """CPU time of this process and everything it starts (workers, jails, baselines), from a cpuacct
    cgroup nested under our own: a per-execution cost that does not depend on how busy the machine is.
    Absent (usage None) where cgroup v1 cpuacct is not writable."""

    def __init__(self) -> None:
        self.home = iso_mod.own_cgroup_dir("cpuacct")
        self.dir: Path | None = self.home / f"posttrain-bench-{os.getpid()}"
        try:
            self.dir.mkdir(exist_ok=True)
            (self.dir / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            self.dir = None

    def usage_ns(self) -> int | None:
        if self.dir is None:
            return None
        return int((self.dir / "cpuacct.usage").read_text())

    def close(self) -> None:
        if self.dir is None:
            return
        try:
            (self.home / "cgroup.procs").write_text(str(os.getpid()))
            for _ in range(100):  # the last jail processes may still be exiting
                try:
                    self.dir.rmdir()
                    break
                except OSError:
                    time.sleep(0.05)
        except OSError:
            pass


def metered_pool(pool_size: int) -> tuple[CpuMeter, LocalSandbox]:
    """A CPU meter, then a `LocalSandbox` started under it (so its workers' CPU time is counted too)."""
    meter = CpuMeter()
    try:
        return meter, LocalSandbox(pool_size=pool_size)
    except BaseException:
        meter.close()
        raise


def _metered(meter: CpuMeter, measure: Callable[[], dict]) -> dict:
    before = meter.usage_ns()
    summary = measure()
    after = meter.usage_ns()
    if before is not None and after is not None and summary["n"]:
        summary["cpu_ms"] = (after - before) / 1e6 / summary["n"]
    return summary


def _median_summary(runs: list[dict]) -> dict:
    """Median of each figure over repeated measurements; counts are summed."""
    keys = ["per_s", "p50_ms", "p99_ms"] + (["cpu_ms"] if all("cpu_ms" in r for r in runs) else [])
    out = {k: statistics.median(r[k] for r in runs) for k in keys}
    out["n"] = sum(r["n"] for r in runs)
    out["errors"] = sum(r["errors"] for r in runs)
    return out


def closed_loop_threads(fn: Callable[[], bool], clients: int, seconds: float) -> dict:
    """`clients` threads calling `fn` (True = a right answer) back to back for `seconds`: rate, p50/p99
    latency, count and errors."""
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client() -> None:
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            ok = fn()
            dt = time.monotonic() - t0
            with lock:
                latencies.append(dt)
                errors[0] += 0 if ok else 1

    t0 = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return _summary(latencies, time.monotonic() - t0, errors[0])


async def closed_loop_async(fn: Callable, clients: int, seconds: float) -> dict:
    """`closed_loop_threads` with `clients` coroutines awaiting `fn()`."""
    latencies: list[float] = []
    errors = 0
    deadline = time.monotonic() + seconds

    async def client() -> None:
        nonlocal errors
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            ok = await fn()
            latencies.append(time.monotonic() - t0)
            errors += 0 if ok else 1

    t0 = time.monotonic()
    await asyncio.gather(*(client() for _ in range(clients)))
    return _summary(latencies, time.monotonic() - t0, errors)


def _subprocess_runner(argv_prefix: list[str], code: str, env: dict) -> Callable[[], bool]:
    def run() -> bool:
        proc = subprocess.run([*argv_prefix, code], capture_output=True, env=env, timeout=60)
        return proc.returncode == 0

    return run


def _job_subprocess_runner(job: Job, env: dict) -> Callable[[], bool]:
    """Run a sandbox Job's Python code and files in a fresh temp dir with `python -I` (no jail)."""
    import tempfile

    def run() -> bool:
        with tempfile.TemporaryDirectory() as tmp:
            for name, data in job.files.items():
                path = os.path.join(tmp, name)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as fh:
                    fh.write(data)
            proc = subprocess.run(
                [sys.executable, "-I", "-c", job.code], cwd=tmp, capture_output=True, env=env, timeout=60
            )
        return proc.returncode == 0 and b'"done": true' in proc.stdout

    return run


def _bwrap_prefix(binds: list) -> list[str] | None:
    iso = iso_mod.detect()
    if not iso.namespaces or not iso.bwrap:
        return None
    spec = iso_mod.JailSpec(
        iso_mod.python_install(), iso_mod.JAIL_UID_BASE + 63 if iso.uid_drop else None, binds, False, 16 << 20
    )
    argv = spec.bwrap_argv(iso.bwrap)
    if binds:
        argv += ["--setenv", "PYTHONPATH", f"{iso_mod.JAIL_ROOT}/site"]
    if iso.uid_drop:
        argv += iso_mod.setpriv_argv(iso_mod.JAIL_UID_BASE + 63)
    return [*argv, spec.python.jail_executable, "-I", "-c"]


def _service_rows(sb: LocalSandbox, opts: Any, limits: Limits, meter: CpuMeter) -> dict[str, dict]:
    """The trivial job at `opts.service_clients` concurrent clients: in process (the baseline), through
    one HTTP service over the same pool, and through a fleet of two services over it (both on
    127.0.0.1), interleaved over the repeats. A reply other than the job's right output is an error."""
    from posttrain.sandbox.fleet import SandboxFleet
    from posttrain.sandbox.remote import RemoteSandbox, make_server

    token = "bench"
    servers = [make_server(sb, "127.0.0.1", 0, token, max_concurrent=opts.service_clients) for _ in range(2)]
    threads = [threading.Thread(target=srv.serve_forever, daemon=True) for srv in servers]
    for thread in threads:
        thread.start()
    job = Job(code=TRIVIAL, limits=limits)
    want = b"45\n"

    def measure(make_client: Callable[[], Any] | None) -> dict:
        async def go() -> dict:
            client = make_client() if make_client is not None else sb

            async def one() -> bool:
                res = await client.run(job)
                return res.status == ExecStatus.OK and res.stdout == want

            try:
                return await closed_loop_async(one, opts.service_clients, opts.seconds)
            finally:
                if client is not sb:
                    await client.close()

        return asyncio.run(go())

    runners: dict[str, Callable[[], dict]] = {
        "pool": lambda: measure(None),
        "service": lambda: measure(lambda: RemoteSandbox(servers[0].url, token, timeout_s=60.0)),
        "fleet": lambda: measure(lambda: SandboxFleet([s.url for s in servers], token, timeout_s=60.0)),
    }
    samples: dict[str, list[dict]] = {r: [] for r in runners}
    try:
        for _ in range(opts.repeats):
            for runner, fn in runners.items():
                samples[runner].append(_metered(meter, fn))
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()
    return {runner: _median_summary(runs) for runner, runs in samples.items()}


def main(opts: Any) -> dict:
    """Run the benchmark with the options of `posttrain bench sandbox` (see its --help)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    meter, sb = metered_pool(opts.pool_size)
    pool_size = sb.settings.pool_size
    clients = opts.clients or 2 * pool_size
    limits = Limits(wall_time_s=10, cpu_time_s=10)
    scenarios = [("trivial", TRIVIAL, "default"), ("asserts", SOLUTION + "\n".join(TESTS), "default")]
    if not opts.skip_numpy:
        scenarios.append(("numpy", NUMPY, "numpy"))
    rows: dict[str, dict[str, dict]] = {}
    base_env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1"}
    try:
        sb.warm(*{p for _, _, p in scenarios})

        async def pool_measure(name: str, code: str, profile: str) -> dict:
            if name == "asserts":

                async def one() -> bool:
                    g = await grade_asserts(sb, SOLUTION, TESTS, limits)
                    return g.passed == len(TESTS)
            else:
                job = Job(code=code, limits=limits, profile=profile)

                async def one() -> bool:
                    return (await sb.run(job)).status == ExecStatus.OK

            for _ in range(2 * pool_size):  # warm every worker once
                await one()
            return await closed_loop_async(one, clients, opts.seconds)

        for name, code, profile in scenarios:
            console.print(f"[dim]measuring {name} ...[/]")
            binds = iso_mod.package_dirs(("numpy",)) if profile == "numpy" else []
            python = [sys.executable, "-c"] if profile == "numpy" else [sys.executable, "-I", "-c"]
            baseline = (
                _job_subprocess_runner(assert_job(SOLUTION, TESTS, limits)[0], base_env)
                if name == "asserts"
                else _subprocess_runner(python, code, base_env)
            )
            runners: dict[str, Callable[[], dict]] = {
                "pool": lambda name=name, code=code, profile=profile: asyncio.run(
                    pool_measure(name, code, profile)
                ),
                "subprocess": lambda baseline=baseline: closed_loop_threads(baseline, clients, opts.seconds),
            }
            prefix = _bwrap_prefix(binds)
            if prefix is not None:
                runners["bwrap"] = lambda code=code, prefix=prefix: closed_loop_threads(
                    _subprocess_runner(prefix, code, base_env), clients, opts.seconds
                )
            samples: dict[str, list[dict]] = {r: [] for r in runners}
            for _ in range(opts.repeats):  # interleaved, so load drift hits every runner alike
                for runner, measure in runners.items():
                    samples[runner].append(_metered(meter, measure))
            rows[name] = {runner: _median_summary(runs) for runner, runs in samples.items()}
        if opts.service_clients:
            console.print(f"[dim]measuring the HTTP service at {opts.service_clients} clients ...[/]")
            rows["service"] = _service_rows(sb, opts, limits, meter)
    finally:
        sb.close_blocking()
        meter.close()

    table = Table(
        title=f"sandbox: executions/s (median of {opts.repeats}), closed loop, {clients} clients, "
        f"pool {pool_size}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    )
    for col in ("scenario", "runner", "exec/s", "p50 ms", "p99 ms", "CPU ms/exec", "n", "errors"):
        table.add_column(col)
    for name, runners in rows.items():
        for runner, s in runners.items():
            cpu = f"{s['cpu_ms']:.2f}" if "cpu_ms" in s else "n/a"
            table.add_row(
                name,
                runner,
                f"{s['per_s']:.1f}",
                f"{s['p50_ms']:.1f}",
                f"{s['p99_ms']:.1f}",
                cpu,
                str(s["n"]),
                str(s["errors"]),
            )
    console.print(table)
    console.print(f"isolation layers active: {', '.join(sb.layers)}", highlight=False)

    out: dict = {
        "isolation": sb.layers,
        "pool_size": pool_size,
        "clients": clients,
        "seconds": opts.seconds,
        "repeats": opts.repeats,
        "load_avg_1m": os.getloadavg()[0],
        "cpu_count": os.cpu_count(),
        "bwrap_available": shutil.which("bwrap") is not None,
        "sandbox_errors": sb.stats.get("sandbox_errors", 0),
    }
    service = rows.pop("service", None)
    if service is not None:
        out["service_clients"] = opts.service_clients
        for runner, figures in service.items():
            key = "service_pool" if runner == "pool" else runner
            out[f"{key}_per_s"] = figures["per_s"]
            out[f"{key}_p50_ms"] = figures["p50_ms"]
            out[f"{key}_p99_ms"] = figures["p99_ms"]
            out[f"{key}_errors"] = figures["errors"]
        for runner in ("service", "fleet"):
            pool_rate = service["pool"]["per_s"]
            out[f"{runner}_ratio_vs_pool"] = service[runner]["per_s"] / pool_rate if pool_rate else None
    for name, runners in rows.items():
        prefix = "" if name == "trivial" else f"{name}_"
        pool = runners["pool"]
        out[f"{name}_per_s"] = pool["per_s"]
        out[f"{name}_p50_ms"] = pool["p50_ms"]
        out[f"{name}_p99_ms"] = pool["p99_ms"]
        for base in ("subprocess", "bwrap"):
            if base in runners:
                out[f"{prefix}{base}_per_s"] = runners[base]["per_s"]
                out[f"{prefix}{base}_p99_ms"] = runners[base]["p99_ms"]
                out[f"{prefix}ratio_vs_{base}"] = (
                    pool["per_s"] / runners[base]["per_s"] if runners[base]["per_s"] else None
                )
        out[f"{name}_errors"] = pool["errors"] + sum(r["errors"] for r in runners.values() if r is not pool)
        for runner, figures in runners.items():
            if "cpu_ms" in figures:
                key = f"{name}_cpu_ms_per_exec" if runner == "pool" else f"{prefix}{runner}_cpu_ms_per_exec"
                out[key] = figures["cpu_ms"]
        if "cpu_ms" in pool and pool["cpu_ms"] > 0:
            # what the machine's CPUs would sustain if nothing else ran on them
            out[f"{name}_capacity_per_s"] = (os.cpu_count() or 1) * 1000.0 / pool["cpu_ms"]
    out["trivial_p50_ms"] = rows["trivial"]["pool"]["p50_ms"]
    return out
