"""The serve benchmark: its figures on a live tiny-model server, its streaming client's error counting, its
summaries against hand-computed values, and its usage errors."""

from __future__ import annotations

import asyncio
import importlib.util
import json

import httpx
import pytest

from posttrain.bench import serve as bench
from posttrain.cli.bench import run_bench


def test_bench_serve_on_a_tiny_model_reports_the_named_figures():
    out = run_bench(
        "serve",
        [
            "--model",
            "tiny:llama",
            "--clients",
            "1,2",
            "--requests-per-client",
            "1",
            "--max-tokens",
            "8",
            "--quality-n",
            "2",
            "--suite",
            "math",
            "--agreement-prompts",
            "4",
            "--agreement-tokens",
            "8",
        ],
    )
    json.dumps(out, allow_nan=False)  # strict JSON: no NaN
    assert out["errors"] == 0 and out["server_exit_status"] == 0  # SIGTERM drained, exit 0
    for mode in ("standard", "fast"):
        for workload in ("serving", "agentic"):
            for c in ("1", "2"):
                assert out["tok_s"][mode][workload][c] > 0
                assert out["ttft_ms"][mode][workload][c]["p50"] <= out["ttft_ms"][mode][workload][c]["p99"]
            # agentic replies may be a forced tool call, sent whole in one chunk: no gap to time
            assert out["itl_ms"][mode]["serving"][c]["p50"] > 0
        assert out["tok_s"][mode]["1"] == out["tok_s"][mode]["serving"]["1"]  # the flat serving view
    assert out["fast_vs_standard_1"] == pytest.approx(
        out["tok_s"]["fast"]["serving"]["1"] / out["tok_s"]["standard"]["serving"]["1"]
    )
    assert out["fast_vs_standard_agentic_2"] == pytest.approx(
        out["tok_s"]["fast"]["agentic"]["2"] / out["tok_s"]["standard"]["agentic"]["2"]
    )
    assert out["fast_vs_standard_8"] is None  # 8 clients were not measured
    runs = {(r["mode"], r["workload"], r["clients"]): r for r in out["runs"]}
    assert len(runs) == 8 and runs[("fast", "serving", 2)]["requests"] == 2
    assert runs[("standard", "serving", 1)]["completion_tokens"] == 8  # usage: exactly max_tokens
    assert 0.0 <= out["greedy_agreement"] <= 1.0 and 0.0 <= out["greedy_prefix_agreement"] <= 1.0
    assert out["greedy_agreement_detail"]["compared"] == 4
    assert isinstance(out["quality_delta_points"], float)
    assert out["quality"]["n_tasks"] == 4 and out["quality"]["infra_failures"] == {"standard": 0, "fast": 0}
    assert (
        out["engine"]["fast"]["weight_quant"] == "int4"
        and out["engine"]["standard"]["weight_quant"] == "none"
    )
    assert out["figures_are"] == "single runs"
    assert out["machine"]["cores"] >= 1 and len(out["machine"]["loadavg_start"]) == 3
    if importlib.util.find_spec("llama_cpp") is None:
        assert out["llamacpp_tok_s_1"] is None and out["llamacpp_note"] == bench.LLAMACPP_MISSING


@pytest.mark.parametrize("clients", ["0", "abc", "1,,-2"])
def test_bad_clients_is_a_usage_error_naming_the_option(clients, capsys):
    with pytest.raises(SystemExit) as exc:
        run_bench("serve", ["--clients", clients])
    assert exc.value.code == 2
    assert "--clients" in capsys.readouterr().err


def test_bad_workload_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        run_bench("serve", ["--workloads", "serving,chatty"])
    assert exc.value.code == 2 and "--workloads" in capsys.readouterr().err


def _sse(*objs: object) -> bytes:
    return b"".join(f"data: {o if isinstance(o, str) else json.dumps(o)}\n\n".encode() for o in objs)


def _chunk(delta: dict, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], "usage": None}


def _stream(handler) -> bench.RequestResult:
    async def go() -> bench.RequestResult:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench.test") as client:
            return await bench.stream_chat(client, {"model": "m"}, timeout_s=10.0)

    return asyncio.run(go())


