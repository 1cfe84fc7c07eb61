"""`posttrain bench moe`: one JSON object with the MoE's and the dense baselines' decode tok/s, their
parameter counts (equal active, equal total) and ratios from the same run; usage errors exit 2."""

from __future__ import annotations

import pytest

from posttrain.cli.bench import run_bench


def test_moe_bench_reports_equal_active_and_total_baselines():
    out = run_bench(
        "moe",
        [
            "--model",
            "tiny:llama",
            "--batch",
            "2",
            "--new-tokens",
            "4",
            "--repeats",
            "1",
            "--weight-quants",
            "none",
            "--replay-samples",
            "8",
            "--replay-tokens",
            "4",
        ],
    )
    p = out["params"]
    # the widened dense MLPs: top_k (2) and experts (4) times the dense width; the MoE adds routers
    assert p["dense_equal_active"] == p["moe_active"] - 4 * 64 * 2  # 2 layers x a [4, 64] router
    assert p["dense_equal_total"] == p["moe"] - 4 * 64 * 2
    (row,) = out["rows"]
    assert row["batch"] == 2 and row["dtype"] == "float32"
    assert row["moe_over_dense_equal_active"] == row["moe_tok_s"] / row["dense_equal_active_tok_s"]
    assert row["moe_over_dense_equal_total"] == row["moe_tok_s"] / row["dense_equal_total_tok_s"]
    assert all(row[f"{m}_tok_s"] > 0 for m in ("moe", "dense_equal_active", "dense_equal_total"))
    replay = out["replay"]
    assert replay["samples"] == 8 and replay["tokens"] == 8 * 4
    for name in ("free", "replay"):
        assert 0.0 <= replay[name]["routing_mismatch"] <= 1.0
        assert replay[name]["mismatch_max_abs_log_ratio"] >= replay[name]["mismatch_abs_log_ratio"] >= 0.0
    # identical expert copies (no --expert-noise): which experts run cannot change the Learner's logprobs
    assert out["expert_noise"] == 0.0
    free, replayed = replay["free"], replay["replay"]
    assert abs(free["mismatch_abs_log_ratio"] - replayed["mismatch_abs_log_ratio"]) < 1e-5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch", "0"], "--batch takes a comma list of positive integers"),
        (["--weight-quants", "fp8"], "--weight-quants takes a comma list"),
        (["--top-k", "9"], "--top-k must be in [1, experts=4]"),
        (["--expert-noise", "-0.1"], "--expert-noise must be >= 0, got -0.1"),
    ],
)
def test_moe_bench_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        run_bench("moe", ["--model", "tiny:llama", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
