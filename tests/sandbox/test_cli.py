"""`posttrain sandbox run|doctor|serve` as a user runs them (real subprocesses)."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from posttrain.sandbox import Job
from posttrain.sandbox.remote import RemoteSandbox

CLI = [sys.executable, "-m", "posttrain"]


def cli(*args, **kw):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, **kw)


def test_run_python_file_prints_output_and_its_exit_code_fails_the_command(tmp_path):
    (tmp_path / "hello.py").write_text("import sys\nprint('hello', input())\nsys.exit(3)\n")
    (tmp_path / "in.txt").write_text("world\n")
    out = cli("sandbox", "run", str(tmp_path / "hello.py"), "--stdin", str(tmp_path / "in.txt"))
    assert (
        out.returncode == 1 and out.stdout == "hello world\n" and "status=runtime_error exit=3" in out.stderr
    )


def test_run_bash_with_language_flag(tmp_path):
    (tmp_path / "script.txt").write_text("echo $((40 + 2))\n")
    out = cli("sandbox", "run", str(tmp_path / "script.txt"), "--language", "bash", "--json")
    assert out.returncode == 0 and json.loads(out.stdout.splitlines()[-1])["status"] == "ok"


def test_run_unknown_extension_is_a_usage_error(tmp_path):
    (tmp_path / "x.txt").write_text("print(1)")
    out = cli("sandbox", "run", str(tmp_path / "x.txt"))
    assert out.returncode == 2 and "cannot tell the language of 'x.txt'" in out.stderr


def test_doctor_json_reports_layers():
    out = cli("sandbox", "doctor", "--json")
    report = json.loads(out.stdout.splitlines()[-1])
    assert out.returncode == 0 and report["isolated"] is True
    assert {"rlimits", "seccomp", "clean-env"} <= set(report["layers"])
    assert report["probe"]["job_status"] == "ok" and report["probe"]["worker"]["seccomp"] == "on"
    # which cgroup version backs the memory/pids caps, the same one the library detects here
    from posttrain.sandbox.isolation import detect

    assert report["cgroups"] == detect().cgroups
    if report["cgroups"]:
        assert report["cgroups_detail"].startswith(report["cgroups"] + " ")
        assert f"cgroups-{report['cgroups']}(memory,pids)" in report["layers"]
    table = cli("sandbox", "doctor")
    assert f"cgroups {report['cgroups'] or 'v1/v2'} (memory, pids)" in table.stdout


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what a non-interactive shell does to a background job


@pytest.mark.parametrize("stop_with", [signal.SIGINT, signal.SIGTERM])
def test_serve_answers_the_client_and_rejects_a_wrong_token(stop_with):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # started with SIGINT ignored, as under `cmd &` in a script: the service must still stop on SIGINT and SIGTERM
    proc = subprocess.Popen(
        [*CLI, "sandbox", "serve", "--port", str(port), "--token", "tok", "--pool-size", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_ignore_sigint,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(url + "/health", headers={"Authorization": "Bearer tok"}).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        res = asyncio.run(RemoteSandbox(url, "tok").run(Job(code="print(7 * 6)")))
        assert res.stdout == b"42\n"
        assert httpx.get(url + "/health", headers={"Authorization": "Bearer nope"}).status_code == 401
    finally:
        os.killpg(proc.pid, stop_with)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # do not leave a server behind when failing
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            proc.stdout.close()
            proc.stderr.close()
    assert code == 0  # a clean exit: workers stopped, socket closed
