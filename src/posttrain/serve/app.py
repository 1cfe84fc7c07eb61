"""The OpenAI-compatible HTTP app over the engine's async interface (`Engine.stream`), and its model
registry: served name -> `ModelEntry(engine, tokenizer, mode)`, so a `fast` engine can sit beside the
`standard` (paged) one. Owns admission (running slots, a bounded queue, 429), the request lifecycle
(loading, ready, draining: 503), auth, body caps, SSE framing, usage, metrics and access logs.

Supported: chat completions with tools (tool_choice none/auto/required/named, parallel_tool_calls),
streaming with usage, n, seed, stop, temperature/top_p, presence/frequency penalties (and the extensions
top_k, min_p, repetition_penalty, ignore_eos), logprobs of the sampled tokens and top_logprobs (0 to 20
per token, under the same distribution: after the penalties and temperature, before truncation); legacy
completions (logprobs: N, top_logprobs as {token: logprob} per position); models; health; metrics.
response_format json_object and json_schema are enforced by the engine's constrained decoding (an
unenforceable schema keyword is a 400 naming it). Refused with a 400 that says why: image/audio parts,
logit_bias (the engine has none), top_logprobs without logprobs: true, response_format json_* together
with active tools. A named or `required` tool_choice decodes
the call under the tools' JSON schemas with the same constrained decoding (serve/chat.py: the call's
opening is prefilled, the rest is the schema's JSON), so its reply is a `tool_calls` list whose
arguments validate, finish_reason "tool_calls", unless max_tokens cuts it (finish "length", the raw
text as content); on an engine without constrained decoding (`ModelEntry.constrained` False) a named
choice fixes only the name and `required` is asked for in the prompt. The tool-call outcome metric
says which happened. The Responses API (`/v1/responses`) is served over the same path (responses.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from posttrain.engine.constrained import JSON_OBJECT_SCHEMA, compile_schema
from posttrain.engine.types import BadRequestError, Engine, GenerationRequest, SamplingParams, StreamDelta
from posttrain.serve.chat import (
    ChoiceText,
    ToolPlan,
    chat_format_for,
    finished_text,
    plan_tools,
    render_chat,
    view_reply,
)
from posttrain.serve.metrics import ServeMetrics, kv_usage_of, log_access
from posttrain.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormat,
    ResponsesRequest,
    bad_request,
    from_validation_error,
)
from posttrain.serve.responses import response_events, response_whole, to_chat_request
from posttrain.types import ImagePart

log = logging.getLogger("posttrain.serve")

MODES = ("standard", "fast")


@dataclass
class ModelEntry:
    """One served model: its engine and tokenizer, the mode label its metrics carry, its context size,
    its tool-call syntax, and whether its engine has constrained decoding."""

    name: str
    engine: Engine
    tokenizer: Any
    mode: str = "standard"
    max_model_len: int = 4096
    chat_format: str = ""
    constrained: bool = True  # the engine enforces SamplingParams.json_schema (the paged engine does)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got '{self.mode}'")
        if not self.chat_format:
            self.chat_format = chat_format_for(self.tokenizer)


@dataclass
class ServeSettings:
    api_key: str | None = None
    max_queue: int = 256  # requests waiting for a running slot before 429
    max_running: int = 64  # requests in the engine at once (its continuous batch)
    max_body_bytes: int = 4 * 1024 * 1024
    default_max_tokens: int | None = None  # None: the rest of the context window
    drain_timeout_s: float = 300.0


class _Admission:
    """Running slots and a bounded wait for one model."""

    def __init__(self, max_running: int, max_queue: int) -> None:
        self.sem = asyncio.Semaphore(max_running)
        self.max_queue = max_queue
        self.waiting = 0
        self.running = 0


class ServeState:
    """The app's lifecycle and registry: `loading` until a model is added, `ready`, `draining` after
    SIGTERM (new requests get 503, in-flight ones finish), or `failed` (loading raised)."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.metrics = ServeMetrics()
        self.models: dict[str, ModelEntry] = {}
        self.status = "loading"
        self.error: str | None = None
        self.in_flight = 0
        self.drain_started_s: float | None = None
        self._admission: dict[str, _Admission] = {}

    def add_model(self, entry: ModelEntry) -> None:
        if entry.name in self.models:
            raise ValueError(f"a model named '{entry.name}' is already served")
        self.models[entry.name] = entry
        speculates = getattr(entry.engine, "speculative", "none") != "none"
        spec = entry.engine.speculation_stats if speculates else None  # type: ignore[attr-defined]
        self.metrics.add_model(entry.name, entry.mode, kv_usage_of(entry.engine), spec)
        if self.status == "loading":
            self.status = "ready"

    def fail(self, message: str) -> None:
        self.status, self.error = "failed", message

    def begin_drain(self) -> None:
        if self.status != "draining":
            self.status = "draining"
            self.drain_started_s = time.monotonic()

    def drained(self) -> bool:
        if self.status != "draining":
            return False
        waited = time.monotonic() - (self.drain_started_s or 0.0)
        return self.in_flight == 0 or waited > self.settings.drain_timeout_s

    def admission(self, model: str) -> _Admission:
        if model not in self._admission:
            s = self.settings
            self._admission[model] = _Admission(s.max_running, s.max_queue)
        return self._admission[model]


