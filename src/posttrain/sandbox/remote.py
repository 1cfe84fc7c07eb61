"""Remote mode: an HTTP JSON service in front of a `LocalSandbox`, and `RemoteSandbox`, its client.

Server (FastAPI on uvicorn, one event loop; jobs run on the sandbox's workers): `POST /run` (a job) and `POST /run_batch`
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
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

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


class SandboxServer:
    """The service: a FastAPI app on uvicorn, bound at construction (port 0 picks a free port, so `url` is
    known before `serve_forever()`), stopped by `shutdown()` from another thread."""

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
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        self.sandbox = sandbox
        self.token = token
        self.max_request_bytes = max_request_bytes
        self.max_concurrent = max_concurrent
        self.max_limits = max_limits if max_limits is not None else DEFAULT_MAX_LIMITS
        self.request_timeout_s = request_timeout_s
        self.socket = socket.create_server(addr, reuse_port=False)
        self.server_address = self.socket.getsockname()
        protocol = type("_Protocol", (_DeadlineProtocol,), {"request_timeout_s": request_timeout_s})
        config = uvicorn.Config(
            build_app(self),
            http=protocol,
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_keep_alive=max(1, int(request_timeout_s)),
            timeout_graceful_shutdown=5,
        )
        self._server = uvicorn.Server(config)
        self._stopped = threading.Event()
        self._stopped.set()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def serve_forever(self) -> None:
        self._stopped.clear()
        try:
            self._server.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the server to stop and wait until `serve_forever()` has returned."""
        self._server.should_exit = True
        self._stopped.wait(timeout_s)

    def server_close(self) -> None:
        self.socket.close()


