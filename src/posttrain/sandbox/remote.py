"""Remote mode: an HTTP JSON service in front of a `LocalSandbox`, and `RemoteSandbox`, its client.

Server (stdlib `http.server`, one thread per connection): `POST /run` (a job) and `POST /run_batch`
(`{"jobs": [...]}`), `GET /health` (which also reports the service's limit maxima); bearer-token auth
(401), a request size limit (413, checked on Content-Length before reading), a deadline on reading
each request and on writing each reply (408 / connection closed: a stalled client holds no thread for
long), bounded concurrency counted in jobs (a batch of N holds N of `max_concurrent` slots; excess
jobs wait their turn) and 400 with the reason for a malformed job. A job whose limits exceed the
service's maxima is refused with a 400 that names the limit and the maximum, never silently capped:
a job run under a lower limit than it asked for could time out and be scored as the model's failure.
Bytes travel base64-encoded (see `api`). The client maps transport failures and a service that does
not answer within `timeout_s` to `SANDBOX_ERROR` results (infrastructure, never a score) and raises
`RemoteSandboxError` for a refused request (bad token, too large, bad job, limits over the maxima).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import socket
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from posttrain.sandbox.api import (
    POSITIVE_LIMITS,
    ExecResult,
    ExecStatus,
    Job,
    Limits,
    job_from_dict,
    job_to_dict,
    result_from_dict,
    result_to_dict,
)

log = logging.getLogger(__name__)

# What a service accepts unless told otherwise (`make_server(max_limits=...)`); `network` is not
# capped here: the sandbox's own allow_network decides it.
DEFAULT_MAX_LIMITS = Limits(
    wall_time_s=60.0,
    cpu_time_s=60.0,
    memory_bytes=2 << 30,
    max_processes=64,
    max_output_bytes=16 << 20,
    max_file_bytes=256 << 20,
    max_returned_files_bytes=16 << 20,
)
CAPPED_LIMITS = (*POSITIVE_LIMITS, "max_returned_files_bytes")


def limits_over(limits: Limits, maxima: Limits) -> list[str]:
    """One message per limit of `limits` above `maxima`, naming the limit and the maximum."""
    return [
        f"Limits.{key}={getattr(limits, key)!r} exceeds this service's maximum of {getattr(maxima, key)!r}"
        for key in CAPPED_LIMITS
        if getattr(limits, key) > getattr(maxima, key)
    ]


class RemoteSandboxError(RuntimeError):
    """The service refused the request (status code in `.status_code`)."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(f"sandbox service answered {status_code}: {message}")
        self.status_code = status_code


class SandboxServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        addr: tuple[str, int],
        sandbox: Any,
        token: str,
        max_request_bytes: int,
        max_concurrent: int,
        max_limits: Limits | None = None,
        request_timeout_s: float = 30.0,
    ) -> None:
        if not token:
            raise ValueError("the sandbox service needs a non-empty token")
        if request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}")
        super().__init__(addr, _Handler)
        self.sandbox = sandbox
        self.token = token
        self.max_request_bytes = max_request_bytes
        self.max_limits = max_limits if max_limits is not None else DEFAULT_MAX_LIMITS
        self.request_timeout_s = request_timeout_s
        self.slots = threading.BoundedSemaphore(max_concurrent)  # one per job in flight

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("sandbox service: connection from %s failed", client_address, exc_info=True)

    def run_jobs(self, jobs: list[Job]) -> list[ExecResult]:
        """Admit each job against `max_concurrent` (a slot per job, freed as that job finishes), then wait."""
        futures = []
        for job in jobs:
            self.slots.acquire()
            try:
                fut = self.sandbox.submit(job)
            except BaseException:
                self.slots.release()
                raise
            fut.add_done_callback(lambda _f: self.slots.release())
            futures.append(fut)
        return [f.result() for f in futures]

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class _Deadline:
    """Shuts the connection down if a read or write phase outlasts the server's request timeout: per-
    operation socket timeouts alone let a client that trickles one byte at a time hold a thread."""

    def __init__(self, handler: _Handler) -> None:
        self.handler = handler
        self.timer: threading.Timer | None = None

    def start(self) -> None:
        self.cancel()
        self.timer = threading.Timer(self.handler.server.request_timeout_s, self._expire)
        self.timer.daemon = True
        self.timer.start()

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expire(self) -> None:
        try:
            self.handler.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class _Handler(BaseHTTPRequestHandler):
    server: SandboxServer
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        self.timeout = self.server.request_timeout_s  # per socket operation, set by StreamRequestHandler
        super().setup()
        self.deadline = _Deadline(self)

    def handle_one_request(self) -> None:
        self.deadline.start()  # request line, headers and body (and an idle keep-alive wait)
        try:
            super().handle_one_request()
        finally:
            self.deadline.cancel()

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the trainer owns stdout
        pass

    def _send(self, code: int, obj: dict, close: bool = False) -> None:
        body = json.dumps(obj).encode()
        self.deadline.start()  # a client that stops reading the reply is dropped too
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
        except OSError:
            self.close_connection = True
        finally:
            self.deadline.cancel()

    def _read_body(self, length: int) -> bytes | None:
        """The body, or None (after answering 408) when it did not arrive within the request timeout."""
        try:
            body = self.rfile.read(length)
        except OSError:
            body = b""
        self.deadline.cancel()  # the jobs' run time is not the client's to account for
        if len(body) < length:
            self._send(
                408,
                {"error": f"request body not received within {self.server.request_timeout_s} s"},
                close=True,
            )
            return None
        return body

    def _authorized(self) -> bool:
        got = self.headers.get("Authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {self.server.token}".encode())

    def do_GET(self) -> None:
        if not self._authorized():
            return self._send(401, {"error": "missing or wrong bearer token"})
        if self.path != "/health":
            return self._send(404, {"error": f"no such endpoint {self.path}"})
        sb = self.server.sandbox
        self._send(
            200,
            {
                "ok": True,
                "isolation": list(getattr(sb, "layers", [])),
                "stats": dict(getattr(sb, "stats", {})),
                "max_limits": dataclasses.asdict(self.server.max_limits),
            },
        )

    def do_POST(self) -> None:
        if not self._authorized():
            return self._send(401, {"error": "missing or wrong bearer token"}, close=True)
        if self.path not in ("/run", "/run_batch"):
            return self._send(404, {"error": f"no such endpoint {self.path}"}, close=True)
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            return self._send(411, {"error": "Content-Length required"}, close=True)
        if int(length) > self.server.max_request_bytes:
            return self._send(
                413,
                {"error": f"request of {length} bytes exceeds the limit of {self.server.max_request_bytes}"},
                close=True,
            )
        raw = self._read_body(int(length))
        if raw is None:
            return None
        try:
            body = json.loads(raw)
            jobs = [job_from_dict(body)] if self.path == "/run" else [job_from_dict(j) for j in body["jobs"]]
            check = getattr(self.server.sandbox, "check", None)
            for i, job in enumerate(jobs):  # the whole request is refused before any of it runs
                over = limits_over(job.limits, self.server.max_limits)
                if over:
                    raise ValueError(("" if self.path == "/run" else f"jobs[{i}]: ") + "; ".join(over))
                if check is not None:
                    check(job)
        except (ValueError, KeyError, TypeError) as err:
            return self._send(400, {"error": f"bad job: {err}"})
        try:
            results = self.server.run_jobs(jobs)
        except ValueError as err:
            return self._send(400, {"error": f"bad job: {err}"})
        if self.path == "/run":
            self._send(200, result_to_dict(results[0]))
        else:
            self._send(200, {"results": [result_to_dict(r) for r in results]})


