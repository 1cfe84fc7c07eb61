"""The Responses API through the real `openai` client (`client.responses.create`) against the live
server: text equal to the engine's greedy completion with usage counted as chat counts it, a forced
function call as a `function_call` item (standard and fast mode), a conversation of input items equal
to the same conversation sent to chat, the documented event stream (each event valid under the
`openai` package's own types), and 400s for what it cannot serve."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from serve.test_api import _greedy_reference
from serve.test_tool_choice import WEATHER_ARGS

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "weather for a city",
        "parameters": WEATHER_ARGS,
    }
]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "weather for a city", "parameters": WEATHER_ARGS},
    }
]
NAMED = {"type": "function", "name": "get_weather"}
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
TEXT_DONE = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
CALL_EVENTS = [
    "response.output_item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
]


def test_text_is_the_engines_greedy_completion_with_usage(client, tiny_model, tokenizer):
    r = client.responses.create(
        model="tiny", input="Say hello.", instructions="Be brief.", max_output_tokens=12, temperature=0
    )
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    ids, ref = _greedy_reference(tiny_model, tokenizer, msgs, 12)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant"
    assert [p.type for p in item.content] == ["output_text"] and r.output_text == ref.text
    assert r.usage.input_tokens == len(ids) and r.usage.output_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == len(ids) + len(ref.token_ids)
    if ref.finish_reason == "length":
        assert r.status == item.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == item.status == "completed" and r.incomplete_details is None
    Response.model_validate(r.model_dump(mode="json"))  # every field the package requires is there


@pytest.mark.parametrize("model", ["tiny", "tiny-fast"])
def test_a_named_choice_returns_a_function_call_item(client, model):
    r = client.responses.create(
        model=model, input="Weather in Paris?", tools=TOOLS, tool_choice=NAMED, temperature=0
    )
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER_ARGS)
    assert r.status == "completed" and r.output_text == ""
    required = client.responses.create(
        model=model, input="Weather in Paris?", tools=TOOLS, tool_choice="required", temperature=1.0
    )
    assert [i.type for i in required.output] == ["function_call"] * len(required.output) and required.output
    for item in required.output:
        jsonschema.validate(json.loads(item.arguments), WEATHER_ARGS)


def test_text_format_json_schema_is_enforced(client):
    from serve.test_response_format import SCHEMA

    fmt = {"type": "json_schema", "name": "user", "schema": SCHEMA, "strict": True}
    r = client.responses.create(
        model="tiny",
        input="Describe a user as JSON.",
        text={"format": fmt},
        temperature=0,
        max_output_tokens=60,
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"


def test_input_items_mean_the_same_conversation_as_chat(client):
    first = client.responses.create(
        model="tiny", input="Weather in Paris?", tools=TOOLS, tool_choice=NAMED, temperature=0
    )
    (call,) = first.output
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
    ]
    r = client.responses.create(
        model="tiny", instructions="Be brief.", input=items, tools=TOOLS, max_output_tokens=10, temperature=0
    )
    chat = client.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "name": "get_weather", "content": "sunny, 21 C"},
        ],
        tools=CHAT_TOOLS,
        max_tokens=10,
        temperature=0,
    )
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.output_text == (chat.choices[0].message.content or "")


def test_a_text_stream_is_the_documented_event_sequence(client):
    whole = client.responses.create(model="tiny", input="Say hello.", max_output_tokens=12, temperature=0)
    events = list(
        client.responses.create(
            model="tiny", input="Say hello.", max_output_tokens=12, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    n = kinds.count("response.output_text.delta")
    end = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds == [*TEXT_EVENTS, *["response.output_text.delta"] * n, *TEXT_DONE, end] and n >= 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final.output_text == text and final.usage.model_dump() == whole.usage.model_dump()


def test_a_function_call_stream_and_every_event_validates(live, client):
    whole = client.responses.create(
        model="tiny", input="Weather in Paris?", tools=TOOLS, tool_choice=NAMED, temperature=0
    )
    body = {
        "model": "tiny",
        "input": "Weather in Paris?",
        "tools": TOOLS,
        "tool_choice": NAMED,
        "temperature": 0,
        "stream": True,
    }
    raw = []
    with httpx.stream("POST", f"{live.url}/v1/responses", json=body, timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in resp.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                raw.append(data)
    adapter = TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_python(e) for e in raw]
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        *CALL_EVENTS,
        "response.completed",
    ]
    (want,) = whole.output
    done = events[5].item
    assert (done.name, done.arguments) == (want.name, want.arguments)
    assert events[3].delta == events[4].arguments == want.arguments
    assert [i.type for i in events[-1].response.output] == ["function_call"]


def test_what_it_cannot_serve_is_a_400_naming_the_field(client, live):
    def error(**kw) -> dict:
        with pytest.raises(openai.BadRequestError) as exc:
            client.responses.create(model="tiny", **kw)
        return exc.value.body

    err = error(input="hi", previous_response_id="resp_123")
    assert err["param"] == "previous_response_id" and "stores no responses" in err["message"]
    err = error(input=[{"type": "function_call_output", "call_id": "call_9", "output": "x"}])
    assert err["param"] == "input.0.call_id" and "call_9" in err["message"]
    err = error(input=[{"type": "reasoning", "id": "rs_1", "summary": []}])
    assert err["param"] == "input.0" and "'type=function_call'" in err["message"]
    err = error(input="hi", tools=[{"type": "web_search"}])
    assert err["param"].startswith("tools.0")
    err = error(input="hi", temperature="0.2")
    assert err["message"] == "Invalid type for 'temperature': expected a number, but got a string instead"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-9", input="hi")


def test_text_then_calls_are_a_message_item_then_function_call_items(client):
    reply = (
        'Checking.<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c", "days": 1}}, '
        '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "f", "days": 2}}]</tool_call>'
    )
    r = client.responses.create(model="scripted", input="SAY:" + reply, tools=TOOLS)
    assert [i.type for i in r.output] == ["message", "function_call", "function_call"]
    assert r.output_text == "Checking."
    assert [json.loads(i.arguments)["city"] for i in r.output[1:]] == ["Oslo", "Rome"]
    assert len({i.call_id for i in r.output[1:]}) == 2
    events = list(client.responses.create(model="scripted", input="SAY:" + reply, tools=TOOLS, stream=True))
    kinds = [e.type for e in events]
    n = kinds.count("response.output_text.delta")
    assert kinds == [
        *TEXT_EVENTS,
        *["response.output_text.delta"] * n,
        *TEXT_DONE,
        *CALL_EVENTS,
        *CALL_EVENTS,
        "response.completed",
    ]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Checking."
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1, 2]
    final = events[-1].response
    assert [(i.type, getattr(i, "arguments", None)) for i in final.output] == [
        (i.type, getattr(i, "arguments", None)) for i in r.output
    ]