class _DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with the deadlines a service facing untrusted clients needs: the request
    line and headers (and an idle keep-alive wait) must arrive within `request_timeout_s` of the
    connection or of the previous reply, and a reply the client stops reading is dropped after as long.
    Per-read socket timeouts alone let a client that trickles one byte at a time hold the connection.
    The body's deadline is the app's (it answers 408)."""

    request_timeout_s = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._write_deadline: asyncio.TimerHandle | None = None
        self._arm_head()

    def _arm_head(self) -> None:
        self._cancel_head()
        self._head_deadline = self.loop.call_later(self.request_timeout_s, self._expire)

    def _cancel_head(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _expire(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._cancel_head()  # a request is in: its body and its run are the app's to bound

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_deadline is None:
            self._write_deadline = self.loop.call_later(self.request_timeout_s, self._expire)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head()
        if self._write_deadline is not None:
            self._write_deadline.cancel()
        super().connection_lost(exc)


def _error(code: int, message: str, close: bool = False) -> JSONResponse:
    return JSONResponse(
        {"error": message}, status_code=code, headers={"Connection": "close"} if close else None
    )


def build_app(server: SandboxServer) -> FastAPI:
    """The service's routes over `server.sandbox`; every job holds one of `max_concurrent` slots while it
    runs (a batch of N holds N, each freed as its job finishes; excess jobs wait their turn)."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    slots: dict[int, asyncio.Semaphore] = {}  # per event loop

    def authorized(request: Request) -> bool:
        got = request.headers.get("authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {server.token}".encode())

    async def run_jobs(jobs: list[Job]) -> list[ExecResult]:
        loop = asyncio.get_running_loop()
        sem = slots.setdefault(id(loop), asyncio.Semaphore(server.max_concurrent))
        futures = []
        for job in jobs:
            await sem.acquire()
            try:
                fut = asyncio.wrap_future(server.sandbox.submit(job))
            except BaseException:
                sem.release()
                raise
            fut.add_done_callback(lambda _f: sem.release())
            futures.append(fut)
        return list(await asyncio.gather(*futures))

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        if not authorized(request):
            return _error(401, "missing or wrong bearer token")
        sb = server.sandbox
        return JSONResponse(
            {
                "ok": True,
                "isolation": list(getattr(sb, "layers", [])),
                "stats": dict(getattr(sb, "stats", {})),
                "max_limits": dataclasses.asdict(server.max_limits),
            }
        )

    async def read_jobs(request: Request, batch: bool) -> list[Job] | JSONResponse:
        if not authorized(request):
            return _error(401, "missing or wrong bearer token", close=True)
        length = request.headers.get("content-length")
        if length is None or not length.isdigit():
            return _error(411, "Content-Length required", close=True)
        if int(length) > server.max_request_bytes:
            return _error(
                413, f"request of {length} bytes exceeds the limit of {server.max_request_bytes}", close=True
            )
        try:
            async with asyncio.timeout(server.request_timeout_s):
                raw = await request.body()
        except TimeoutError:
            return _error(408, f"request body not received within {server.request_timeout_s} s", close=True)
        except ClientDisconnect:
            return _error(400, "client disconnected", close=True)
        try:
            body = json.loads(raw)
            jobs = [job_from_dict(j) for j in body["jobs"]] if batch else [job_from_dict(body)]
            check = getattr(server.sandbox, "check", None)
            for i, job in enumerate(jobs):  # the whole request is refused before any of it runs
                over = limits_over(job.limits, server.max_limits)
                if over:
                    raise ValueError((f"jobs[{i}]: " if batch else "") + "; ".join(over))
                if check is not None:
                    check(job)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            return _error(400, f"bad job: {err}")
        return jobs

    async def execute(request: Request, batch: bool) -> JSONResponse:
        jobs = await read_jobs(request, batch)
        if isinstance(jobs, JSONResponse):
            return jobs
        try:
            results = await run_jobs(jobs)
        except ValueError as err:
            return _error(400, f"bad job: {err}")
        if batch:
            return JSONResponse({"results": [result_to_dict(r) for r in results]})
        return JSONResponse(result_to_dict(results[0]))

    @app.post("/run")
    async def run(request: Request) -> JSONResponse:
        return await execute(request, batch=False)

    @app.post("/run_batch")
    async def run_batch(request: Request) -> JSONResponse:
        return await execute(request, batch=True)

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        if not authorized(request):
            return _error(401, "missing or wrong bearer token", close=True)
        return _error(404, f"no such endpoint {request.url.path}", close=True)

    @app.exception_handler(405)
    async def not_allowed(request: Request, exc: Exception) -> JSONResponse:
        if not authorized(request):
            return _error(401, "missing or wrong bearer token", close=True)
        return _error(404, f"no such endpoint {request.method} {request.url.path}", close=True)

    return app


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
    """A ready (bound, not yet serving) server; call `serve_forever()` (port 0 picks a free port).

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

    @property
    def name(self) -> str:
        """The service's URL (how a `SandboxFleet` names this node)."""
        return self.url

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

    async def try_batch(self, jobs: Sequence[Job]) -> tuple[list[ExecResult] | None, str]:
        """The jobs' results, or (None, why) when the service could not be reached or did not answer
        (nothing is known about the jobs then); raises `RemoteSandboxError` for a refused request."""
        if not jobs:
            return [], ""
        data, error = await self._post("/run_batch", {"jobs": [job_to_dict(j) for j in jobs]})
        if data is None:
            return None, error
        return [result_from_dict(r) for r in data["results"]], ""

    async def run(self, job: Job) -> ExecResult:
        data, error = await self._post("/run", job_to_dict(job))
        if data is None:
            return ExecResult(status=ExecStatus.SANDBOX_ERROR, error=error)
        return result_from_dict(data)

    async def run_batch(self, jobs: Sequence[Job]) -> list[ExecResult]:
        results, error = await self.try_batch(jobs)
        if results is None:
            return [ExecResult(status=ExecStatus.SANDBOX_ERROR, error=error) for _ in jobs]
        return results

    async def health(self, timeout_s: float | None = None) -> dict:
        async with asyncio.timeout(timeout_s if timeout_s is not None else self.timeout_s):
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
