"""The test jobs environments send into the sandbox, and the reading of what comes back.

A harness job is the sandbox's trusted runner (`posttrain.sandbox.grading.runner_job`): the tests run
in the runner, the untrusted code in a separate subject process that only answers calls with plain
values, and the verdict is one nonce-tagged line the subject cannot write, taken only from a job that
ended OK with exit status 0. Test kinds: `call_tests` (the runner returns `fn(*args)` and expected
values never enter the sandbox: the environment compares outside), `{"kind": "code"}` snippets run
against bound solution names (HumanEval's `check`), and `module_tests` (test functions of trusted
test modules that import the solution's package through proxies). Owns no grading policy beyond
pass/fail per test.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.sandbox.api import ExecResult, ExecStatus, Job, Limits
from posttrain.sandbox.grading import read_runner_result, runner_job


@dataclass
class HarnessJob:
    job: Job
    nonce: str
    n_tests: int


@dataclass
class HarnessReport:
    """Per-test outcomes, or `infra_failure` when the sandbox itself failed."""

    results: list[dict[str, Any]] = field(default_factory=list)
    infra_failure: bool = False
    error: str = ""
    status: str = ""

    @property
    def total(self) -> int:
        return len(self.results)


def call_tests(fn: str, args_list: list[list[Any]]) -> list[dict[str, Any]]:
    return [{"kind": "call", "fn": fn, "args": list(args)} for args in args_list]


def module_tests(test_ids: list[str]) -> list[dict[str, Any]]:
    """'tests/test_x.py::test_y' -> a test that imports trusted module `tests.test_x` and calls test_y."""
    out = []
    for test_id in test_ids:
        path, name = test_id.split("::")
        out.append({"kind": "module", "module": path[:-3].replace("/", "."), "fn": name})
    return out


def module_name(path: str) -> str | None:
    """Dotted module name of a repository .py path ('tests/__init__.py' -> 'tests'), else None."""
    if not path.endswith(".py"):
        return None
    parts = path[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) if parts and all(p.isidentifier() for p in parts) else None


def build_job(
    tests: list[dict[str, Any]],
    *,
    program: str | None = None,
    program_name: str = "submission.py",
    bind: list[str] | str = (),
    prelude: str | None = None,
    modules: dict[str, str] | None = None,
    proxy_packages: tuple[str, ...] = (),
    files: dict[str, bytes] | None = None,
    subject_path: tuple[str, ...] = (),
    per_test_timeout_s: float = 2.0,
    max_timeouts: int = 2,
) -> HarnessJob:
    """One runner job for `tests` (see `posttrain.sandbox.grading.runner_job` for the spec's fields)."""
    if not tests:
        raise ValueError("a harness job needs at least one test")
    spec = {
        "tests": tests,
        "program": program,
        "program_name": program_name,
        "bind": bind if isinstance(bind, str) else list(bind),
        "prelude": prelude,
        "modules": modules or {},
        "proxy_packages": list(proxy_packages),
        "subject_path": list(subject_path),
        "timeout_s": per_test_timeout_s,
        "max_timeouts": max_timeouts,
    }
    n = len(tests)
    # interpreter starts (one per subject, restarted after a crash) plus the tests' own budget
    wall = min(90.0, 3.0 + per_test_timeout_s * min(n, max_timeouts + 2) * 1.5 + 0.08 * n)
    limits = Limits(wall_time_s=wall, cpu_time_s=wall, max_output_bytes=1 << 20)
    job, nonce = runner_job(spec, files, limits)
    return HarnessJob(job, nonce, n)


def parse_result(result: ExecResult, hjob: HarnessJob) -> HarnessReport:
    """A sandbox failure is infra; a job without the runner's one complete, nonce-tagged result line
    (killed, timed out, out of memory, non-zero exit) means every test failed."""
    if result.status == ExecStatus.SANDBOX_ERROR:
        return HarnessReport(
            infra_failure=True, error=result.error or "sandbox error", status=str(result.status)
        )
    results, why = read_runner_result(result, hjob.nonce, hjob.n_tests)
    if results is None:
        tail = result.stderr_text[-500:]
        failed = {"ok": False, "error": why + (": " + tail if tail else "")}
        return HarnessReport(results=[dict(failed) for _ in range(hjob.n_tests)], status=str(result.status))
    return HarnessReport(results=results, status=str(result.status))


def run_locally(hjob: HarnessJob, timeout_s: float = 60.0) -> ExecResult:
    """Run a harness job in a local subprocess: for OUR generated code only (generation-time checks)."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in hjob.job.files.items():
            p = Path(tmp, name)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-I", "-c", hjob.job.code], cwd=tmp, capture_output=True, timeout=timeout_s
        )
    status = ExecStatus.OK if proc.returncode == 0 else ExecStatus.RUNTIME_ERROR
    return ExecResult(
        status=status,
        exit_code=proc.returncode,
        stdout=proc.stdout,
        stderr=proc.stderr,
        wall_ms=(time.monotonic() - t0) * 1000,
    )


def json_equal(value: Any, expected: Any) -> bool:
    """Equality after the JSON round trip the harness applies (tuples -> lists, dict keys -> str)."""
    try:
        return value == json.loads(json.dumps(expected))
    except (TypeError, ValueError):
        return False
