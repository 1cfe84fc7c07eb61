"""The engine benchmark runs end to end on a tiny model and reports the figures the issue names."""

from __future__ import annotations

import pytest

from posttrain.cli.bench import run_bench


@pytest.mark.slow
def test_bench_quick_on_a_tiny_model_reports_the_named_figures():
    result = run_bench("engine", ["--model", "tiny:llama", "--quick", "--dtypes", "float32"])
    for key in (
        "ratio_vs_hf_rollout",
        "ratio_vs_hf_serving",
        "ratio_vs_hf_1",
        "roofline_frac_64",
        "kv_waste_frac",
        "paged_tok_s_rollout",
        "hf_tok_s_rollout",
        "paged_tok_s_serving",
        "hf_tok_s_serving",
        "paged_tok_s_1",
        "hf_tok_s_1",
        "paged_tok_s_64",
        "matmul_gflops",
    ):
        assert result[key] > 0 or key == "kv_waste_frac", key
    assert 0.0 <= result["kv_waste_frac"] < 0.04
    # rollout: 4 prompts x 4 samples share each prompt's full blocks
    assert result["rollout_fork_shared_blocks"] > 0
