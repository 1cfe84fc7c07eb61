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


def test_numpy_profile_sees_numpy_and_default_does_not(sandbox):
    res = sandbox.run_blocking(
        Job(code="import numpy as np\nprint(int(np.arange(5).sum()))", profile="numpy")
    )
    assert (res.status, res.stdout) == (ExecStatus.OK, b"10\n")
    res = sandbox.run_blocking(Job(code="import numpy"))
    assert (
        res.status == ExecStatus.RUNTIME_ERROR
        and b"ModuleNotFoundError: No module named 'numpy'" in res.stderr
    )


def test_bad_jobs_are_refused_with_a_named_field(sandbox):
    import pytest

    with pytest.raises(ValueError, match="unknown language 'cobol'"):
        sandbox.submit(Job(code="", language="cobol"))
    with pytest.raises(ValueError, match="Limits.wall_time_s must be a positive number"):
        sandbox.submit(Job(code="", limits=Limits(wall_time_s=0)))
    with pytest.raises(ValueError, match="must be a relative path"):
        sandbox.submit(Job(code="", files={"../x": b""}))
    with pytest.raises(ValueError, match="unknown sandbox profile 'gpu'"):
        sandbox.submit(Job(code="", profile="gpu"))
    with pytest.raises(ValueError, match="allow_network is false"):
        sandbox.submit(Job(code="", limits=Limits(network=True)))


def test_files_in_and_out_and_argv_and_stdin(sandbox):
    code = "import sys\nprint(open('data/in.txt').read(), sys.argv[1:], sys.stdin.read())\nopen('out.bin', 'wb').write(b'\\x00\\x01')"
    res = sandbox.run_blocking(
        Job(code=code, files={"data/in.txt": b"payload"}, argv=["-v", "x"], stdin=b"from stdin")
    )
    assert res.stdout == b"payload ['-v', 'x'] from stdin\n"
    assert res.files == {"out.bin": b"\x00\x01"}  # inputs and the source are not returned


def test_many_concurrent_asyncio_tasks(sandbox):
    import asyncio

    async def episode(i):
        await asyncio.sleep(0)
        return (await sandbox.run(Job(code=f"print({i} * 3)"))).stdout

    async def go():
        return await asyncio.gather(*(episode(i) for i in range(64)))

    assert asyncio.run(go()) == [f"{i * 3}\n".encode() for i in range(64)]


def test_worker_killed_from_outside_is_an_infra_failure_then_replaced():
    import contextlib
    import os
    import signal
    import time
    from pathlib import Path

    from posttrain.sandbox import LocalSandbox
    from posttrain.sandbox.isolation import sandbox_cgroup_dirs

    with LocalSandbox(pool_size=1) as sb:
        assert sb.run_blocking(Job(code="pass")).status == ExecStatus.OK  # the worker is up
        procs = [
            str(d / "cgroup.procs")
            for d in sandbox_cgroup_dirs(sb.isolation.cgroups, sb.instance)
            if d.name.startswith(f"i{sb.instance}-default-")
        ][-1:]  # v1: the pids group
        assert procs, "cgroups are needed to find the worker's processes"

        def pids() -> set[str]:
            return set(Path(procs[0]).read_text().split())

        idle = pids()
        fut = sb.submit(Job(code="import time\ntime.sleep(5)\nprint('done')"))
        deadline = time.monotonic() + 20  # the job has started once a new process joins the worker's cgroup
        while not pids() - idle and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pids() - idle, "the job never started"
        # kill the worker, not the job: a job killed first can be reported as KILLED by a worker still alive
        for pid in idle & pids():
            with contextlib.suppress(
                ProcessLookupError
            ):  # a process that exits between the read and the kill
                os.kill(int(pid), signal.SIGKILL)
        res = fut.result(timeout=30)
        assert (
            res.status == ExecStatus.SANDBOX_ERROR and res.is_infra_failure and "worker exited" in res.error
        ), res
        assert sb.stats["sandbox_errors"] == 1
        assert sb.run_blocking(Job(code="print('next')")).stdout == b"next\n"


def test_network_pool_when_allowed():
    import socket

    from posttrain.sandbox import LocalSandbox

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=5)\ns.sendall(b'hi')\nprint('sent')"
    try:
        with LocalSandbox(pool_size=1, allow_network=True) as sb:
            res = sb.run_blocking(Job(code=code, limits=Limits(network=True)))
            conn, _ = listener.accept()
            assert res.stdout == b"sent\n" and conn.recv(2) == b"hi"
            conn.close()
            names = sb.run_blocking(
                Job(
                    code="import socket\nprint(socket.getaddrinfo('localhost', 80)[0][4][0])",
                    limits=Limits(network=True),
                )
            )
            assert names.stdout in (b"127.0.0.1\n", b"::1\n")  # /etc/hosts is visible to network jobs
            blocked = sb.run_blocking(Job(code=code))  # same sandbox, network not asked: no network
            assert blocked.status == ExecStatus.RUNTIME_ERROR and b"PermissionError" in blocked.stderr
    finally:
        listener.close()


def test_a_hung_worker_hits_the_backstop(monkeypatch):
    import json
    import sys

    import pytest

    from posttrain.sandbox import pool

    ready = json.dumps({"ready": True, "blobs": []}).encode()
    fake = (
        "import os, struct, time, sys\n"
        f"os.write(1, struct.pack('!II', {len(ready)}, 0) + {ready!r})\n"
        "time.sleep(60)\n"
    )
    monkeypatch.setattr(pool, "BACKSTOP_GRACE_S", 0.3)
    worker = pool._WorkerProc([sys.executable, "-c", fake], None, None)
    try:
        with pytest.raises(pool.WorkerError, match="no reply before the backstop timeout"):
            worker.execute(Job(code="print(1)", limits=Limits(wall_time_s=0.2)))
    finally:
        worker.kill()
    assert worker.proc.returncode == -9


def test_overrides_are_validated_like_the_config():
    import pydantic
    import pytest

    from posttrain.sandbox import LocalSandbox

    with pytest.raises(pydantic.ValidationError, match="pool_sise"):
        LocalSandbox(pool_sise=2)
    with pytest.raises(pydantic.ValidationError, match="recycle_after"):
        LocalSandbox(recycle_after=0)


def test_works_when_the_caller_holds_more_than_1024_fds():
    import os
    import resource

    from posttrain.sandbox import LocalSandbox

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        import pytest

        pytest.skip("cannot open 1100 descriptors here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
    try:
        with LocalSandbox(pool_size=1) as sb:  # its pipes get descriptor numbers above 1024
            assert sb.run_blocking(Job(code="print('many fds')")).stdout == b"many fds\n"
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
