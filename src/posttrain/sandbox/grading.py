"""Graders: run a solution against assert-style tests or stdin/stdout cases, with per-test results.

`grade_asserts(sandbox, solution_code, tests, limits=None)` runs ALL tests of one solution in ONE
Python job: a harness exec's the solution, then each test string in try/except, and writes one result
line per test as `<nonce> <index> <0|1>` to a private dup of stdout. The nonce is random per call
and never printed, so solution code that prints fake result lines, calls sys.exit/os._exit, closes
stdout or crashes cannot gain credit: a test counts only if its nonce line says 1. (Code that digs the
nonce out of the harness's stack frames, or overrides `__eq__` to fool `assert`, is out of reach of
any in-process harness.) `grade_io(sandbox, code, cases, ...)` runs one job per (stdin, expected) case
(any language) and compares output ignoring trailing whitespace, with optional float tolerance.

`GradeResult(passed, total, fraction, per_test, status, infra_failure, detail)`: when
`infra_failure` is True the sandbox failed and the sample must be excluded, never scored 0.
It does not decide rewards; environments turn a GradeResult into a reward.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

from posttrain.sandbox.api import ExecResult, ExecStatus, Job, Limits, Sandbox

GRADING_FILE = "__grading__.json"

# Runs inside the job. Reads and deletes its input file, keeps the nonce in a local only.
_HARNESS = r'''
def __posttrain_grade():
    import json, os, sys
    with open("__grading__.json") as fh:
        spec = json.load(fh)
    os.unlink("__grading__.json")
    nonce, tests, solution = spec["nonce"], spec["tests"], spec["solution"]
    out = os.dup(1)
    timeout = spec.get("per_test_timeout_s") or 0

    def emit(text):
        try:
            os.write(out, ("\n" + nonce + " " + text + "\n").encode())
        except OSError:
            pass

    def alarm(*_):
        raise TimeoutError("test timed out")

    import signal
    glob = {"__name__": "__solution__", "__builtins__": __builtins__}
    try:
        exec(compile(solution, "solution.py", "exec"), glob)
    except BaseException as exc:
        emit("load " + type(exc).__name__)
        sys.stderr.write("solution failed to load: %s: %s\n" % (type(exc).__name__, exc))
        return
    for i, test in enumerate(tests):
        ok = False
        try:
            if timeout:
                signal.signal(signal.SIGALRM, alarm)
                signal.setitimer(signal.ITIMER_REAL, timeout)
            exec(compile(test, "test_%d" % i, "exec"), glob)
            ok = True
        except BaseException as exc:
            sys.stderr.write("test %d failed: %s: %s\n" % (i, type(exc).__name__, str(exc)[:200]))
        finally:
            if timeout:
                signal.setitimer(signal.ITIMER_REAL, 0)
        emit("%d %d" % (i, 1 if ok else 0))
    emit("done")


__posttrain_grade()
'''


@dataclass
class GradeResult:
    passed: int
    total: int
    fraction: float
    per_test: list[bool]
    status: ExecStatus
    infra_failure: bool
    detail: str = ""
    results: list[ExecResult] = field(default_factory=list, repr=False)


def _infra(total: int, results: list[ExecResult], detail: str) -> GradeResult:
    status = ExecStatus.SANDBOX_ERROR
    return GradeResult(0, total, 0.0, [False] * total, status, True, detail, results)


def assert_job(solution_code: str, tests: Sequence[str], limits: Limits | None = None, profile: str = "default",
               per_test_timeout_s: float | None = None) -> tuple[Job, str]:
    """The single job that grades `solution_code` against `tests`, and its nonce."""
    nonce = secrets.token_hex(16)
    spec = {"nonce": nonce, "tests": list(tests), "solution": solution_code,
            "per_test_timeout_s": per_test_timeout_s}
    job = Job(code=_HARNESS, language="python", files={GRADING_FILE: json.dumps(spec).encode()},
              limits=limits or Limits(), profile=profile)
    return job, nonce


def parse_assert_result(res: ExecResult, nonce: str, total: int) -> GradeResult:
    """Per-test outcomes from the harness lines that carry `nonce` (first line per index wins)."""
    if res.status == ExecStatus.SANDBOX_ERROR:
        return _infra(total, [res], res.error or "sandbox error")
    per_test: list[bool | None] = [None] * total
    load_error = ""
    for line in res.stdout.decode("utf-8", errors="replace").splitlines():
        parts = line.split()
        if len(parts) < 2 or parts[0] != nonce:
            continue
        if parts[1] == "load":
            load_error = parts[2] if len(parts) > 2 else "error"
        elif len(parts) == 3 and parts[1].isdigit() and parts[2] in ("0", "1"):
            i = int(parts[1])
            if i < total and per_test[i] is None:
                per_test[i] = parts[2] == "1"
    flags = [bool(v) for v in per_test]
    passed = sum(flags)
    if load_error:
        detail = f"solution failed to load ({load_error})"
    elif res.status != ExecStatus.OK:
        detail = f"job ended with {res.status.value}; {total - sum(v is not None for v in per_test)} tests never ran"
    else:
        detail = res.stderr_text[-500:].strip()
    return GradeResult(passed, total, passed / total if total else 0.0, flags, res.status, False, detail, [res])


async def grade_asserts(sandbox: Sandbox, solution_code: str, tests: Sequence[str], limits: Limits | None = None,
                        profile: str = "default", per_test_timeout_s: float | None = None) -> GradeResult:
    """Run every test string (e.g. `assert f(2) == 4`) against the solution in one job."""
    if not tests:
        raise ValueError("grade_asserts needs at least one test")
    job, nonce = assert_job(solution_code, tests, limits, profile, per_test_timeout_s)
    res = await sandbox.run(job)
    return parse_assert_result(res, nonce, len(tests))


def outputs_match(actual: str, expected: str, float_tol: float | None = None) -> bool:
    """Equal up to trailing whitespace per line and trailing blank lines; numbers within `float_tol`
    (absolute or relative) when given."""
    a_lines = [line.rstrip() for line in actual.rstrip().splitlines()]
    e_lines = [line.rstrip() for line in expected.rstrip().splitlines()]
    if a_lines == e_lines:
        return True
    if float_tol is None or len(a_lines) != len(e_lines):
        return False
    for a_line, e_line in zip(a_lines, e_lines, strict=True):
        a_tok, e_tok = a_line.split(), e_line.split()
        if len(a_tok) != len(e_tok):
            return False
        for a, e in zip(a_tok, e_tok, strict=True):
            if a == e:
                continue
            try:
                fa, fe = float(a), float(e)
            except ValueError:
                return False
            if math.isnan(fa) or math.isnan(fe) or not math.isclose(fa, fe, rel_tol=float_tol, abs_tol=float_tol):
                return False
    return True


async def grade_io(sandbox: Sandbox, code: str, cases: Sequence[tuple[str | bytes, str]], language: str = "python",
                   limits: Limits | None = None, float_tol: float | None = None,
                   profile: str = "default") -> GradeResult:
    """One job per (stdin, expected_stdout) case; a case passes when the job is OK and output matches."""
    if not cases:
        raise ValueError("grade_io needs at least one case")
    jobs = [Job(code=code, language=language, stdin=stdin.encode() if isinstance(stdin, str) else stdin,
                limits=limits or Limits(), profile=profile) for stdin, _ in cases]
    results = await sandbox.run_batch(jobs)
    total = len(cases)
    infra = [r for r in results if r.status == ExecStatus.SANDBOX_ERROR]
    if infra:
        return _infra(total, results, infra[0].error or "sandbox error")
    if any(r.status == ExecStatus.COMPILE_ERROR for r in results):
        return GradeResult(0, total, 0.0, [False] * total, ExecStatus.COMPILE_ERROR, False,
                           results[0].stderr_text[-500:], results)
    per_test = [r.status == ExecStatus.OK and outputs_match(r.stdout_text, expected, float_tol)
                for r, (_, expected) in zip(results, cases, strict=True)]
    worst = next((r.status for r in results if r.status != ExecStatus.OK), ExecStatus.OK)
    failing = [i for i, ok in enumerate(per_test) if not ok]
    detail = f"failed cases: {failing[:10]}" if failing else ""
    passed = sum(per_test)
    return GradeResult(passed, total, passed / total, per_test, worst, False, detail, results)
