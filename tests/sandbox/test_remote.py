"""Remote mode end to end on 127.0.0.1 with a random port: the same Sandbox interface over HTTP."""

import asyncio
import concurrent.futures
import contextlib
import socket
import threading
import time

import httpx
import pytest

from posttrain.sandbox import ExecResult, ExecStatus, Job, Limits, make_sandbox
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
    job = Job(
        code="print(1)",
        stdin=b"\xff\x00",
        files={"a/b.bin": b"\x80"},
        argv=["x"],
        limits=Limits(wall_time_s=2.5),
    )
    assert job_from_dict(job_to_dict(job)) == job


def test_run_and_batch_and_grading_over_http(server):
    async def go():
        async with RemoteSandbox(server.url, TOKEN) as sb:
            one = await sb.run(Job(code="import sys; sys.stdout.buffer.write(bytes([255, 10]))"))
            many = await sb.run_batch([Job(code=f"print({i} ** 2)") for i in range(6)])
            graded = await grade_asserts(
                sb, "def f(x):\n    return x + 1\n", ["assert f(1) == 2", "assert f(2) == 4"]
            )
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
    resp = httpx.post(
        server.url + "/run", json=job_to_dict(big), headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert resp.status_code == 413 and "exceeds the limit of 65536" in resp.json()["error"]


def test_bad_job_is_400_with_reason(server):
    resp = httpx.post(
        server.url + "/run",
        json={"code": "print(1)", "language": "cobol"},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
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
    remote = make_sandbox(SandboxConfig(mode="remote", url="http://x:1", token="t", remote_timeout_s=7.0))
    assert isinstance(remote.inner, RemoteSandbox) and remote.inner.timeout_s == 7.0


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


class CountingSandbox:
    """Stands in for the pool behind the server: runs each job as a short sleep and records how many
    were in flight at once, so the server's admission can be measured exactly."""

    def __init__(self, job_s: float = 0.15) -> None:
        self.job_s = job_s
        self.executor = concurrent.futures.ThreadPoolExecutor(16)
        self.lock = threading.Lock()
        self.in_flight = self.peak = self.submitted = 0

    def check(self, job):
        if job.language != "python":
            raise ValueError(f"unknown language '{job.language}'")

    def submit(self, job):
        with self.lock:
            self.submitted += 1

        def go():
            with self.lock:
                self.in_flight += 1
                self.peak = max(self.peak, self.in_flight)
            time.sleep(self.job_s)
            with self.lock:
                self.in_flight -= 1
            return ExecResult(status=ExecStatus.OK, stdout=job.code.encode())

        return self.executor.submit(go)


@contextlib.contextmanager
def serving(sandbox, port=0, **kw):
    srv = make_server(sandbox, "127.0.0.1", port, TOKEN, **kw)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def test_max_concurrent_counts_jobs_not_requests():
    fake = CountingSandbox()
    with serving(fake, max_concurrent=2) as srv:

        async def go():
            async with RemoteSandbox(srv.url, TOKEN) as sb:
                return await asyncio.gather(
                    sb.run_batch([Job(code=f"b{i}") for i in range(6)]),
                    sb.run(Job(code="one")),
                    sb.run_batch([Job(code="x"), Job(code="y")]),
                )

        t0 = time.monotonic()
        batch, one, pair = asyncio.run(go())
        elapsed = time.monotonic() - t0
    assert [r.stdout for r in batch] == [f"b{i}".encode() for i in range(6)]
    assert (one.stdout, [r.stdout for r in pair]) == (b"one", [b"x", b"y"])
    assert fake.peak == 2  # a batch of 6 once counted as one request: 6 + 1 + 2 jobs ran at once
    assert elapsed >= 4.5 * fake.job_s  # 9 jobs, 2 at a time: at least 5 rounds


def test_a_batch_larger_than_max_concurrent_still_completes_on_real_workers(sandbox):
    with serving(sandbox, max_concurrent=1) as srv:

        async def go():
            async with RemoteSandbox(srv.url, TOKEN) as sb:
                job = Job(code="import time\ntime.sleep(0.3)\nprint('slept')")
                t0 = time.monotonic()
                results = await sb.run_batch([job, job, job])
                return results, time.monotonic() - t0

        results, elapsed = asyncio.run(go())
    assert [r.stdout for r in results] == [b"slept\n"] * 3
    assert elapsed >= 0.9  # two workers were free, but one job at a time was admitted


def test_limits_over_the_service_maxima_are_refused_by_name():
    fake = CountingSandbox()
    maxima = Limits(wall_time_s=10, cpu_time_s=10, memory_bytes=1 << 30, max_processes=32)
    with serving(fake, max_limits=maxima) as srv:

        async def go(jobs, single=False):
            async with RemoteSandbox(srv.url, TOKEN) as sb:
                return await (sb.run(jobs[0]) if single else sb.run_batch(jobs))

        with pytest.raises(RemoteSandboxError) as err:
            asyncio.run(
                go([Job(code="a", limits=Limits(wall_time_s=100, memory_bytes=2 << 30))], single=True)
            )
        assert err.value.status_code == 400
        assert "Limits.wall_time_s=100 exceeds this service's maximum of 10" in str(err.value)
        assert f"Limits.memory_bytes={2 << 30} exceeds this service's maximum of {1 << 30}" in str(err.value)
        with pytest.raises(RemoteSandboxError) as err:
            asyncio.run(go([Job(code="ok"), Job(code="b", limits=Limits(max_processes=33))]))
        assert err.value.status_code == 400 and "jobs[1]: Limits.max_processes=33 exceeds" in str(err.value)
        with pytest.raises(RemoteSandboxError, match="unknown language 'bash'"):
            asyncio.run(go([Job(code="ok"), Job(code="b", language="bash")]))
        assert fake.submitted == 0  # a refused batch runs none of its jobs
        at_max = asyncio.run(
            go([Job(code="edge", limits=Limits(wall_time_s=10, cpu_time_s=10, max_processes=32))])
        )
        assert at_max[0].stdout == b"edge" and fake.submitted == 1
        health = httpx.get(srv.url + "/health", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert health["max_limits"]["wall_time_s"] == 10 and health["max_limits"]["memory_bytes"] == 1 << 30


def _closed_or_408(sock: socket.socket, within_s: float) -> tuple[bool, float]:
    """Read until the server answers or closes; (True, seconds) if it did so within `within_s`."""
    sock.settimeout(within_s)
    t0 = time.monotonic()
    data = b""
    try:
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    except (TimeoutError, ConnectionResetError):
        if not data:
            return False, time.monotonic() - t0
    return data == b"" or data.startswith(b"HTTP/1.1 408"), time.monotonic() - t0


@pytest.mark.parametrize("stall", ["silent", "headers", "trickle", "body"])
def test_a_stalled_client_is_dropped_and_the_service_goes_on(stall):
    fake = CountingSandbox()
    with serving(fake, request_timeout_s=1.0) as srv:
        host, port = srv.server_address[:2]
        with socket.create_connection((host, port)) as sock:
            head = f"POST /run HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n".encode()
            if stall == "headers":
                sock.sendall(head)
            elif stall == "trickle":  # one byte every 0.25 s: each read is quick, the whole never ends
                t0 = time.monotonic()
                try:
                    for byte in head:
                        sock.sendall(bytes([byte]))
                        time.sleep(0.25)
                except OSError:  # the server shut the connection down mid-request
                    pass
                assert time.monotonic() - t0 < 3.0
            elif stall == "body":
                sock.sendall(head + b"Content-Length: 100\r\n\r\n" + b'{"code": ')
            dropped, waited = _closed_or_408(sock, within_s=5.0)
        assert dropped and waited < 4.0, (stall, waited)
        resp = httpx.post(
            srv.url + "/run",
            json=job_to_dict(Job(code="after")),
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert resp.status_code == 200 and resp.json()["stdout"] == "YWZ0ZXI="  # base64 of b"after"


@pytest.mark.parametrize("stall", ["silent", "trickle"])
def test_a_stalled_service_is_an_infra_failure_within_the_client_timeout(stall):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    stop = threading.Event()

    def serve():  # accepts, then never answers (or answers one header byte every 0.1 s)
        conns, started = [], set()
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
                conns.append(conn)
            except TimeoutError:
                pass
            if stall == "trickle":  # a valid reply that never ends: a status line, then a header byte by byte
                for conn in conns:
                    with contextlib.suppress(OSError):
                        conn.sendall(b"HTTP/1.1 200 OK\r\nX-Pad: " if conn not in started else b"a")
                        started.add(conn)
            time.sleep(0.1)
        for conn in conns:
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        t0 = time.monotonic()
        res = asyncio.run(
            RemoteSandbox(f"http://127.0.0.1:{listener.getsockname()[1]}", TOKEN, timeout_s=1.0).run(
                Job(code="print(1)")
            )
        )
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()
    assert res.status == ExecStatus.SANDBOX_ERROR and res.is_infra_failure, res
    assert elapsed < 3.0, elapsed
    # silent: httpx's read timeout or our deadline, whichever fires first; trickle: only the deadline can
    assert "did not answer within 1.0 s" in res.error or (stall == "silent" and "ReadTimeout" in res.error), (
        res.error
    )
