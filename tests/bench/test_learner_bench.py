"""`posttrain bench learner` measures the supervised step next to the RL update, on the same sequences,
for every variant but the prompt-sharing ones (SFT has no groups), with its ratio to the update."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from posttrain.bench.learner import main


def test_sft_tokens_per_s_beside_the_update_of_each_variant():
    opts = SimpleNamespace(
        threads=0,
        seqs=4,
        seq_len=16,
        quick=True,
        spec="tiny:llama",
        fixed_length=True,
        grpo=0,
        variants="full-fp32-padded,lora-fp32-packed",
        repeats=1,
        lora_rank=4,
        micro_batch_tokens=4096,
    )
    out = main(opts)
    assert out["tokens"] == 4 * 16
    assert set(out) >= {"lora_fp32_packed_sft_tokens_per_s", "lora_fp32_packed_sft_over_update"}
    sft, update = out["full_fp32_padded_sft_tokens_per_s"], out["full_fp32_padded_tokens_per_s"]
    assert sft > 0 and out["full_fp32_padded_sft_over_update"] == pytest.approx(sft / update)
    best = max(sft, out["lora_fp32_packed_sft_tokens_per_s"])
    assert out["best_sft_tokens_per_s"] == best
