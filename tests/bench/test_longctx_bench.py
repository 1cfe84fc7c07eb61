"""`posttrain bench longctx`: lengths parse as the user types them, bad ones are usage errors, and a run
on a tiny model reports every figure for every length, measured (slow)."""

from __future__ import annotations

import pytest

from posttrain.bench import BenchUsageError
from posttrain.bench.longctx import fits, parse_lengths
from posttrain.cli.bench import run_bench


def test_lengths_parse_and_bad_ones_are_usage_errors(capsys):
    assert parse_lengths("1k, 4k,16384,0.5k") == [1024, 4096, 16384, 512]
    with pytest.raises(BenchUsageError, match="'lots' is not a length"):
        parse_lengths("1k,lots")
    with pytest.raises(SystemExit) as exit_info:
        run_bench("longctx", ["--lengths", "8"])
    assert exit_info.value.code == 2
    assert "at least 16 tokens" in capsys.readouterr().err


def test_fits_32k_is_false_only_for_memory_and_unknown_for_other_failures():
    assert fits({"peak_bytes": 10 * 2**30}) is True
    assert fits({"peak_bytes": 25 * 2**30}) is False
    assert fits({"error": "exit -9: (no output)", "out_of_memory": True}) is False
    assert fits({"error": "exit -15: (no output)", "out_of_memory": False}) is None  # killed by hand
    assert fits({"error": "timed out after 3600 s"}) is None
    assert fits(None) is None


@pytest.mark.slow
def test_a_tiny_run_measures_both_variants_at_every_length():
    args = [
        "--model",
        "tiny:llama",
        "--lengths",
        "64,128",
        "--baseline-max-tokens",
        "64",
        "--ring-tokens",
        "256",
    ]
    out = run_bench("longctx", args)
    assert out["errors"] == {}
    assert set(out["peak_train_bytes"]) == set(out["prefill_s"]) == {"64", "128"}
    assert set(out["peak_train_bytes_baseline"]) == {"64"}
    assert all(v > 0 for v in out["peak_train_bytes"].values())
    assert out["fits_32k"] is None
    ring = out["ring_saved_bytes_per_rank"]  # q, k, v, out and the log-sum-exp of 256 / ranks tokens
    assert ring["2"] == 4 * (4 * 9 * 128 * 64 + 9 * 128) and ring["4"] == ring["2"] // 2
    assert ring["1"] > 9 * 256 * 256 * 4  # plain attention keeps the softmax: quadratic


def test_the_prefill_flop_oracle_matches_a_hand_count_of_the_embedded_models_shape():
    from types import SimpleNamespace

    from posttrain.bench.longctx import prefill_flops_per_token

    # SmolLM2-135M: 30 layers, hidden 576, 9 heads (3 KV) of 64, MLP 1536, vocab 49152
    cfg = SimpleNamespace(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
    )
    per_layer = 576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536  # q, o; k, v; gate, up, down
    assert per_layer == 3_538_944
    linear = 2 * 30 * per_layer
    pair = 4 * 30 * 9 * 64  # QK and PV over every head of every layer
    at = {n: linear + 2 * 576 * 49152 / n + pair * (n + 1) / 2 for n in (4096, 32768)}
    assert prefill_flops_per_token(cfg, 4096) == at[4096]
    assert prefill_flops_per_token(cfg, 32768) == at[32768]
    # an exact causal prefill of 32k tokens costs 3.8x a 4k one per token: the attention term grows
    assert round(at[32768] / at[4096], 2) == 3.8
