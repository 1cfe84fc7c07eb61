"""The OpenAI-compatible API through the real `openai` client against a live server: chat, streaming,
n, seeds, stops, tools (scripted engine), completions, usage equal to the tokenizer's counts, and the
error statuses in OpenAI's error shape."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from posttrain.engine import GenerationRequest, SamplingParams
from posttrain.models import encode_messages
from serve.conftest import MAX_MODEL_LEN, tiny_engine

HI = [{"role": "user", "content": "Say hello."}]
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]


def _greedy_reference(tiny_model, tokenizer, messages, max_tokens):
    ids = encode_messages(tokenizer, messages)
    engine = tiny_engine(tiny_model, tokenizer)
    out = engine.generate([GenerationRequest(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))])[0]
    return ids, out.completions[0]


def test_chat_is_the_engines_greedy_completion_and_usage_counts_the_template_tokens(
    client, tiny_model, tokenizer
):
    r = client.chat.completions.create(model="tiny", messages=HI, max_tokens=12, temperature=0, logprobs=True)
    ids, ref = _greedy_reference(tiny_model, tokenizer, HI, 12)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(ref.token_ids) == len(choice.logprobs.content)
    assert r.usage.total_tokens == len(ids) + len(ref.token_ids)
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(ref.logprobs, abs=1e-4)
    # max_completion_tokens is the newer name of the same limit
    r2 = client.chat.completions.create(model="tiny", messages=HI, max_completion_tokens=12, temperature=0)
    assert r2.choices[0].message.content == ref.text


def test_stream_deltas_join_to_the_whole_reply_and_end_with_usage(client):
    whole = client.chat.completions.create(model="tiny", messages=HI, max_tokens=16, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=HI,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_n_samples_share_a_request_and_usage_sums_them(client):
    r = client.chat.completions.create(
        model="tiny", messages=HI, max_tokens=10, temperature=1.0, n=3, seed=7, logprobs=True
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    assert len({c.message.content for c in r.choices}) > 1  # three different samples


def test_a_seed_reproduces_the_sample_and_another_seed_does_not(client):
    def sample(seed):
        r = client.chat.completions.create(
            model="tiny", messages=HI, max_tokens=20, temperature=1.0, seed=seed
        )
        return r.choices[0].message.content

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


def test_stop_strings_end_the_reply_and_are_left_out(client):
    def ask(**kw):
        return client.chat.completions.create(
            model="tiny", messages=HI, max_tokens=40, temperature=1.0, seed=3, **kw
        )

    full = ask().choices[0].message.content
    stop = full[10:13]
    assert len(stop) == 3
    expected = full[: full.find(stop)]
    r = ask(stop=[stop, "never-appears"])
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    streamed = ask(stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected


def test_a_named_tool_choice_returns_a_valid_call(client):
    msgs = [{"role": "user", "content": 'SAY:{"city": "Paris"}}]</tool_call>'}]
    r = client.chat.completions.create(
        model="scripted",
        messages=msgs,
        tools=WEATHER,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_auto_tool_calls_stream_as_fragments_keyed_by_index(client):
    reply = (
        'Checking.<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
        '{"name": "get_weather", "arguments": {"city": "Rome"}}]</tool_call>'
    )
    msgs = [{"role": "user", "content": "SAY:" + reply}]
    chunks = list(client.chat.completions.create(model="scripted", messages=msgs, tools=WEATHER, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls: dict[int, dict] = {}
    for c in chunks:
        for frag in c.choices[0].delta.tool_calls or []:
            slot = calls.setdefault(frag.index, {"name": "", "arguments": ""})
            slot["name"] += frag.function.name or ""
            slot["arguments"] += frag.function.arguments or ""
    assert content == "Checking."
    assert [(v["name"], json.loads(v["arguments"])) for _, v in sorted(calls.items())] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    # the same reply, whole, with parallel calls switched off: the first call only
    r = client.chat.completions.create(
        model="scripted", messages=msgs, tools=WEATHER, parallel_tool_calls=False
    )
    assert [json.loads(c.function.arguments) for c in r.choices[0].message.tool_calls] == [{"city": "Oslo"}]


def test_malformed_tool_markup_is_returned_as_text(client):
    raw = '<tool_call>[{"name": "get_weather", "arguments": {city: Paris}}]</tool_call>'
    r = client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "SAY:" + raw}], tools=WEATHER
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == raw
    assert r.choices[0].finish_reason == "stop"


def test_history_with_tool_calls_and_content_parts_renders(client):
    msgs = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "user", "content": [{"type": "text", "text": "SAY:It is sunny."}]},
    ]
    r = client.chat.completions.create(model="scripted", messages=msgs, tools=WEATHER)
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"


def test_completions_endpoint(client, tiny_model, tokenizer):
    r = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=0
    )
    ids = tokenizer.encode("Once upon a time", add_special_tokens=False)
    engine = tiny_engine(tiny_model, tokenizer)
    ref = engine.generate([GenerationRequest(ids, SamplingParams(temperature=0.0, max_tokens=8))])[
        0
    ].completions[0]
    assert r.object == "text_completion" and r.choices[0].text == ref.text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref.token_ids)
    assert r.choices[0].logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    many = client.completions.create(
        model="tiny", prompt=["a b", "c d e"], max_tokens=4, n=2, temperature=0, echo=True
    )
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[2].text.startswith("c d e")
    streamed = list(
        client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == ref.text


def _check_top(content, n: int) -> None:
    for entry in content:
        top = entry.top_logprobs
        assert len(top) == n
        assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:], strict=False))
        assert top[0].token == entry.token and top[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
        assert all(t.bytes == list(t.token.encode("utf-8")) for t in top)


def test_top_logprobs_in_chat_whole_and_streamed(client, tiny_model, tokenizer):
    r = client.chat.completions.create(
        model="tiny", messages=HI, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    ids, ref = _greedy_reference(tiny_model, tokenizer, HI, 8)
    assert len(content) == len(ref.token_ids) == r.usage.completion_tokens
    _check_top(content, 3)
    assert [e.token for e in content] == [tokenizer.decode([t]) for t in ref.token_ids]
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=HI, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, stream=True
        )
    )
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [[t.token for t in e.top_logprobs] for e in streamed] == [
        [t.token for t in e.top_logprobs] for e in content
    ]
    flat = lambda es: [t.logprob for e in es for t in e.top_logprobs]  # noqa: E731
    assert flat(streamed) == pytest.approx(flat(content), abs=1e-5)
    _check_top(streamed, 3)
    plain = client.chat.completions.create(
        model="tiny", messages=HI, max_tokens=4, temperature=0, logprobs=True
    )
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    # the speculative engine reports them for every emitted token too
    fast = client.chat.completions.create(
        model="tiny-fast", messages=HI, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    assert len(fast.choices[0].logprobs.content) == fast.usage.completion_tokens
    _check_top(fast.choices[0].logprobs.content, 2)


def test_completions_logprobs_n_gives_top_logprobs_per_position(client, tokenizer):
    r = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3  # distinct ids may decode to one text
        best = max(top, key=top.get)
        assert best == tok and top[best] == pytest.approx(tlp, abs=1e-6)
    streamed = list(
        client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=3, stream=True
        )
    )
    parts = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [t for p in parts for t in p.top_logprobs] == lp.top_logprobs
    assert [o for p in parts for o in p.text_offset] == lp.text_offset


def test_presence_and_frequency_penalties_reach_the_engine(live, client, tokenizer, tiny_model):
    body = dict(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0)
    plain = client.completions.create(**body)
    penalised = client.completions.create(**body, presence_penalty=1.5, frequency_penalty=0.7)
    prompt = tokenizer.encode("Once upon a time", add_special_tokens=False)
    params = SamplingParams(
        temperature=0.0, max_tokens=8, presence_penalty=1.5, frequency_penalty=0.7, stop_token_ids=[]
    )
    want = tiny_engine(tiny_model, tokenizer).generate([GenerationRequest(prompt, params)])[0].completions[0]
    assert penalised.choices[0].text == want.text != plain.choices[0].text


def test_models_lists_each_served_model_with_its_mode(client):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "scripted", "tiny-fast"}
    assert models["tiny"].model_dump()["mode"] == "standard"
    assert models["tiny-fast"].model_dump()["mode"] == "fast"
    assert models["tiny"].model_dump()["max_model_len"] == MAX_MODEL_LEN


# ---- errors -------------------------------------------------------------------------------------


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in resp.text
    return err


def test_invalid_requests_get_400_in_openai_shape(live):
    url = f"{live.url}/v1/chat/completions"
    post = lambda body: httpx.post(url, json=body, timeout=30)  # noqa: E731
    err = _error(httpx.post(url, content=b'{"model": "tiny", "messages": [', timeout=30), 400)
    assert "not valid JSON" in err["message"]
    assert "JSON object" in _error(post([1, 2]), 400)["message"]
    err = _error(post({"model": "tiny"}), 400)
    assert err["param"] == "messages" and "Field required" in err["message"]
    err = _error(post({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}), 400)
    assert err["param"].startswith("messages.0.role")
    assert "unknown field" in _error(post({"model": "tiny", "messages": HI, "bogus": 1}), 400)["message"]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    assert "text-only" in _error(post({"model": "tiny", "messages": image}), 400)["message"]
    err = _error(post({"model": "tiny", "messages": HI, "presence_penalty": 2.5}), 400)
    assert err["param"] == "presence_penalty"
    assert (
        post({"model": "tiny", "messages": HI, "presence_penalty": 0.5, "max_tokens": 1}).status_code == 200
    )
    err = _error(post({"model": "tiny", "messages": HI, "response_format": {"type": "json_schema"}}), 400)
    assert err["param"] == "response_format.json_schema" and "json_schema.schema" in err["message"]
    err = _error(post({"model": "tiny", "messages": HI, "logprobs": True, "top_logprobs": 21}), 400)
    assert err["param"] == "top_logprobs"
    err = _error(post({"model": "tiny", "messages": HI, "top_logprobs": 3}), 400)  # without logprobs: true
    assert err["param"] == "top_logprobs" and "logprobs: true" in err["message"]
    err = _error(
        post(
            {
                "model": "tiny",
                "messages": HI,
                "tools": WEATHER,
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            }
        ),
        400,
    )
    assert "nope" in err["message"]


def test_over_the_context_window_is_a_400_that_counts_tokens(client, tokenizer):
    long = [{"role": "user", "content": "word " * 600}]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=long, max_tokens=4)
    n = len(encode_messages(tokenizer, long))
    assert f"prompt is {n} tokens" in str(exc.value) and str(MAX_MODEL_LEN) in str(exc.value)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=HI, max_tokens=MAX_MODEL_LEN)
    n = len(encode_messages(tokenizer, HI))
    assert f"{n} in the prompt, {MAX_MODEL_LEN} for the completion" in str(exc.value)
    assert exc.value.body["code"] == "context_length_exceeded"


def test_unknown_model_is_404(client, live):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-9", messages=HI)
    assert exc.value.body["code"] == "model_not_found" and "gpt-9" in exc.value.body["message"]
    assert _error(httpx.get(f"{live.url}/v1/nowhere", timeout=30), 404)["code"] == "not_found"


def test_a_huge_body_is_refused_and_the_server_keeps_serving(live, client):
    huge = (
        b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"x" * (5 * 1024 * 1024) + b'"}]}'
    )
    err = _error(httpx.post(f"{live.url}/v1/chat/completions", content=huge, timeout=60), 413)
    assert err["code"] == "request_too_large"
    deep = b"[" * 100_000 + b"]" * 100_000
    _error(httpx.post(f"{live.url}/v1/chat/completions", content=deep, timeout=60), 400)
    assert client.chat.completions.create(model="tiny", messages=HI, max_tokens=2).choices
