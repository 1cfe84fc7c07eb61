"""Forced tool choices and strict types through the real `openai` client against the live server, in
standard ("tiny") and fast ("tiny-fast": int4, prompt-lookup speculation) mode: a named or `required`
choice is decoded under the tools' JSON schemas, so the reply is a call whose arguments validate (the
engine's own constrained completion), `content` None, finish_reason "tool_calls", counted by the
tool-call metric; a string where a boolean or number belongs is OpenAI's 400 naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from posttrain.engine import GenerationRequest, SamplingParams
from posttrain.serve.chat import finished_text, plan_tools, render_chat, view_reply
from posttrain.serve.protocol import ChatCompletionRequest
from serve.conftest import tiny_engine
from serve.test_lifecycle import scrape, value

WEATHER_ARGS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
ADD_ARGS = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9},
        "b": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_ARGS}},
    {"type": "function", "function": {"name": "add", "parameters": ADD_ARGS}},
]
SCHEMAS = {"get_weather": WEATHER_ARGS, "add": ADD_ARGS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MODES = ["tiny", "tiny-fast"]


def _calls(choice) -> list[tuple[str, dict]]:
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    out = []
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


@pytest.mark.parametrize("model", MODES)
def test_a_named_choice_is_a_schema_valid_call_to_that_function(client, live, model):
    before = scrape(live.url)
    greedy = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0
    )
    sampled = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=1.0, seed=5, n=3
    )
    replies = [greedy.choices[0], *sampled.choices]
    assert [name for c in replies for name, _ in _calls(c)] == ["get_weather"] * 4
    after = scrape(live.url)
    mode = "standard" if model == "tiny" else "fast"
    labels = {"model": model, "mode": mode, "outcome": "ok"}
    name = "posttrain_serve_tool_calls_total"
    assert value(after, name, **labels) - value(before, name, **labels) == 4


def test_the_named_call_is_the_engines_completion_under_the_parameters_schema(client, tiny_model, tokenizer):
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0
    )
    req = ChatCompletionRequest.model_validate(
        {"model": "tiny", "messages": ASK, "tools": TOOLS, "tool_choice": NAMED}
    )
    plan = plan_tools(req, "smollm2")
    prompt = render_chat(req, tokenizer, "smollm2", plan)
    assert prompt.endswith('<tool_call>[{"name": "get_weather", "arguments": ')
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=512 - len(ids), json_schema=WEATHER_ARGS)
    ref = tiny_engine(tiny_model, tokenizer).generate([GenerationRequest(ids, params)])[0].completions[0]
    assert ref.finish_reason == "stop"
    (call,) = r.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == json.loads(ref.text)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref.token_ids)


@pytest.mark.parametrize("model", MODES)
def test_required_returns_a_call_among_the_tools(client, model):
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=2, n=4
    )
    calls = [_calls(c) for c in r.choices]
    assert all(len(c) >= 1 for c in calls)
    one = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=2,
        n=4,
    )
    assert [len(_calls(c)) for c in one.choices] == [1, 1, 1, 1]
    single = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS[1:], tool_choice="required", temperature=0
    )
    assert [n for n, _ in _calls(single.choices[0])] == ["add"]


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_a_forced_call_streams_as_the_whole_reply_does(client, choice):
    whole = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    calls: dict[int, dict] = {}
    for c in chunks:
        for frag in c.choices[0].delta.tool_calls or []:
            slot = calls.setdefault(frag.index, {"name": "", "arguments": ""})
            slot["name"] += frag.function.name or ""
            slot["arguments"] += frag.function.arguments or ""
    want = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert [(v["name"], v["arguments"]) for _, v in sorted(calls.items())] == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]


def test_a_forced_call_cut_by_max_tokens_is_text_with_finish_length(client):
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=3
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content.startswith('<tool_call>[{"name": "get_weather", "arguments": {')


def test_parameters_constrained_decoding_cannot_enforce_are_a_400_naming_the_tool(live):
    tools = [
        TOOLS[1],
        {"type": "function", "function": {"name": "neg", "parameters": {"type": "object", "not": {}}}},
    ]
    body = {"model": "tiny", "messages": ASK, "tools": tools, "tool_choice": "required"}
    resp = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == "tools.1.function.parameters" and 'Unimplemented keys: ["not"]' in err["message"]
    # naming the other tool needs only its schema; auto needs none enforced
    body["tool_choice"] = {"type": "function", "function": {"name": "add"}}
    assert httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=30).status_code == 200
    body["tool_choice"], body["max_tokens"] = "auto", 2
    assert httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=30).status_code == 200


@pytest.mark.parametrize(
    ("field", "bad", "expected", "got"),
    [
        ("logprobs", "yes", "a boolean", "a string"),
        ("logprobs", 1, "a boolean", "an integer"),
        ("stream", "false", "a boolean", "a string"),
        ("temperature", "0.5", "a number", "a string"),
        ("max_tokens", "5", "an integer", "a string"),
        ("max_tokens", 5.5, "an integer", "a number"),
        ("n", True, "an integer", "a boolean"),
    ],
)
def test_a_wrong_json_type_is_openais_400_naming_the_field(client, field, bad, expected, got):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(**{"model": "tiny", "messages": ASK, "max_tokens": 2, field: bad})
    assert exc.value.status_code == 400
    assert exc.value.body["param"] == field and exc.value.body["code"] == "invalid_type"
    assert (
        exc.value.body["message"] == f"Invalid type for '{field}': expected {expected}, but got {got} instead"
    )


def test_an_integer_is_a_number(client):
    r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2, temperature=1, top_p=1)
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("chat_format", ["smollm2", "hermes"])
def test_a_forced_calls_json_closed_by_the_plan_parses_in_either_syntax(chat_format):
    args = {"city": "Oslo", "unit": "c", "days": 2}
    named = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": ASK, "tools": TOOLS, "tool_choice": NAMED}
    )
    plan = plan_tools(named, chat_format)
    assert plan.json_schema == WEATHER_ARGS
    full = finished_text(plan.prefill + json.dumps(args), plan, "stop")
    view = view_reply(full, plan, chat_format, "call_x")
    assert view.outcome == "ok" and view.content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in view.tool_calls] == [
        ("get_weather", args)
    ]
    # cut by max_tokens: no closing markup, the text stays content
    cut = finished_text(plan.prefill + '{"city": "Os', plan, "length")
    assert view_reply(cut, plan, chat_format, "call_x").content == cut
    required = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": ASK,
            "tools": TOOLS,
            "tool_choice": "required",
            "parallel_tool_calls": False,
        }
    )
    plan = plan_tools(required, chat_format)
    call = {"name": "add", "arguments": {"a": 1, "b": 2}}
    body = json.dumps([call] if chat_format == "smollm2" else call)
    jsonschema.validate(json.loads(body), plan.json_schema)
    view = view_reply(finished_text(plan.prefill + body, plan, "stop"), plan, chat_format, "call_x")
    assert view.outcome == "ok" and [c["function"]["name"] for c in view.tool_calls] == ["add"]
