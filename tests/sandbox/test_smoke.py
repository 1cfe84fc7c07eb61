"""Smoke facts about LocalSandbox: languages, statuses, no torch import."""

import subprocess
import sys

from posttrain.sandbox import ExecStatus, Job, Limits


def test_sandbox_never_imports_torch():
    code = "import sys, posttrain.sandbox, posttrain.sandbox.grading; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_python_job_prints_and_exits_zero(sandbox):
    res = sandbox.run_blocking(Job(code="print(6 * 7)"))
    assert res.status == ExecStatus.OK and res.stdout == b"42\n" and res.exit_code == 0


def test_traceback_quotes_the_job_source(sandbox):
    res = sandbox.run_blocking(Job(code="x = 1\nraise ValueError('boom')\n"))
    assert res.status == ExecStatus.RUNTIME_ERROR and res.exit_code == 1
    assert b"raise ValueError('boom')" in res.stderr and b"worker.py" not in res.stderr


def test_bash_and_c_and_compile_error(sandbox):
    assert sandbox.run_blocking(Job(code="echo $((6*7))", language="bash")).stdout == b"42\n"
    c = Job(code='#include <stdio.h>\nint main(){printf("%d\\n", 6*7);return 3;}', language="c")
    res = sandbox.run_blocking(c)
    assert (res.status, res.exit_code, res.stdout) == (ExecStatus.RUNTIME_ERROR, 3, b"42\n")
    bad = sandbox.run_blocking(Job(code="int main(){ retur 0; }", language="c"))
    assert bad.status == ExecStatus.COMPILE_ERROR and b"retur" in bad.stderr


def test_infinite_loop_times_out(sandbox):
    res = sandbox.run_blocking(Job(code="while True: pass", limits=Limits(wall_time_s=0.5, cpu_time_s=5)))
    assert res.status == ExecStatus.TIMEOUT and 450 <= res.wall_ms < 2000