def make_server(
    sandbox: Any,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str = "",
    max_request_bytes: int = 16 << 20,
    max_concurrent: int = 64,
    max_limits: Limits | None = None,
    request_timeout_s: float = 30.0,
) -> SandboxServer:
    """A ready (not yet serving) server; call `serve_forever()` (port 0 picks a free port).

    `max_concurrent` counts jobs in flight; `max_limits` (default `DEFAULT_MAX_LIMITS`) bounds every
    job's limits; `request_timeout_s` bounds reading a request and writing its reply."""
    return SandboxServer(
        (host, port), sandbox, token, max_request_bytes, max_concurrent, max_limits, request_timeout_s
    )


class RemoteSandbox:
    """`Sandbox` over HTTP. Safe from many asyncio tasks; one httpx client per event loop.

    `timeout_s` bounds each whole request (queueing and running on the service included); a service
    that does not answer in time, or trickles its answer, gives SANDBOX_ERROR results."""

    def __init__(
        self, url: str, token: str | None, timeout_s: float = 600.0, connect_timeout_s: float = 10.0
    ) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token or ''}"}
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._clients: dict[int, httpx.AsyncClient] = {}

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(id(loop))
        if client is None or client.is_closed:
            timeout = httpx.Timeout(self.timeout_s, connect=min(self.connect_timeout_s, self.timeout_s))
            client = httpx.AsyncClient(
                headers=self.headers, timeout=timeout, limits=httpx.Limits(max_connections=64)
            )
            self._clients[id(loop)] = client
        return client

    async def _post(self, path: str, payload: dict) -> tuple[dict | None, str]:
        """(reply, "") or (None, why) for an infrastructure failure; raises for a refused request."""
        try:
            async with asyncio.timeout(self.timeout_s):  # httpx's own timeouts are per read, not per request
                resp = await self._client().post(self.url + path, json=payload)
        except TimeoutError:
            return None, f"sandbox service did not answer within {self.timeout_s} s"
        except httpx.HTTPError as err:
            return None, f"sandbox service unreachable: {type(err).__name__}: {err}"
        if resp.status_code >= 500:
            return None, f"sandbox service error {resp.status_code}: {resp.text[:200]}"
        if resp.status_code != 200:
            try:
                message = resp.json().get("error", resp.text)
            except ValueError:
                message = resp.text
            raise RemoteSandboxError(resp.status_code, message)
        return resp.json(), ""

    async def run(self, job: Job) -> ExecResult:
        data, error = await self._post("/run", job_to_dict(job))
        if data is None:
            return ExecResult(status=ExecStatus.SANDBOX_ERROR, error=error)
        return result_from_dict(data)

    async def run_batch(self, jobs: Sequence[Job]) -> list[ExecResult]:
        if not jobs:
            return []
        data, error = await self._post("/run_batch", {"jobs": [job_to_dict(j) for j in jobs]})
        if data is None:
            return [ExecResult(status=ExecStatus.SANDBOX_ERROR, error=error) for _ in jobs]
        return [result_from_dict(r) for r in data["results"]]

    async def health(self) -> dict:
        async with asyncio.timeout(self.timeout_s):
            resp = await self._client().get(self.url + "/health")
        if resp.status_code != 200:
            raise RemoteSandboxError(resp.status_code, resp.text[:200])
        return resp.json()

    async def close(self) -> None:
        loop_id = id(asyncio.get_running_loop())
        client = self._clients.pop(loop_id, None)
        if client is not None:
            await client.aclose()

    async def __aenter__(self) -> RemoteSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
