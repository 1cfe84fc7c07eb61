"""response_format through the real `openai` client against the live server: json_object and json_schema
replies are the engine's constrained completions (valid JSON, valid under the schema, streamed equal to
whole), and what cannot be enforced is a 400 naming the keyword."""

from __future__ import annotations

import json

import httpx
import jsonschema

from posttrain.engine import GenerationRequest, SamplingParams
from posttrain.models import encode_messages
from serve.conftest import tiny_engine

ASK = [{"role": "user", "content": "Describe a user as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "user": {"type": "string", "maxLength": 8},
        "level": {"type": "integer", "minimum": 1, "maximum": 5},
        "role": {"enum": ["admin", "guest"]},
        "langs": {"type": "array", "items": {"enum": ["en", "fr"]}, "maxItems": 2},
    },
    "required": ["user", "level", "role", "langs"],
    "additionalProperties": False,
}
AS_SCHEMA = {"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA, "strict": True}}


def test_json_object_reply_is_the_engines_constrained_completion(client, tiny_model, tokenizer):
    r = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=40, temperature=0, response_format={"type": "json_object"}
    )
    ref = tiny_engine(tiny_model, tokenizer).generate(
        [
            GenerationRequest(
                encode_messages(tokenizer, ASK),
                SamplingParams(temperature=0.0, max_tokens=40, json_schema={"type": "object"}),
            )
        ]
    )[0]
    choice = r.choices[0]
    assert choice.message.content == ref.completions[0].text
    assert choice.finish_reason == ref.completions[0].finish_reason
    assert r.usage.completion_tokens == len(ref.completions[0].token_ids)
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # this random model opens a string it never closes: cut at max_tokens
        assert choice.message.content.startswith("{") and r.usage.completion_tokens == 40


def test_json_schema_replies_validate_whole_sampled_and_streamed(client):
    r = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=60, temperature=1.0, seed=3, n=3, response_format=AS_SCHEMA
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    whole = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=60, temperature=0, response_format=AS_SCHEMA
    )
    jsonschema.validate(json.loads(whole.choices[0].message.content), SCHEMA)
    stream = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=60, temperature=0, response_format=AS_SCHEMA, stream=True
    )
    chunks = list(stream)
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == whole.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == "stop"
    fast = client.chat.completions.create(  # int4 weights and prompt lookup: speculation skips it
        model="tiny-fast", messages=ASK, max_tokens=60, temperature=0, response_format=AS_SCHEMA
    )
    jsonschema.validate(json.loads(fast.choices[0].message.content), SCHEMA)


def test_what_cannot_be_enforced_is_a_400_naming_it(live):
    url = f"{live.url}/v1/chat/completions"

    def error(fmt: dict, **extra) -> dict:
        resp = httpx.post(
            url, json={"model": "tiny", "messages": ASK, "response_format": fmt, **extra}, timeout=30
        )
        assert resp.status_code == 400, resp.text
        return resp.json()["error"]

    err = error(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}}
    )
    assert (
        err["param"] == "response_format.json_schema.schema"
        and 'Unimplemented keys: ["not"]' in err["message"]
    )
    err = error(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "hue"}}}
    )
    assert "Unknown format: hue" in err["message"]
    err = error({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}})
    assert err["param"] == "response_format.json_schema"
    err = error({"type": "yaml"})
    assert err["param"].startswith("response_format")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    err = error({"type": "json_object"}, tools=tools)
    assert err["param"] == "response_format" and "tools" in err["message"]
    ok = httpx.post(
        url,
        json={
            "model": "tiny",
            "messages": ASK,
            "response_format": {"type": "json_object"},
            "tools": tools,
            "tool_choice": "none",
            "max_tokens": 2,
        },
        timeout=30,
    )
    assert ok.status_code == 200
