"""The server's lifecycle and monitoring: auth (401), a full queue (429), loading (503), a client that
disconnects mid-stream (the engine frees the request's KV blocks), /metrics counters against the
replies, the Grafana dashboard's metric names, the access log, and SIGTERM draining a real
`posttrain serve` process to exit 0."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from posttrain.serve import ModelEntry, ServeSettings, ServeState
from serve.conftest import ScriptedEngine, start_server

HI = [{"role": "user", "content": "Say hello."}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
ROOT = Path(__file__).resolve().parents[2]


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_count_the_tokens_the_replies_report_and_tool_outcomes(live, client):
    before = scrape(live.url)
    usages = []
    usages.append(
        client.chat.completions.create(model="tiny", messages=HI, max_tokens=9, temperature=0).usage
    )
    stream = client.chat.completions.create(
        model="tiny",
        messages=HI,
        max_tokens=7,
        n=2,
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    usages.append([c for c in stream][-1].usage)
    usages.append(client.completions.create(model="tiny", prompt="abc", max_tokens=5, temperature=0).usage)
    outcomes = {
        "ok": '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>',
        "invalid_json": '<tool_call>[{"name": "add", "arguments": {a: 1}}]</tool_call>',
        "unknown_tool": '<tool_call>[{"name": "mul", "arguments": {"a": 1, "b": 2}}]</tool_call>',
        "schema_violation": '<tool_call>[{"name": "add", "arguments": {"a": "one"}}]</tool_call>',
    }
    for reply in outcomes.values():
        msgs = [{"role": "user", "content": "SAY:" + reply}]
        client.chat.completions.create(model="scripted", messages=msgs, tools=TOOLS)
    required = [{"role": "user", "content": "SAY:I will not call anything."}]
    r = client.chat.completions.create(
        model="scripted", messages=required, tools=TOOLS, tool_choice="required"
    )
    assert r.choices[0].message.tool_calls is None
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=HI)
    after = scrape(live.url)

    tiny = {"model": "tiny", "mode": "standard"}
    gen = "posttrain_serve_generation_tokens_total"
    assert value(after, gen, **tiny) - value(before, gen, **tiny) == sum(u.completion_tokens for u in usages)
    pt = "posttrain_serve_prompt_tokens_total"
    assert value(after, pt, **tiny) - value(before, pt, **tiny) == sum(u.prompt_tokens for u in usages)
    scripted = {"model": "scripted", "mode": "standard"}
    for outcome in [*outcomes, "none_when_required"]:
        name = "posttrain_serve_tool_calls_total"
        assert (
            value(after, name, **scripted, outcome=outcome) - value(before, name, **scripted, outcome=outcome)
            == 1
        )
    ttft = "posttrain_serve_time_to_first_token_seconds_count"
    assert value(after, ttft, **tiny) - value(before, ttft, **tiny) == 3
    e2e = "posttrain_serve_e2e_latency_seconds_count"
    assert value(after, e2e, **tiny) - value(before, e2e, **tiny) == 3
    itl = "posttrain_serve_inter_token_latency_seconds_count"
    assert (
        value(after, itl, **tiny) - value(before, itl, **tiny) == sum(u.completion_tokens for u in usages) - 4
    )
    http = "posttrain_serve_http_responses_total"
    assert (
        value(after, http, endpoint="/v1/chat/completions", status="404")
        - value(before, http, endpoint="/v1/chat/completions", status="404")
        == 1
    )
    assert value(after, "posttrain_serve_running_requests", **tiny) == 0
    assert value(after, "posttrain_serve_kv_cache_usage_ratio", **tiny) == 0


def test_speculation_counters_are_the_fast_engines_counts(live, client):
    engine = live.state.models["tiny-fast"].engine
    # the tiny random model mostly repeats its last token, so prompt lookup drafts and is accepted
    r = client.completions.create(model="tiny-fast", prompt="a b a b a b a b", max_tokens=24, temperature=0)
    assert r.usage.completion_tokens > 0
    m, stats = scrape(live.url), engine.speculation_stats()
    fast = {"model": "tiny-fast", "mode": "fast"}
    assert stats["draft_tokens"] > 0
    assert value(m, "posttrain_serve_spec_draft_tokens_total", **fast) == stats["draft_tokens"]
    assert value(m, "posttrain_serve_spec_accepted_tokens_total", **fast) == stats["accepted_tokens"]
    ratio = stats["accepted_tokens"] / stats["draft_tokens"]
    assert value(m, "posttrain_serve_spec_acceptance_ratio", **fast) == pytest.approx(ratio)
    assert ("posttrain_serve_spec_draft_tokens_total", (("mode", "standard"), ("model", "tiny"))) not in m


def test_the_grafana_dashboard_queries_only_exported_metrics(live):
    dash = json.loads((ROOT / "docs" / "grafana-posttrain.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    names = {n for e in exprs for n in re.findall(r"\b(posttrain_[a-z_]+)\b", e)}
    exported = {name for name, _ in scrape(live.url)}
    assert len(names) >= 10 and names <= exported, names - exported
    assert {"posttrain_serve_tool_calls_total", "posttrain_serve_kv_cache_usage_ratio"} <= names


def test_each_request_writes_one_json_access_log_line(client, caplog):
    with caplog.at_level(logging.INFO, logger="posttrain.serve.access"):
        r = client.chat.completions.create(model="tiny", messages=HI, max_tokens=3, temperature=0)
        deadline = time.monotonic() + 5
        while not any(r.id in rec.getMessage() for rec in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.01)
    line = next(json.loads(rec.getMessage()) for rec in caplog.records if r.id in rec.getMessage())
    assert line["model"] == "tiny" and line["mode"] == "standard" and line["status"] == 200
    assert (
        line["prompt_tokens"] == r.usage.prompt_tokens
        and line["completion_tokens"] == r.usage.completion_tokens
    )
    assert line["ttft_s"] > 0 and line["latency_s"] >= line["ttft_s"] and line["tool_call_outcome"] is None


def _aborted_and_freed(live, engine, before: dict, asked: int) -> dict:
    """Wait until the engine holds no blocks and no work; check one aborted request that generated fewer
    tokens than `asked`; return the metrics after."""
    deadline = time.monotonic() + 20
    while (
        engine.kv_stats()["blocks_allocated"] or engine.scheduler.has_work()
    ) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.kv_stats()["blocks_allocated"] == 0 and not engine.scheduler.has_work()
    after = scrape(live.url)
    tiny = {"model": "tiny", "mode": "standard"}
    aborted = "posttrain_serve_requests_total"
    assert (
        value(after, aborted, **tiny, finish="aborted") - value(before, aborted, **tiny, finish="aborted")
        == 1
    )
    generated = value(after, "posttrain_serve_generation_tokens_total", **tiny) - value(
        before, "posttrain_serve_generation_tokens_total", **tiny
    )
    assert 0 < generated < asked
    return after


def test_a_client_gone_mid_stream_aborts_the_request_and_frees_its_blocks(live):
    engine = live.state.models["tiny"].engine
    before = scrape(live.url)
    body = {"model": "tiny", "messages": HI, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(8)]
        assert any('"content"' in g for g in got)
        assert engine.kv_stats()["blocks_allocated"] > 0
    _aborted_and_freed(live, engine, before, 400)


def test_a_client_gone_before_its_whole_reply_aborts_the_request(live):
    engine = live.state.models["tiny"].engine
    before = scrape(live.url)
    body = {"model": "tiny", "messages": HI, "max_tokens": 450, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
    after = _aborted_and_freed(live, engine, before, 450)
    http = "posttrain_serve_http_responses_total"
    closed = {"endpoint": "/v1/chat/completions", "status": "499"}
    assert value(after, http, **closed) - value(before, http, **closed) == 1


def test_an_api_key_is_required_when_set(tokenizer):
    state = ServeState(ServeSettings(api_key="s3cret"))
    state.add_model(ModelEntry("scripted", ScriptedEngine(tokenizer), tokenizer))
    srv = start_server(state)
    try:
        for key in (None, "wrong"):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = httpx.get(f"{srv.url}/v1/models", headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="s3cret", max_retries=0)
        msgs = [{"role": "user", "content": "SAY:fine"}]
        assert (
            ok.chat.completions.create(model="scripted", messages=msgs).choices[0].message.content == "fine"
        )
        assert httpx.get(f"{srv.url}/health", timeout=30).status_code == 200  # probes need no key
    finally:
        srv.stop()


def test_a_full_queue_answers_429(tokenizer):
    gate = threading.Event()
    state = ServeState(ServeSettings(max_running=1, max_queue=1))
    state.add_model(ModelEntry("slow", ScriptedEngine(tokenizer, gate=gate), tokenizer))
    srv = start_server(state)
    body = {"model": "slow", "messages": [{"role": "user", "content": "SAY:done"}]}
    results: list[int] = []

    def post() -> None:
        results.append(httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60).status_code)

    try:
        threads = [threading.Thread(target=post) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while state.in_flight < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        m = scrape(srv.url)
        assert value(m, "posttrain_serve_running_requests", model="slow", mode="standard") == 1
        assert value(m, "posttrain_serve_queue_length", model="slow", mode="standard") == 1
        third = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
        assert third.status_code == 429 and third.json()["error"]["code"] == "queue_full"
        gate.set()
        for t in threads:
            t.join(30)
        assert results == [200, 200]
    finally:
        gate.set()
        srv.stop()


def test_503_while_loading_then_ready(tokenizer):
    state = ServeState(ServeSettings())
    srv = start_server(state)
    try:
        r = httpx.get(f"{srv.url}/v1/models", timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        assert httpx.get(f"{srv.url}/health", timeout=30).json()["status"] == "loading"
        state.add_model(ModelEntry("scripted", ScriptedEngine(tokenizer), tokenizer))
        assert httpx.get(f"{srv.url}/health", timeout=30).status_code == 200
        assert httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"][0]["id"] == "scripted"
        state.begin_drain()
        r = httpx.post(
            f"{srv.url}/v1/chat/completions", json={"model": "scripted", "messages": HI}, timeout=30
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
    finally:
        srv.stop()


def test_mode_both_serves_name_and_name_fast_from_one_load():
    from posttrain.config import load_config
    from posttrain.serve import load_entries, resolve_source

    cfg = load_config(None, ["engine.dtype=float32", "engine.num_kv_blocks=64", "engine.max_model_len=256"])
    source = resolve_source("tiny:llama", cfg, [])
    both = load_entries(source, "both")
    assert [(e.name, e.mode) for e in both] == [("tiny:llama", "standard"), ("tiny:llama-fast", "fast")]
    std, fast = (e.engine for e in both)
    assert (std.runner.weight_quant, std.speculative) == ("none", "none")
    assert (fast.runner.weight_quant, fast.speculative) == ("int4", "ngram")  # serve.fast's defaults
    assert std.runner.embed is not fast.runner.embed  # two engines, each its own copy of the weights
    (only_fast,) = load_entries(source, "fast")
    assert (only_fast.name, only_fast.mode) == ("tiny:llama", "fast")
    with pytest.raises(ValueError, match="mode must be one of standard, fast, both"):
        load_entries(source, "turbo")


def test_serve_rejects_an_unknown_mode():
    from typer.testing import CliRunner

    from posttrain.cli import app

    out = CliRunner().invoke(app, ["serve", "tiny:llama", "--mode", "turbo"])
    assert out.exit_code == 2 and "--mode must be one of standard, fast, both" in out.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_in_flight_streams_then_exits_0(tmp_path):
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "posttrain",
        "serve",
        "tiny:llama",
        "--port",
        str(port),
        "--set",
        "engine.max_model_len=1024",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server never became ready"
            time.sleep(0.2)
        body = {"model": "tiny:llama", "messages": HI, "max_tokens": 900, "ignore_eos": True, "stream": True}
        events: list[str] = []
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            while len(events) < 3:
                line = next(lines)
                if line:
                    events.append(line)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.1)
            late_status = httpx.get(f"{url}/v1/models", timeout=10).status_code
            events.extend(line for line in lines if line)
        assert late_status == 503  # draining: new requests are refused while the stream runs on
        assert events[-1] == "data: [DONE]"
        finishes = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
        assert finishes.count("length") == 1
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bind_socket_names_a_port_in_use():
    from posttrain.serve import BindError, bind_socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BindError) as exc:
            bind_socket("127.0.0.1", port)
        assert exc.value.strerror == (
            f"127.0.0.1:{port} is already in use (another process listens there); stop it or pick another --port"
        )
    sock = bind_socket("127.0.0.1", port)  # free again
    assert sock.getsockname() == ("127.0.0.1", port)
    sock.close()


def test_a_port_in_use_exits_1_before_the_model_resolves_or_loads(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # a model that does not exist: had it been resolved first this would exit 2 naming it
        for model in ["tiny:llama", str(tmp_path / "no-such-model")]:
            cmd = [sys.executable, "-m", "posttrain", "serve", model, "--port", str(port)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
            assert out.returncode == 1, out.stderr
            assert out.stdout == ""
            assert out.stderr.strip() == (
                f"error: 127.0.0.1:{port} is already in use (another process listens there); stop it or "
                "pick another --port"
            )
