"""The pipeline's model clients: `ApiModel` sends response_format json_schema, falls back to plain
prompting for good when a server answers 400, and reports usage; non-200 and non-completion bodies
are errors naming the server. `EngineModel` on a tiny random model runs a document through map-reduce
(slow: it builds an engine)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from posttrain.apps.docs.analyze import ApiModel, analyze
from posttrain.apps.docs.parse import parse_document
from posttrain.apps.docs.store import UsageError
from posttrain.envs.domains import docs_financial as df

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _server(accepts_schema: bool, seen: list[dict]):
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if "response_format" in body and not accepts_schema:
            return httpx.Response(400, json={"error": {"message": "response_format is not supported"}})
        msg = {"role": "assistant", "content": '{"a": 7}'}
        return httpx.Response(
            200, json={"choices": [{"message": msg}], "usage": {"prompt_tokens": 11, "completion_tokens": 3}}
        )

    return httpx.MockTransport(handle)


@pytest.mark.parametrize("accepts", [True, False])
def test_response_format_and_the_400_fallback(accepts):
    seen: list[dict] = []
    m = ApiModel("http://x/v1", "m", 4096, transport=_server(accepts, seen))
    msgs = [{"role": "user", "content": "hi"}]
    for _ in range(2):
        reply = asyncio.run(m.complete(msgs, 16, SCHEMA))
        assert (reply.text, reply.prompt_tokens, reply.completion_tokens) == ('{"a": 7}', 11, 3)
    sent = ["response_format" in b for b in seen]
    if accepts:
        assert sent == [True, True]
        assert seen[0]["response_format"] == {
            "type": "json_schema",
            "json_schema": {"name": "extraction", "schema": SCHEMA},
        }
    else:
        assert sent == [True, False, False]  # one refused try, then plain prompting for good
    assert m.json_schema_supported is accepts


def test_server_errors_name_the_server():
    bad = httpx.MockTransport(lambda r: httpx.Response(503, text="overloaded"))
    m = ApiModel("http://x/v1", "m", 4096, transport=bad)
    with pytest.raises(RuntimeError, match="http://x/v1#m answered 503: overloaded"):
        asyncio.run(m.complete([{"role": "user", "content": "hi"}], 8, None))
    junk = httpx.MockTransport(lambda r: httpx.Response(200, json={"nope": 1}))
    m = ApiModel("http://x/v1", "m", 4096, transport=junk)
    with pytest.raises(RuntimeError, match="not a chat completion"):
        asyncio.run(m.complete([{"role": "user", "content": "hi"}], 8, None))
    with pytest.raises(UsageError, match="not an http"):
        ApiModel("localhost:8000", "m", 4096)


@pytest.mark.slow
def test_engine_model_map_reduces_a_long_document():
    from posttrain.apps.docs.analyze import EngineModel

    m = EngineModel("tiny:llama", max_model_len=1024)
    doc = parse_document(df.generate_report(1, 2048).markdown().encode(), "a.md")
    res = asyncio.run(analyze(doc, df.EXTRACTION_SCHEMA, ["Which company?"], m, max_new_tokens=32))
    assert res.mode == "map_reduce" and res.n_chunks >= 3
    assert (
        res.model_calls == 2 * res.n_chunks or res.model_calls > res.n_chunks
    )  # extraction (+repairs) and QA
    assert res.prompt_tokens > 2048 and 0 < res.completion_tokens <= res.model_calls * 32
    assert len(res.answers) == 1
