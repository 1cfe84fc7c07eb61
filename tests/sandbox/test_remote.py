"""Remote mode end to end on 127.0.0.1 with a random port: the same Sandbox interface over HTTP."""

import asyncio
import socket
import threading
import time

import httpx
import pytest

from posttrain.sandbox import ExecStatus, Job, Limits, make_sandbox
from posttrain.sandbox.api import job_from_dict, job_to_dict
from posttrain.sandbox.grading import grade_asserts
from posttrain.sandbox.remote import RemoteSandbox, RemoteSandboxError, make_server

TOKEN = "test-token-123"


@pytest.fixture(scope="module")
def server(sandbox):
    srv = make_server(sandbox, "127.0.0.1", 0, TOKEN, max_request_bytes=64 * 1024, max_concurrent=4)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_job_json_round_trip_keeps_bytes():
    job = Job(code="print(1)", stdin=b"\xff\x00", files={"a/b.bin": b"\x80"}, argv=["x"],
              limits=Limits(wall_time_s=2.5))
    assert job_from_dict(job_to_dict(job)) == job


def test_run_and_batch_and_grading_over_http(server):
    async def go():
        async with RemoteSandbox(server.url, TOKEN) as sb:
            one = await sb.run(Job(code="import sys; sys.stdout.buffer.write(bytes([255, 10]))"))
            many = await sb.run_batch([Job(code=f"print({i} ** 2)") for i in range(6)])
            graded = await grade_asserts(sb, "def f(x):\n    return x + 1\n", ["assert f(1) == 2", "assert f(2) == 4"])
            health = await sb.health()
            return one, many, graded, health

    one, many, graded, health = asyncio.run(go())
    assert (one.status, one.stdout) == (ExecStatus.OK, b"\xff\n")
    assert [r.stdout for r in many] == [f"{i * i}\n".encode() for i in range(6)]
    assert graded.per_test == [True, False]
    assert health["ok"] is True and "seccomp" in health["isolation"]


def test_wrong_token_is_401(server):
    async def go():
        async with RemoteSandbox(server.url, "wrong") as sb:
            await sb.run(Job(code="print(1)"))

    with pytest.raises(RemoteSandboxError) as err:
        asyncio.run(go())
    assert err.value.status_code == 401


def test_oversized_request_is_413(server):
    big = Job(code="x = '" + "a" * 100_000 + "'")
    resp = httpx.post(server.url + "/run", json=job_to_dict(big), headers={"Authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == 413 and "exceeds the limit of 65536" in resp.json()["error"]


def test_bad_job_is_400_with_reason(server):
    resp = httpx.post(server.url + "/run", json={"code": "print(1)", "language": "cobol"},
                      headers={"Authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == 400 and "unknown language 'cobol'" in resp.json()["error"]


def test_unreachable_service_is_an_infra_failure():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    res = asyncio.run(RemoteSandbox(f"http://127.0.0.1:{port}", TOKEN).run(Job(code="print(1)")))
    assert res.status == ExecStatus.SANDBOX_ERROR and res.is_infra_failure and "unreachable" in res.error


def test_make_sandbox_remote_needs_url():
    from posttrain.config import SandboxConfig

    with pytest.raises(ValueError, match="sandbox.url is not set"):
        make_sandbox(SandboxConfig(mode="remote"))
    assert isinstance(make_sandbox(SandboxConfig(mode="remote", url="http://x:1", token="t")), RemoteSandbox)


def test_bounded_concurrency_serializes_excess_requests(sandbox):
    srv = make_server(sandbox, "127.0.0.1", 0, TOKEN, max_concurrent=1)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        async def go():
            async with RemoteSandbox(srv.url, TOKEN) as sb:
                job = Job(code="import time\ntime.sleep(0.4)\nprint('slept')")
                t0 = time.monotonic()
                results = await asyncio.gather(sb.run(job), sb.run(job))
                return results, time.monotonic() - t0

        results, elapsed = asyncio.run(go())
        assert [r.stdout for r in results] == [b"slept\n", b"slept\n"]
        assert elapsed >= 0.8  # two workers were free, but one request at a time was admitted
    finally:
        srv.shutdown()
        srv.server_close()


def test_run_sync_wrapper(sandbox):
    from posttrain.sandbox import run_sync

    assert run_sync(sandbox, Job(code="print('sync')")).stdout == b"sync\n"