def test_stream_chat_times_chunks_and_takes_tokens_from_usage():
    body = _sse(
        _chunk({"role": "assistant", "content": ""}),  # not a content delta: no first token yet
        _chunk({"content": "Hello"}),
        _chunk({"content": " wor"}),
        _chunk({"content": "ld"}, "stop"),
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}},
        "[DONE]",
    )
    r = _stream(lambda req: httpx.Response(200, content=body))
    assert r.ok and r.error is None
    assert (r.prompt_tokens, r.completion_tokens, r.chunks, len(r.chunk_gaps_s)) == (7, 5, 3, 2)
    assert 0 < r.ttft_s <= r.e2e_s


@pytest.mark.parametrize(
    ("response", "error"),
    [
        (httpx.Response(500, json={"error": {"message": "boom"}}), "HTTP 500"),
        (
            httpx.Response(200, content=_sse(_chunk({"content": "a"}))),
            "broken stream: no [DONE], finish_reason, usage",
        ),
        (
            httpx.Response(200, content=_sse(_chunk({"content": "a"}, "stop"), "[DONE]")),
            "broken stream: no usage",
        ),
        (httpx.Response(200, content=_sse({"error": {"message": "engine died"}})), "error in stream"),
        (httpx.Response(200, content=b"data: {not json\n\n"), "broken stream: JSONDecodeError"),
    ],
)
def test_stream_chat_counts_what_a_client_cannot_use_as_errors(response, error):
    r = _stream(lambda req: response)
    assert not r.ok and r.error.startswith(error)


def test_stream_chat_timeout_is_an_error():
    def slow(req: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("no bytes", request=req)

    r = _stream(slow)
    assert not r.ok and r.error.startswith("timeout")


def test_summarise_against_hand_computed_figures():
    results = [
        bench.RequestResult(True, None, 10, 11, 0.1, 1.1, [0.1] * 10, 11),
        bench.RequestResult(True, None, 20, 5, 0.3, 0.7, [0.1, 0.1, 0.2], 4),
        bench.RequestResult(False, "HTTP 503: draining"),
    ]
    s = bench.summarise(results, wall_s=2.0)
    assert s["tok_s"] == pytest.approx(16 / 2.0)
    assert (s["requests"], s["errors"], s["error_examples"]) == (3, 1, ["HTTP 503: draining"])
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)  # between 100 and 300 ms
    # 13 gaps, twelve of 100 ms and one of 200: p99 sits 0.88 of the way from the 12th to the 13th
    assert s["itl_ms"]["p50"] == pytest.approx(100.0) and s["itl_ms"]["p99"] == pytest.approx(188.0)
    # TPOT: (1.1 - 0.1) / 10 = 0.1 s and (0.7 - 0.3) / 4 = 0.1 s
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert s["prompt_tokens_mean"] == 15


def test_percentile_interpolates():
    assert bench.percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert bench.percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert bench.percentile([], 50) is None


def test_workloads_are_seeded_and_grounded():
    assert bench.request_bodies("serving", 6, 3, 128) == bench.request_bodies("serving", 6, 3, 128)
    assert bench.request_bodies("serving", 6, 3, 128) != bench.request_bodies("serving", 6, 4, 128)
    lengths = sorted(len(b["messages"][0]["content"]) for b in bench.request_bodies("serving", 9, 0, 128))
    assert lengths[-1] > 10 * lengths[0]  # short, medium and long prompts
    agentic = bench.request_bodies("agentic", 8, 0, 64)
    tools = [b for b in agentic if "tools" in b]
    edits = [b for b in agentic if "tools" not in b]
    assert len(tools) == len(edits) == 4
    for b in edits:
        code = b["messages"][0]["content"].split("```python\n", 1)[1].split("\n```", 1)[0]
        assert 15 <= len(code.splitlines()) <= 40
    for b in agentic:
        assert b["temperature"] == 0.0 and b["stream"] and b["stream_options"] == {"include_usage": True}
