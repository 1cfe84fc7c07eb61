"""`SandboxFleet`: several services behind one client, on 127.0.0.1 with random ports; a service killed
mid-batch (SIGKILL of a real `posttrain sandbox serve`) loses no job to a score."""

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from posttrain.sandbox import ExecResult, ExecStatus, Job, make_sandbox
from posttrain.sandbox.fleet import SandboxFleet, parse_urls
from posttrain.sandbox.remote import RemoteSandboxError

from .test_remote import TOKEN, serving


class RecordingSandbox:
    """Runs each job as a short sleep and records which jobs it ran (its `code`)."""

    def __init__(self, job_s: float = 0.05) -> None:
        self.job_s = job_s
        self.executor = concurrent.futures.ThreadPoolExecutor(8)
        self.ran: list[str] = []
        self.lock = threading.Lock()

    def submit(self, job):
        def go():
            time.sleep(self.job_s)
            with self.lock:
                self.ran.append(job.code)
            return ExecResult(status=ExecStatus.OK, stdout=job.code.encode())

        return self.executor.submit(go)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_parse_urls_names_the_bad_entry():
    assert parse_urls(" http://a:1/, http://b:2 ") == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError, match="'ftp://a:1' is not http"):
        parse_urls("http://b:2,ftp://a:1")
    with pytest.raises(ValueError, match="listed twice: http://a:1"):
        parse_urls(["http://a:1", "http://a:1/"])
    with pytest.raises(ValueError, match="no sandbox service URL"):
        parse_urls(" , ")


def test_make_sandbox_builds_a_fleet_from_comma_separated_urls():
    from posttrain.config import SandboxConfig

    fleet = make_sandbox(SandboxConfig(mode="remote", url="http://a:1,http://b:2", token="t"))
    assert isinstance(fleet.inner, SandboxFleet) and [n.name for n in fleet.inner.nodes] == [
        "http://a:1",
        "http://b:2",
    ]
    with pytest.raises(ValueError, match="sandbox.url: sandbox service URL 'a:1' is not http"):
        make_sandbox(SandboxConfig(mode="remote", url="http://b:2,a:1"))


def test_a_batch_is_spread_evenly_and_results_keep_their_order():
    a, b = RecordingSandbox(), RecordingSandbox()
    with serving(a) as sa, serving(b) as sb:

        async def go():
            async with SandboxFleet([sa.url, sb.url], TOKEN) as fleet:
                return await fleet.run_batch([Job(code=f"j{i}") for i in range(10)]), fleet.stats

        results, stats = asyncio.run(go())
    assert [r.stdout for r in results] == [f"j{i}".encode() for i in range(10)]
    assert len(a.ran) == len(b.ran) == 5 and set(a.ran).isdisjoint(b.ran)
    assert stats == {"jobs": 10, "retried": 0, "sandbox_errors": 0, "node_failures": 0}


def test_every_service_down_is_an_infra_failure_naming_each():
    urls = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]

    async def go():
        async with SandboxFleet(urls, TOKEN, timeout_s=5.0) as fleet:
            return await fleet.run_batch([Job(code="print(1)"), Job(code="print(2)")]), fleet.stats

    results, stats = asyncio.run(go())
    for res in results:
        assert res.status == ExecStatus.SANDBOX_ERROR and res.is_infra_failure
        assert "no sandbox service could run this job (1 of 2 tried, the rest out of rotation)" in res.error
        assert urls[0] in res.error and urls[1] in res.error and "unreachable" in res.error
    assert stats["sandbox_errors"] == 2 and stats["retried"] == 2 and stats["node_failures"] == 2


def test_a_refused_request_raises_instead_of_being_retried():
    rec = RecordingSandbox()
    with serving(rec) as srv:

        async def go():
            async with SandboxFleet([srv.url, f"http://127.0.0.1:{free_port()}"], "wrong-token") as fleet:
                return await fleet.run(Job(code="x"))

        with pytest.raises(RemoteSandboxError) as err:
            for _ in range(2):  # whichever service is picked first, the refusal is raised, not retried
                asyncio.run(go())
    assert err.value.status_code == 401 and rec.ran == []


def test_a_service_that_comes_back_passes_a_health_check_and_gets_jobs_again():
    port = free_port()
    rec_b = RecordingSandbox()
    with serving(rec_b) as sb:

        async def go():
            fleet = SandboxFleet([f"http://127.0.0.1:{port}", sb.url], TOKEN, cooldown_s=0.3)
            first = await fleet.run_batch([Job(code=f"a{i}") for i in range(4)])  # port: nothing listens
            rec_a = RecordingSandbox()
            with serving(rec_a, port=port):
                await asyncio.sleep(0.4)  # the cooldown ends; the next call checks its health first
                second = await fleet.run_batch([Job(code=f"b{i}") for i in range(4)])
                health = await fleet.health()
            await fleet.close()
            return first, second, rec_a, health, fleet.stats

        first, second, rec_a, health, stats = asyncio.run(go())
    assert all(r.status == ExecStatus.OK for r in first + second)
    b_on_b = [c for c in rec_b.ran if c.startswith("b")]
    assert sorted(c for c in rec_b.ran if c.startswith("a")) == ["a0", "a1", "a2", "a3"]
    assert len(rec_a.ran) == len(b_on_b) == 2 and sorted(rec_a.ran + b_on_b) == ["b0", "b1", "b2", "b3"]
    assert stats["retried"] == 2 and stats["node_failures"] == 1 and stats["sandbox_errors"] == 0
    assert [n["ok"] for n in health["nodes"]] == [True, True] and health["nodes"][0]["failures"] == 1


def _start_service(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "posttrain", "sandbox", "serve", "--port", str(port), "--token", TOKEN]
        + ["--pool-size", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200:
                return proc
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"sandbox service on {url} did not start")


def test_a_service_killed_mid_batch_loses_no_job():
    ports = [free_port(), free_port()]
    procs = [_start_service(p) for p in ports]
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        jobs = [Job(code=f"import time\ntime.sleep(0.4)\nprint({i})") for i in range(8)]

        async def go():
            async with SandboxFleet(urls, TOKEN, timeout_s=60.0, cooldown_s=30.0) as fleet:
                batch = asyncio.ensure_future(fleet.run_batch(jobs))
                await asyncio.sleep(0.6)  # both services are running jobs of the batch
                os.killpg(procs[0].pid, signal.SIGKILL)
                results = await batch
                after = await fleet.run_batch(jobs[:2])  # the dead one is out of rotation
                return results, after, await fleet.health()

        results, after, health = asyncio.run(go())
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert [r.status for r in results + after] == [ExecStatus.OK] * 10
    assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(8)]
    stats = health["stats"]
    assert stats["retried"] >= 1 and stats["node_failures"] == 1 and stats["sandbox_errors"] == 0
    assert [n["ok"] for n in health["nodes"]] == [False, True]
    assert health["nodes"][0]["in_rotation"] is False