# ---- request plumbing ---------------------------------------------------------------------------


async def _read_json(request: Request, cap: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    too_big = APIError(
        413, f"the request body exceeds {cap} bytes (the server's cap)", code="request_too_large"
    )
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise too_big
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > cap:
            raise too_big
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise bad_request(
            f"the request body is not valid JSON: {str(err)[:200]}", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise from_validation_error(err) from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise bad_request("stop holds an empty string; give non-empty strings", param="stop")
    if len(stops) > 16:
        raise bad_request(f"stop holds {len(stops)} strings; at most 16 are accepted", param="stop")
    return stops


def _sampling(
    req: Any,
    entry: ModelEntry,
    settings: ServeSettings,
    prompt_len: int,
    max_tokens: int | None,
    top_logprobs: int = 0,
    json_schema: dict[str, Any] | None = None,
) -> SamplingParams:
    if req.logit_bias:
        raise bad_request(
            "logit_bias is not supported by this engine", param="logit_bias", code="unsupported_parameter"
        )
    room = entry.max_model_len - prompt_len
    if room <= 0:
        raise bad_request(
            f"this model's maximum context length is {entry.max_model_len} tokens and the prompt is {prompt_len} "
            "tokens, which leaves no room for a completion; shorten the prompt",
            param="messages",
            code="context_length_exceeded",
        )
    if max_tokens is not None and max_tokens > room:
        raise bad_request(
            f"this model's maximum context length is {entry.max_model_len} tokens; you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion); "
            "lower max_tokens or shorten the prompt",
            param="max_tokens",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = min(room, settings.default_max_tokens or room)
    params = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        max_tokens=max_tokens,
        stop=_stops(req.stop),
        seed=req.seed,
        n=req.n,
        ignore_eos=req.ignore_eos,
        top_logprobs=top_logprobs,
        json_schema=json_schema,
    )
    try:
        params.validate()
    except BadRequestError as err:
        raise bad_request(str(err)) from None
    return params


def _response_schema(fmt: ResponseFormat | None, plan: ToolPlan) -> dict[str, Any] | None:
    """The JSON Schema a chat request's `response_format` asks the engine to enforce (None for text):
    `json_object` is any JSON object, `json_schema` the schema in `json_schema.schema`."""
    if fmt is None or fmt.type == "text":
        return None
    if plan.active:
        raise bad_request(
            f"response_format '{fmt.type}' cannot be combined with tools: the JSON constraint would forbid "
            "the tool-call markup; drop the tools or set tool_choice to 'none'",
            param="response_format",
            code="unsupported_parameter",
        )
    if fmt.type == "json_object":
        return dict(JSON_OBJECT_SCHEMA)
    spec = (fmt.model_extra or {}).get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise bad_request(
            "response_format json_schema needs json_schema.schema, a JSON Schema object "
            '(e.g. {"type": "json_schema", "json_schema": {"name": "reply", "schema": {"type": "object"}}})',
            param="response_format.json_schema",
        )
    try:
        compile_schema(spec["schema"])
    except BadRequestError as err:
        raise bad_request(str(err), param="response_format.json_schema.schema") from None
    return spec["schema"]


def _token_entry(tokenizer: Any, token: int, logprob: float) -> dict[str, Any]:
    s = tokenizer.decode([token])
    return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}


def _token_logprobs(
    tokenizer: Any, ids: list[int], lps: list[float], tops: list[list[tuple[int, float]]] | None = None
) -> list[dict[str, Any]]:
    """Chat `logprobs.content`: one entry per token, its `top_logprobs` as {token, logprob, bytes}."""
    out = []
    for i, (t, lp) in enumerate(zip(ids, lps, strict=True)):
        entry = _token_entry(tokenizer, t, lp)
        entry["top_logprobs"] = (
            [_token_entry(tokenizer, a, v) for a, v in tops[i]] if tops is not None else []
        )
        out.append(entry)
    return out


def _legacy_logprobs(
    tokenizer: Any,
    ids: list[int],
    lps: list[float],
    tops: list[list[tuple[int, float]]] | None,
    offset: int,
) -> dict[str, Any]:
    """Legacy completions `logprobs`: tokens, token_logprobs, text_offset (from `offset`) and, for
    `logprobs: N` > 0, top_logprobs as one {token text: logprob} dict per position."""
    toks = [tokenizer.decode([x]) for x in ids]
    offsets = []
    for s in toks:
        offsets.append(offset)
        offset += len(s)
    top = [{tokenizer.decode([a]): v for a, v in pos} for pos in tops] if tops is not None else None
    return {"tokens": toks, "token_logprobs": list(lps), "top_logprobs": top, "text_offset": offsets}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Generation:
    """One HTTP request's engine work: admission, the merged delta stream of its engine requests, the
    timings and token counts its metrics and access-log line report. `close()` is idempotent."""

    def __init__(
        self, state: ServeState, entry: ModelEntry, reqs: list[GenerationRequest], record: dict[str, Any]
    ) -> None:
        self.state, self.entry, self.reqs, self.record = state, entry, reqs, record
        self.arrival_s = time.perf_counter()
        self.admitted_s: float | None = None
        self.first_token_s: float | None = None
        self.last_token_s: dict[int, float] = {}
        self.prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
        self.completion_tokens = 0
        self.finishes: list[str] = []
        self.outcomes: list[str] = []
        self._slot = False
        self._closed = False
        self._iter: AsyncIterator[tuple[int, StreamDelta]] | None = None
        self._first: tuple[int, StreamDelta] | None = None
        self._labels = (entry.name, entry.mode)
        state.in_flight += 1

    async def start(self) -> None:
        """Take a running slot (429 when the queue is full) and wait for the first delta, so that an
        engine's refusal is still a 400 rather than a broken stream."""
        adm = self.state.admission(self.entry.name)
        m = self.state.metrics
        try:
            if adm.sem.locked() and adm.waiting >= adm.max_queue:
                raise APIError(
                    429,
                    f"the server's queue is full ({adm.waiting} request(s) waiting, max_queue {adm.max_queue}); retry later",
                    type="rate_limit_error",
                    code="queue_full",
                )
            adm.waiting += 1
            m.queue_length.labels(*self._labels).set(adm.waiting)
            try:
                await adm.sem.acquire()
            finally:
                adm.waiting -= 1
                m.queue_length.labels(*self._labels).set(adm.waiting)
            self._slot = True
            adm.running += 1
            m.running.labels(*self._labels).set(adm.running)
            self.admitted_s = time.perf_counter()
            m.queue_time.labels(*self._labels).observe(self.admitted_s - self.arrival_s)
            self._iter = self._merged()
            self._first = await self._iter.__anext__()
        except StopAsyncIteration:
            self._first = None
        except BadRequestError as err:
            await self.close()
            raise bad_request(str(err)) from None
        except BaseException:
            await self.close()
            raise

    async def _merged(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        engine = self.entry.engine
        if len(self.reqs) == 1:
            stream = engine.stream(self.reqs[0])
            try:
                async for d in stream:
                    yield 0, d
            finally:
                await stream.aclose()  # an early close aborts the request in the engine
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, req: GenerationRequest) -> None:
            try:
                async for d in engine.stream(req):
                    queue.put_nowait((i, d))
                queue.put_nowait((i, None))
            except BaseException as err:
                queue.put_nowait((i, err))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(self.reqs)]
        try:
            left = len(tasks)
            while left:
                i, item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def deltas(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        """(engine request index, delta) as they come, timed for the metrics."""
        if self._first is None or self._iter is None:
            return
        pending: tuple[int, StreamDelta] | None = self._first
        self._first = None
        while True:
            if pending is None:
                try:
                    pending = await self._iter.__anext__()
                except StopAsyncIteration:
                    return
            self._observe(*pending)
            yield pending
            pending = None

    def _observe(self, i: int, d: StreamDelta) -> None:
        now = time.perf_counter()
        m = self.state.metrics
        k = len(d.token_ids)
        key = i * 1_000_000 + d.index
        if k:
            if self.first_token_s is None:
                self.first_token_s = now
                m.ttft.labels(*self._labels).observe(now - self.arrival_s)
            prev = self.last_token_s.get(key)
            if prev is not None:
                gap = (now - prev) / k
                for _ in range(k):
                    m.itl.labels(*self._labels).observe(gap)
            self.last_token_s[key] = now
            self.completion_tokens += k
        if d.finish_reason is not None:
            self.finishes.append(d.finish_reason)

    def tool_outcome(self, outcome: str | None) -> None:
        if outcome is not None:
            self.outcomes.append(outcome)
            self.state.metrics.tool_calls.labels(*self._labels, outcome).inc()

    async def close(self, status: int = 200) -> None:
        if self._closed:
            return
        self._closed = True
        if self._iter is not None:
            await self._iter.aclose()
        m = self.state.metrics
        adm = self.state.admission(self.entry.name)
        if self._slot:
            adm.sem.release()
            adm.running -= 1
            m.running.labels(*self._labels).set(adm.running)
        self.state.in_flight -= 1
        now = time.perf_counter()
        m.prompt_tokens.labels(*self._labels).inc(self.prompt_tokens if self.admitted_s else 0)
        m.generation_tokens.labels(*self._labels).inc(self.completion_tokens)
        expected = len(self.reqs) * (self.reqs[0].params.n if self.reqs else 1)
        finished = len(self.finishes) == expected
        if self.admitted_s is not None:
            m.requests.labels(*self._labels, "finished" if finished else "aborted").inc()
            if finished:
                m.e2e.labels(*self._labels).observe(now - self.arrival_s)
        self.record.update(
            {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "queue_s": None if self.admitted_s is None else round(self.admitted_s - self.arrival_s, 6),
                "ttft_s": None
                if self.first_token_s is None
                else round(self.first_token_s - self.arrival_s, 6),
                "generation_s": round(now - self.arrival_s, 6),
                "finish_reasons": self.finishes,
                "aborted": self.admitted_s is not None and not finished,
                "tool_call_outcome": (self.outcomes[0] if len(set(self.outcomes)) == 1 else self.outcomes)
                if self.outcomes
                else None,
            }
        )


class _SSEResponse(StreamingResponse):
    """An SSE stream that, however it ends (done, client gone, server shutting down), closes its body
    generator and its generation: the engine then aborts what is still running and frees its blocks."""

    def __init__(self, body: AsyncIterator[str], gen: _Generation) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self._body = body
        self._gen = gen

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()  # type: ignore[attr-defined]
            await self._gen.close()


class _Observe:
    """Pure ASGI middleware: the HTTP status counter and one access-log line per request, after the
    last byte of the response (streams included)."""

    def __init__(self, app: Any, state: ServeState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record: dict[str, Any] = {"id": None, "method": scope["method"], "path": scope["path"]}
        scope.setdefault("state", {})["serve_record"] = record
        status = {"code": 500}
        t0 = time.perf_counter()

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.state.metrics.http_response(scope["path"], status["code"])
            if scope["path"].startswith("/v1/"):
                record["status"] = status["code"]
                record["latency_s"] = round(time.perf_counter() - t0, 6)
                log_access(record)


# ---- the app --------------------------------------------------------------------------------------


_DISCONNECT_POLL_S = 0.25
CLIENT_CLOSED = 499  # nginx's "client closed request": the status a request whose client left is logged with


async def _respond(request: Request, gen: Any, stream: bool, streamed: Any, whole: Any) -> Response:
    """Start the generation, then answer as SSE (the stream closes it) or as one JSON body. A client
    that disconnects while its whole body is being generated aborts the request in the engine (closing
    the generation frees its blocks), as a closed stream does."""
    await gen.start()
    if stream:
        return _SSEResponse(streamed(), gen)
    body = asyncio.ensure_future(whole())
    try:
        while True:
            done, _ = await asyncio.wait({body}, timeout=_DISCONNECT_POLL_S)
            if done:
                return JSONResponse(body.result())
            if await request.is_disconnected():
                body.cancel()
                await asyncio.gather(body, return_exceptions=True)
                return Response(status_code=CLIENT_CLOSED)
    finally:
        if not body.done():
            body.cancel()
            await asyncio.gather(body, return_exceptions=True)
        await gen.close()


def create_app(settings: ServeSettings | None = None, state: ServeState | None = None) -> FastAPI:
    """The ASGI app; add models with `app.state.serve.add_model(ModelEntry(...))` (until then: 503)."""
    state = state or ServeState(settings or ServeSettings())
    settings = state.settings
    app = FastAPI(title="posttrain", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        headers = {"retry-after": "1"} if err.status in (429, 503) else None
        record = request.scope.get("state", {}).get("serve_record")
        if record is not None:
            record["error"] = err.message[:300]
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if err.status_code == 404 else None
        msg = (
            f"no route {request.method} {request.url.path}"
            if err.status_code in (404, 405)
            else str(err.detail)
        )
        return JSONResponse(
            APIError(err.status_code, msg, code=kind).body(), status_code=err.status_code, headers=err.headers
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        body = APIError(500, "internal server error (see the server log)", type="server_error").body()
        return JSONResponse(body, status_code=500)

    def record_of(request: Request) -> dict[str, Any]:
        return request.scope.setdefault("state", {}).setdefault("serve_record", {})

    def guard(request: Request) -> None:
        if settings.api_key is not None:
            auth = request.headers.get("authorization", "")
            if not auth.lower().startswith("bearer "):
                raise APIError(
                    401,
                    "missing API key: send the header `Authorization: Bearer <key>`",
                    code="invalid_api_key",
                )
            if not hmac.compare_digest(auth[7:].strip().encode(), settings.api_key.encode()):
                raise APIError(401, "incorrect API key", code="invalid_api_key")
        if state.status == "loading":
            raise APIError(
                503, "the model is still loading; retry shortly", type="server_error", code="loading"
            )
        if state.status == "draining":
            raise APIError(
                503,
                "the server is shutting down (draining in-flight requests)",
                type="server_error",
                code="draining",
            )
        if state.status == "failed":
            raise APIError(
                503, f"the model failed to load: {state.error}", type="server_error", code="load_failed"
            )

    def entry_of(name: str) -> ModelEntry:
        entry = state.models.get(name)
        if entry is None:
            raise APIError(
                404,
                f"the model '{name}' does not exist here; served: {', '.join(state.models)}",
                param="model",
                code="model_not_found",
            )
        return entry

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {"status": state.status, "models": list(state.models), "in_flight": state.in_flight}
        if state.error:
            body["error"] = state.error
        return JSONResponse(body, status_code=200 if state.status == "ready" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        guard(request)
        data = [
            {
                "id": e.name,
                "object": "model",
                "created": e.created,
                "owned_by": "posttrain",
                "mode": e.mode,
                "max_model_len": e.max_model_len,
            }
            for e in state.models.values()
        ]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        guard(request)
        record = record_of(request)
        req: ChatCompletionRequest = _parse(
            ChatCompletionRequest, await _read_json(request, settings.max_body_bytes)
        )
        entry = entry_of(req.model)
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        record.update({"id": rid, "model": entry.name, "mode": entry.mode, "stream": req.stream})
        plan, params, gen = _chat_generation(state, req, entry, rid, record)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _respond(
            request,
            gen,
            req.stream,
            lambda: _chat_stream(gen, req, entry, plan, params, rid, include_usage),
            lambda: _chat_whole(gen, req, entry, plan, params, rid),
        )

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        guard(request)
        record = record_of(request)
        rreq: ResponsesRequest = _parse(ResponsesRequest, await _read_json(request, settings.max_body_bytes))
        entry = entry_of(rreq.model)
        rid = f"resp_{uuid.uuid4().hex[:24]}"
        record.update({"id": rid, "model": entry.name, "mode": entry.mode, "stream": rreq.stream})
        plan, params, gen = _chat_generation(state, to_chat_request(rreq), entry, rid, record)
        run = (gen, rreq, entry.chat_format, entry.name, plan, params, rid)
        return await _respond(
            request, gen, rreq.stream, lambda: response_events(*run), lambda: response_whole(*run)
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        guard(request)
        record = record_of(request)
        req: CompletionRequest = _parse(CompletionRequest, await _read_json(request, settings.max_body_bytes))
        entry = entry_of(req.model)
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        record.update({"id": rid, "model": entry.name, "mode": entry.mode, "stream": req.stream})
        if req.suffix:
            raise bad_request(
                "suffix (insertion) is not supported", param="suffix", code="unsupported_parameter"
            )
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request(
                "best_of other than n is not supported", param="best_of", code="unsupported_parameter"
            )
        p = req.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        else:
            prompts = list(p)
        if not prompts or len(prompts) > 64:
            raise bad_request("prompt must hold 1 to 64 prompts", param="prompt")
        id_lists = []
        for q in prompts:
            qids = entry.tokenizer.encode(q, add_special_tokens=False) if isinstance(q, str) else list(q)
            if not qids:
                raise bad_request("a prompt is empty; give at least one token", param="prompt")
            vocab = len(entry.tokenizer)
            if any(not 0 <= t < vocab for t in qids):
                raise bad_request(f"prompt token ids must lie in [0, {vocab})", param="prompt")
            id_lists.append(qids)
        reqs = [
            GenerationRequest(
                q,
                _sampling(req, entry, settings, len(q), req.max_tokens, top_logprobs=req.logprobs or 0),
                request_id=f"{rid}-{i}",
            )
            for i, q in enumerate(id_lists)
        ]
        gen = _Generation(state, entry, reqs, record)
        echo = [entry.tokenizer.decode(q) for q in id_lists] if req.echo else None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _respond(
            request,
            gen,
            req.stream,
            lambda: _completion_stream(gen, req, entry, reqs, rid, echo, include_usage),
            lambda: _completion_whole(gen, req, entry, reqs, rid, echo),
        )

    app.add_middleware(_Observe, state=state)
    return app


def _chat_generation(
    state: ServeState, req: ChatCompletionRequest, entry: ModelEntry, rid: str, record: dict[str, Any]
) -> tuple[ToolPlan, SamplingParams, _Generation]:
    """A chat request's tool plan, sampling and (not yet started) generation; 400s for what it asks wrongly."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    plan = plan_tools(req, entry.chat_format, entry.constrained)
    json_schema = _response_schema(req.response_format, plan) or plan.json_schema
    images: list[ImagePart] = []  # a vision model's image parts, behind their placeholders
    prompt = render_chat(req, entry.tokenizer, entry.chat_format, plan, images)
    ids = entry.tokenizer.encode(prompt, add_special_tokens=False)
    max_tokens = req.max_completion_tokens or req.max_tokens
    top = (req.top_logprobs or 0) if req.logprobs else 0
    params = _sampling(
        req, entry, state.settings, len(ids), max_tokens, top_logprobs=top, json_schema=json_schema
    )
    gen = _Generation(state, entry, [GenerationRequest(ids, params, request_id=rid, images=images)], record)
    return plan, params, gen


def _usage(gen: _Generation) -> dict[str, int]:
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "total_tokens": gen.prompt_tokens + gen.completion_tokens,
    }


async def _collect(gen: _Generation) -> dict[tuple[int, int], dict[str, Any]]:
    acc: dict[tuple[int, int], dict[str, Any]] = {}
    async for i, d in gen.deltas():
        c = acc.setdefault((i, d.index), {"ids": [], "lps": [], "tops": None, "text": "", "finish": None})
        c["ids"] += d.token_ids
        c["lps"] += d.logprobs
        if d.top_logprobs is not None:
            c["tops"] = (c["tops"] or []) + d.top_logprobs
        c["text"] += d.text
        if d.finish_reason is not None:
            c["finish"] = d.finish_reason
    return acc


async def _chat_whole(
    gen: _Generation,
    req: ChatCompletionRequest,
    entry: ModelEntry,
    plan: ToolPlan,
    params: SamplingParams,
    rid: str,
) -> dict[str, Any]:
    acc = await _collect(gen)
    choices = []
    for (_, j), c in sorted(acc.items()):
        text = ChoiceText(params.stop, False, plan.prefill)
        text.push(c["text"])
        full = finished_text(text.visible(), plan, c["finish"])
        view = view_reply(full, plan, entry.chat_format, f"call_{rid[-12:]}_{j}")
        gen.tool_outcome(view.outcome)
        message: dict[str, Any] = {"role": "assistant", "content": view.content}
        finish = c["finish"]
        if view.tool_calls:
            message["tool_calls"] = view.tool_calls
            finish = "tool_calls"
        choice: dict[str, Any] = {"index": j, "message": message, "finish_reason": finish, "logprobs": None}
        if req.logprobs:
            choice["logprobs"] = {"content": _token_logprobs(entry.tokenizer, c["ids"], c["lps"], c["tops"])}
        choices.append(choice)
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": entry.name,
        "choices": choices,
        "usage": _usage(gen),
        "system_fingerprint": f"posttrain-{entry.mode}-v{entry.engine.version}",
    }


async def _chat_stream(
    gen: _Generation,
    req: ChatCompletionRequest,
    entry: ModelEntry,
    plan: ToolPlan,
    params: SamplingParams,
    rid: str,
    include_usage: bool,
) -> AsyncIterator[str]:
    created = int(time.time())
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": entry.name}
    fingerprint = f"posttrain-{entry.mode}-v{entry.engine.version}"

    def chunk(j: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> str:
        obj = {
            **base,
            "system_fingerprint": fingerprint,
            "choices": [{"index": j, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        }
        if include_usage:
            obj["usage"] = None
        return _sse(obj)

    texts: dict[int, ChoiceText] = {}
    try:
        for j in range(params.n):
            texts[j] = ChoiceText(params.stop, plan.active, plan.prefill)
            yield chunk(j, {"role": "assistant", "content": ""})
        async for _, d in gen.deltas():
            t = texts[d.index]
            piece = t.push(d.text)
            lps = (
                {"content": _token_logprobs(entry.tokenizer, d.token_ids, d.logprobs, d.top_logprobs)}
                if req.logprobs
                else None
            )
            if piece or (lps and d.token_ids):
                yield chunk(d.index, {"content": piece} if piece else {}, logprobs=lps)
            if d.finish_reason is None:
                continue
            finish = d.finish_reason
            full = finished_text(t.visible(), plan, finish)
            if plan.active:
                view = view_reply(full, plan, entry.chat_format, f"call_{rid[-12:]}_{d.index}")
                gen.tool_outcome(view.outcome)
                if view.tool_calls:
                    for k, call in enumerate(view.tool_calls):
                        head = {"index": k, "id": call["id"], "type": "function"}
                        head["function"] = {"name": call["function"]["name"], "arguments": ""}
                        yield chunk(d.index, {"tool_calls": [head]})
                        args = {"index": k, "function": {"arguments": call["function"]["arguments"]}}
                        yield chunk(d.index, {"tool_calls": [args]})
                    finish = "tool_calls"
                elif full[t.sent :]:
                    yield chunk(d.index, {"content": full[t.sent :]})
            elif full[t.sent :]:
                yield chunk(d.index, {"content": full[t.sent :]})
            yield chunk(d.index, {}, finish)
        if include_usage:
            yield _sse({**base, "system_fingerprint": fingerprint, "choices": [], "usage": _usage(gen)})
        yield "data: [DONE]\n\n"
    except BadRequestError as err:
        yield _sse(bad_request(str(err)).body())
        yield "data: [DONE]\n\n"
    finally:
        await gen.close()


async def _completion_whole(
    gen: _Generation,
    req: CompletionRequest,
    entry: ModelEntry,
    reqs: list[GenerationRequest],
    rid: str,
    echo: list[str] | None,
) -> dict[str, Any]:
    acc = await _collect(gen)
    n = req.n
    choices = []
    for (i, j), c in sorted(acc.items()):
        t = ChoiceText(reqs[i].params.stop, False)
        t.push(c["text"])
        text = (echo[i] if echo else "") + t.visible()
        lp = None
        if req.logprobs is not None:
            lp = _legacy_logprobs(entry.tokenizer, c["ids"], c["lps"], c["tops"], len(echo[i]) if echo else 0)
        choices.append({"index": i * n + j, "text": text, "finish_reason": c["finish"], "logprobs": lp})
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": entry.name,
        "choices": choices,
        "usage": _usage(gen),
    }


async def _completion_stream(
    gen: _Generation,
    req: CompletionRequest,
    entry: ModelEntry,
    reqs: list[GenerationRequest],
    rid: str,
    echo: list[str] | None,
    include_usage: bool,
) -> AsyncIterator[str]:
    base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": entry.name}
    n = req.n

    def chunk(index: int, text: str, finish: str | None = None, logprobs: Any = None) -> str:
        choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
        obj = {**base, "choices": [choice]}
        if include_usage:
            obj["usage"] = None
        return _sse(obj)

    texts: dict[tuple[int, int], ChoiceText] = {}
    offsets: dict[tuple[int, int], int] = {}  # text offset of each choice's next token (legacy logprobs)
    try:
        if echo:
            for i, e in enumerate(echo):
                for j in range(n):
                    yield chunk(i * n + j, e)
        async for i, d in gen.deltas():
            t = texts.setdefault((i, d.index), ChoiceText(reqs[i].params.stop, False))
            piece = t.push(d.text)
            if d.finish_reason is not None:
                piece += t.visible()[t.sent :]
            lp = None
            if req.logprobs is not None and d.token_ids:
                start = offsets.get((i, d.index), len(echo[i]) if echo else 0)
                lp = _legacy_logprobs(entry.tokenizer, d.token_ids, d.logprobs, d.top_logprobs, start)
                offsets[(i, d.index)] = start + sum(len(s) for s in lp["tokens"])
            if piece or lp or d.finish_reason is not None:
                yield chunk(i * n + d.index, piece, d.finish_reason, lp)
        if include_usage:
            yield _sse({**base, "choices": [], "usage": _usage(gen)})
        yield "data: [DONE]\n\n"
    except BadRequestError as err:
        yield _sse(bad_request(str(err)).body())
        yield "data: [DONE]\n\n"
    finally:
        await gen.close()
