"""Remote mode: an HTTP JSON service in front of a `LocalSandbox`, and `RemoteSandbox`, its client.

Server (stdlib `http.server`, one thread per request): `POST /run` (a job) and `POST /run_batch`
(`{"jobs": [...]}`), `GET /health`; bearer-token auth (401), a request size limit (413, checked on
Content-Length before reading), bounded concurrency (jobs in flight; excess requests wait their
turn) and 400 with the reason for a malformed job. Bytes travel base64-encoded (see `api`).
The client maps transport failures to `SANDBOX_ERROR` results (infrastructure, never a score) and
raises `RemoteSandboxError` for a refused request (bad token, too large, bad job).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from posttrain.sandbox.api import (
    ExecResult,
    ExecStatus,
    Job,
    job_from_dict,
    job_to_dict,
    result_from_dict,
    result_to_dict,
)


class RemoteSandboxError(RuntimeError):
    """The service refused the request (status code in `.status_code`)."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(f"sandbox service answered {status_code}: {message}")
        self.status_code = status_code


class SandboxServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], sandbox: Any, token: str, max_request_bytes: int,
                 max_concurrent: int) -> None:
        if not token:
            raise ValueError("the sandbox service needs a non-empty token")
        super().__init__(addr, _Handler)
        self.sandbox = sandbox
        self.token = token
        self.max_request_bytes = max_request_bytes
        self.slots = threading.BoundedSemaphore(max_concurrent)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class _Handler(BaseHTTPRequestHandler):
    server: SandboxServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the trainer owns stdout
        pass

    def _send(self, code: int, obj: dict, close: bool = False) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def _authorized(self) -> bool:
        got = self.headers.get("Authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {self.server.token}".encode())

    def do_GET(self) -> None:
        if not self._authorized():
            return self._send(401, {"error": "missing or wrong bearer token"})
        if self.path != "/health":
            return self._send(404, {"error": f"no such endpoint {self.path}"})
        sb = self.server.sandbox
        self._send(200, {"ok": True, "isolation": list(getattr(sb, "layers", [])),
                         "stats": dict(getattr(sb, "stats", {}))})

    def do_POST(self) -> None:
        if not self._authorized():
            return self._send(401, {"error": "missing or wrong bearer token"}, close=True)
        if self.path not in ("/run", "/run_batch"):
            return self._send(404, {"error": f"no such endpoint {self.path}"}, close=True)
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            return self._send(411, {"error": "Content-Length required"}, close=True)
        if int(length) > self.server.max_request_bytes:
            return self._send(413, {"error": f"request of {length} bytes exceeds the limit of "
                                             f"{self.server.max_request_bytes}"}, close=True)
        try:
            body = json.loads(self.rfile.read(int(length)))
            jobs = [job_from_dict(body)] if self.path == "/run" else [job_from_dict(j) for j in body["jobs"]]
        except (ValueError, KeyError, TypeError) as err:
            return self._send(400, {"error": f"bad job: {err}"})
        try:
            with self.server.slots:
                futures = [self.server.sandbox.submit(job) for job in jobs]
                results = [f.result() for f in futures]
        except ValueError as err:
            return self._send(400, {"error": f"bad job: {err}"})
        if self.path == "/run":
            self._send(200, result_to_dict(results[0]))
        else:
            self._send(200, {"results": [result_to_dict(r) for r in results]})


def make_server(sandbox: Any, host: str = "127.0.0.1", port: int = 0, token: str = "",
                max_request_bytes: int = 16 << 20, max_concurrent: int = 64) -> SandboxServer:
    """A ready (not yet serving) server; call `serve_forever()` (port 0 picks a free port)."""
    return SandboxServer((host, port), sandbox, token, max_request_bytes, max_concurrent)


class RemoteSandbox:
    """`Sandbox` over HTTP. Safe from many asyncio tasks; one httpx client per event loop."""

    def __init__(self, url: str, token: str | None, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token or ''}"}
        self.timeout_s = timeout_s
        self._clients: dict[int, httpx.AsyncClient] = {}

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(id(loop))
        if client is None or client.is_closed:
            client = httpx.AsyncClient(headers=self.headers, timeout=self.timeout_s,
                                       limits=httpx.Limits(max_connections=64))
            self._clients[id(loop)] = client
        return client

    async def _post(self, path: str, payload: dict) -> tuple[dict | None, str]:
        """(reply, "") or (None, why) for an infrastructure failure; raises for a refused request."""
        try:
            resp = await self._client().post(self.url + path, json=payload)
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
