"""The test harness environments send into the sandbox, and the parsing of what it prints back.

Each test runs in its own forked child (the untrusted code never runs in the harness process), with a
per-test timeout. In "call" mode the child only returns the JSON of `fn(*args)`; expected values never
enter the sandbox, so a solution cannot forge a pass by printing fake results - the environment compares
outside. In "exec" mode (repository tests, HumanEval's `check`) a test passes when its snippet returns
and the child reports it through a private pipe. Owns no grading policy beyond pass/fail per test.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from posttrain.sandbox.api import ExecResult, ExecStatus, Job, Limits

RESULT_MARKER = "@@POSTTRAIN_HARNESS_RESULTS@@"

# Runs inside the sandbox. Reads harness_spec.json from the working directory.
HARNESS_SOURCE = r'''
import json, os, select, signal, sys, time, traceback

MARK = "@@POSTTRAIN_HARNESS_RESULTS@@"
CAP = 4000

def _child(spec, test, wfd):
    os.setpgid(0, 0)
    try:
        os.close(0)
    except OSError:
        pass
    out = {"ok": False}
    try:
        sys.path[:0] = spec.get("sys_path", [])
        ns = {"__name__": "__main__"}
        if spec.get("setup"):
            exec(compile(spec["setup"], spec.get("setup_name", "submission.py"), "exec"), ns)
        if spec["mode"] == "call":
            fn = ns.get(test["fn"])
            if not callable(fn):
                raise NameError("function %r is not defined" % test["fn"])
            value = fn(*test["args"])
            out = {"ok": True, "value": json.loads(json.dumps(value, default=repr))}
        else:
            exec(compile(test["code"], "<test>", "exec"), ns)
            out = {"ok": True}
    except BaseException:
        tb = traceback.format_exc().replace(os.getcwd() + os.sep, "")
        out = {"ok": False, "error": tb[-CAP:]}
    try:
        data = json.dumps(out, default=repr).encode()
    except Exception:
        data = json.dumps({"ok": False, "error": "result is not serialisable"}).encode()
    os.write(wfd, data[: 1 << 20])
    os._exit(0)

def _run_one(spec, test, timeout_s):
    r, w = os.pipe()
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            _child(spec, test, w)
        finally:
            os._exit(1)
    os.close(w)
    chunks, size, status = [], 0, None
    deadline = time.monotonic() + timeout_s
    open_pipe = True
    while True:
        if open_pipe:
            ready, _, _ = select.select([r], [], [], 0.005)
            if ready:
                b = os.read(r, 65536)
                if not b:
                    open_pipe = False
                elif size < (1 << 20):
                    chunks.append(b); size += len(b)
        done_pid, st = os.waitpid(pid, os.WNOHANG)
        if done_pid:
            status = st
            break
        if time.monotonic() > deadline:
            for sig_target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
                try:
                    sig_target()
                except OSError:
                    pass
            os.waitpid(pid, 0)
            os.close(r)
            return {"ok": False, "error": "timeout after %.1fs" % timeout_s, "timeout": True}
        if not open_pipe:
            time.sleep(0.002)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    while open_pipe:
        b = os.read(r, 65536)
        if not b:
            break
        if size < (1 << 20):
            chunks.append(b); size += len(b)
    os.close(r)
    try:
        res = json.loads(b"".join(chunks).decode("utf-8", "replace"))
        if not isinstance(res, dict):
            raise ValueError
    except Exception:
        code = os.waitstatus_to_exitcode(status) if status is not None else None
        return {"ok": False, "error": "test process ended without a result (exit %s)" % code}
    if os.waitstatus_to_exitcode(status) != 0:
        res["ok"] = False
        res.setdefault("error", "test process exited with %s" % os.waitstatus_to_exitcode(status))
    return res

def main():
    with open("harness_spec.json") as f:
        spec = json.load(f)
    results, timeouts = [], 0
    for t in spec["tests"]:
        if timeouts >= int(spec.get("max_timeouts", 2)):
            results.append({"ok": False, "error": "skipped after %d timeouts" % timeouts, "timeout": True})
            continue
        res = _run_one(spec, t, float(spec.get("timeout_s", 2.0)))
        timeouts += bool(res.get("timeout"))
        results.append(res)
    sys.stdout.write("\n" + MARK + json.dumps(results) + "\n")
    sys.stdout.flush()

main()
'''


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


def build_job(
    mode: str,
    tests: list[dict[str, Any]],
    setup: str | None = None,
    files: dict[str, bytes] | None = None,
    sys_path: list[str] | None = None,
    per_test_timeout_s: float = 2.0,
    setup_name: str = "submission.py",
    max_timeouts: int = 2,
) -> Job:
    if mode not in ("call", "exec"):
        raise ValueError(f"harness mode must be 'call' or 'exec', got {mode!r}")
    spec = {"mode": mode, "tests": tests, "setup": setup, "sys_path": sys_path or [],
            "timeout_s": per_test_timeout_s, "setup_name": setup_name,
            "max_timeouts": max_timeouts}
    all_files = dict(files or {})
    all_files["harness_spec.json"] = json.dumps(spec).encode()
    wall = min(60.0, 2.0 + per_test_timeout_s * min(max(1, len(tests)), max_timeouts + 2) * 1.5 + 0.05 * len(tests))
    limits = Limits(wall_time_s=wall, cpu_time_s=wall, max_output_bytes=1 << 20)
    return Job(code=HARNESS_SOURCE, files=all_files, limits=limits)


def parse_result(result: ExecResult, n_tests: int) -> HarnessReport:
    """Read the harness's last result line. A sandbox failure is infra; anything else that lacks a
    well-formed result line (killed, timed out, memory) means every test failed."""
    if result.status == ExecStatus.SANDBOX_ERROR:
        return HarnessReport(infra_failure=True, error=result.error or "sandbox error", status=str(result.status))
    text = result.stdout_text
    idx = text.rfind(RESULT_MARKER)
    results: Any = None
    if idx >= 0:
        line = text[idx + len(RESULT_MARKER):].split("\n", 1)[0]
        try:
            results = json.loads(line)
        except json.JSONDecodeError:
            results = None
    if not isinstance(results, list) or len(results) != n_tests or not all(isinstance(r, dict) for r in results):
        why = f"harness produced no results (status {result.status}, exit {result.exit_code})"
        tail = result.stderr_text[-500:]
        return HarnessReport(results=[{"ok": False, "error": why + (": " + tail if tail else "")}] * n_tests,
                             status=str(result.status))
    return HarnessReport(results=results, status=str(result.status))


def json_equal(value: Any, expected: Any) -> bool:
    """Equality after the JSON round trip the harness applies (tuples -> lists, dict keys -> str)."""
    try:
        return value == json.loads(json.dumps(expected))
    except (TypeError, ValueError):
        return False
