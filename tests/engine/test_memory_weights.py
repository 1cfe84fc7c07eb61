"""KV memory (waste under 4%, a group's prompt stored once), weight reloads, releasing the KV pool."""

from __future__ import annotations

import pytest
import torch

from engine.helpers import hf_greedy, random_prompts, tiny
from posttrain.engine import GenerationRequest, PagedEngine, SamplingParams


def test_kv_waste_under_4_percent_on_a_mixed_batch(tokenizer):
    lengths = [50, 117, 203, 264, 318, 377, 441, 500]
    prompts = random_prompts(lengths, seed=20)
    engine = PagedEngine(tiny("llama"), tokenizer, block_size=16, num_blocks=512, max_num_batched_tokens=4096)
    engine.generate(
        [GenerationRequest(p, SamplingParams(max_tokens=4, ignore_eos=True, seed=0)) for p in prompts]
    )
    stats = engine.kv_stats()
    # at the peak every sequence holds prompt + 3 tokens computed, in ceil(len / 16) blocks
    assert stats["peak_blocks_allocated"] == sum(-(-(n + 3) // 16) for n in lengths)
    assert stats["peak_tokens_stored"] == sum(n + 3 for n in lengths)
    assert stats["peak_waste_frac"] < 0.04


def test_a_group_of_8_samples_stores_its_500_token_prompt_once(tokenizer):
    prompt = random_prompts([500], seed=21)[0]
    engine = PagedEngine(tiny("llama"), tokenizer, block_size=16, num_blocks=512)
    params = SamplingParams(temperature=1.0, max_tokens=8, n=8, ignore_eos=True, seed=1)
    out = engine.generate([GenerationRequest(prompt, params)])[0]
    assert len(out.completions) == 8
    stats = engine.kv_stats()
    # 500 = 31 full blocks (shared by all 8) + a 4-token partial block, copied on write by 7 of the 8
    assert stats["peak_blocks_allocated"] == 31 + 8
    assert stats["peak_tokens_logical"] == 8 * (500 + 7)
    assert stats["peak_tokens_stored"] == 31 * 16 + 8 * (4 + 7)
    assert stats["fork_shared_blocks"] == 7 * 32


def test_weight_reload_changes_outputs_to_the_new_weights(tokenizer):
    old, new = tiny("llama", 0), tiny("llama", 1)
    prompt = random_prompts([21], seed=22)[0]  # longer than a block: the prefix cache holds it
    engine = PagedEngine(old, tokenizer, block_size=8, num_blocks=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    assert engine.generate([GenerationRequest(prompt, greedy)])[0].completions[0].token_ids == hf_greedy(
        old, prompt, 10
    )
    engine.load_weights({f"base_model.model.{k}": v for k, v in new.state_dict().items()})
    assert engine.version == 1
    out = engine.generate([GenerationRequest(prompt, greedy)])[0].completions[0]
    assert out.token_ids == hf_greedy(new, prompt, 10)  # the old prefix-cache entries were dropped
    engine.load_weights(iter(old.state_dict().items()), version=7)
    assert engine.version == 7
    assert engine.generate([GenerationRequest(prompt, greedy)])[0].completions[0].token_ids == hf_greedy(
        old, prompt, 10
    )


def test_bad_weights_are_rejected_by_name(tokenizer):
    engine = PagedEngine(tiny("llama"), tokenizer, num_blocks=16)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.nonsense.weight"):
        engine.load_weights({"model.layers.0.self_attn.nonsense.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"model.norm.weight' has shape \(3,\), expected \(64,\)"):
        engine.load_weights({"model.norm.weight": torch.zeros(3)})
    assert engine.version == 0


def test_release_kv_cache_frees_the_pool_and_generation_resumes(tokenizer):
    model = tiny("qwen2")
    prompt = random_prompts([9], seed=23)[0]
    engine = PagedEngine(model, tokenizer, block_size=4, num_blocks=32)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    before = engine.generate([GenerationRequest(prompt, greedy)])[0].completions[0].token_ids
    engine.release_kv_cache()
    assert engine.runner.k_cache is None and not engine.kv_stats()["kv_cache_allocated"]
    assert engine.generate([GenerationRequest(prompt, greedy)])[0].completions[0].token_ids == before
    assert engine.kv_stats()["kv_cache_allocated"]
