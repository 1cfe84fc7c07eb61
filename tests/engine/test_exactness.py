"""The paged engine against HF: greedy tokens identical, logprobs equal to a full forward within 1e-4."""

from __future__ import annotations

import pytest
import torch

from engine.helpers import hf_greedy, hf_logprobs, random_prompts, tiny
from posttrain.engine import GenerationRequest, PagedEngine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


def _check_against_hf(model, outs, prompts, max_new):
    for prompt, out in zip(prompts, outs, strict=True):
        comp = out.completions[0]
        assert comp.token_ids == hf_greedy(model, prompt, max_new)
        ref = hf_logprobs(model, prompt, comp.token_ids)
        assert max(abs(a - b) for a, b in zip(ref, comp.logprobs, strict=True)) < 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_matches_hf_mixed_lengths_across_block_boundaries(family, tokenizer):
    model = tiny(family)
    lengths = [1, 3, 4, 5, 16, 17, 31] if family == "llama" else [1, 4, 5, 17]
    prompts = random_prompts(lengths, seed=1)
    engine = PagedEngine(model, tokenizer, block_size=4, num_blocks=128)
    outs = engine.generate([GenerationRequest(p, GREEDY) for p in prompts])
    _check_against_hf(model, outs, prompts, 20)


def test_preemption_and_chunked_prefill_keep_outputs_exact(tokenizer):
    model = tiny("llama")
    prompts = random_prompts([9, 14, 22, 27, 35, 40], seed=2)
    # each sequence needs up to 15 blocks of 4; 24 blocks cannot hold them all: preemption by recompute
    engine = PagedEngine(model, tokenizer, block_size=4, num_blocks=24, max_num_batched_tokens=16)
    outs = engine.generate([GenerationRequest(p, GREEDY) for p in prompts])
    stats = engine.kv_stats()
    assert stats["preemptions"] > 0
    assert stats["blocks_allocated"] == 0  # everything freed at the end
    _check_against_hf(model, outs, prompts, 20)


def test_shared_prefixes_hit_the_cache_and_stay_exact(tokenizer):
    model = tiny("qwen2")
    prefix = random_prompts([24], seed=3)[0]
    suffixes = random_prompts([1, 5, 9], seed=4)
    prompts = [prefix + s for s in suffixes]
    engine = PagedEngine(model, tokenizer, block_size=8, num_blocks=64)
    first = engine.generate([GenerationRequest(prompts[0], GREEDY)])
    rest = engine.generate([GenerationRequest(p, GREEDY) for p in prompts[1:]])
    assert engine.kv_stats()["prefix_hit_tokens"] == 2 * 24  # three full blocks of 8, for each later request
    _check_against_hf(model, first + rest, prompts, 20)


def test_n_samples_fork_after_one_prefill_and_copy_on_write(tokenizer):
    model = tiny("llama")
    prompt = random_prompts([13], seed=5)[0]  # 13 = 3 full blocks of 4 + a shared partial block
    engine = PagedEngine(model, tokenizer, block_size=4, num_blocks=64)
    out = engine.generate([GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=12, n=4))])[0]
    ref = hf_greedy(model, prompt, 12)
    assert [c.token_ids for c in out.completions] == [ref] * 4
    assert engine.kv_stats()["fork_shared_blocks"] == 3 * 4  # 3 siblings got the parent's 4 blocks


def test_sampled_logprobs_are_tempered_full_forward_logprobs(tokenizer):
    model = tiny("llama")
    prompts = random_prompts([6, 19], seed=6)
    engine = PagedEngine(model, tokenizer, block_size=4, num_blocks=64)
    params = SamplingParams(temperature=0.7, top_k=50, max_tokens=16, seed=3)
    for prompt, out in zip(
        prompts, engine.generate([GenerationRequest(p, params) for p in prompts]), strict=True
    ):
        comp = out.completions[0]
        ref = hf_logprobs(model, prompt, comp.token_ids, temperature=0.7)
        assert max(abs(a - b) for a, b in zip(ref, comp.logprobs, strict=True)) < 1e-4


def test_embedded_135m_model_greedy_matches_hf(tokenizer):
    from posttrain.models import load_policy

    model = load_policy("smollm2-135m")
    prompt = tokenizer.encode("The capital of France is")
    engine = PagedEngine(model, tokenizer, num_blocks=16)
    out = engine.generate([GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=8))])[0]
    assert out.completions[0].token_ids == hf_greedy(model, prompt, 8)


def test_bfloat16_weights_and_kv_cache(tokenizer):
    from posttrain.models import load_policy

    prompts = random_prompts([5, 13], seed=3)
    model_bf16 = load_policy("tiny:llama", dtype="bfloat16")
    engine = PagedEngine(model_bf16, tokenizer, dtype="bfloat16", block_size=4, num_blocks=64)
    outs = engine.generate(
        [GenerationRequest(p, SamplingParams(temperature=0.0, max_tokens=10)) for p in prompts]
    )
    assert engine.runner.k_cache.dtype == torch.bfloat16
    for prompt, out in zip(prompts, outs, strict=True):
        comp = out.completions[0]
        assert comp.token_ids == hf_greedy(model_bf16, prompt, 10)
        ref = hf_logprobs(model_bf16, prompt, comp.token_ids)
        assert max(abs(a - b) for a, b in zip(ref, comp.logprobs, strict=True)) < 1e-3
    model = tiny("llama")  # float32 compute over a bfloat16 KV cache: close, not exact
    engine = PagedEngine(model, tokenizer, kv_cache_dtype="bfloat16", block_size=4, num_blocks=64)
    outs = engine.generate(
        [GenerationRequest(p, SamplingParams(temperature=0.0, max_tokens=10)) for p in prompts]
    )
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf_logprobs(model, prompt, out.completions[0].token_ids)
        assert max(abs(a - b) for a, b in zip(ref, out.completions[0].logprobs, strict=True)) < 1e-3


@pytest.mark.parametrize("staging", [True, False])
def test_uninitialised_pool_memory_never_reaches_attention(tokenizer, staging):
    """The pool is allocated uninitialised and blocks are zeroed when handed out: poison the whole
    pool with NaN (as stale memory could be), then generate with preemption, forks and decode groups
    padded with block 0; outputs stay exactly HF's."""
    model = tiny("llama")
    prompts = random_prompts([3, 9, 14, 22], seed=7)
    engine = PagedEngine(
        model, tokenizer, block_size=4, num_blocks=40, max_num_batched_tokens=16, decode_staging=staging
    )
    engine.runner.allocate_kv_cache()
    engine.runner.k_cache.fill_(float("nan"))
    engine.runner.v_cache.fill_(float("nan"))
    engine.runner.zero_blocks([0])  # what allocate_kv_cache does for the padding block
    outs = engine.generate([GenerationRequest(p, GREEDY) for p in prompts])
    _check_against_hf(model, outs, prompts, 20)
    forked = engine.generate(
        [GenerationRequest(prompts[1], SamplingParams(temperature=0.0, max_tokens=8, n=3))]
    )[0]
    assert all(c.token_ids == hf_greedy(model, prompts[1], 8) for c in forked.completions)
    # and after a release, the next allocation zeroes only the padding block before blocks are taken
    engine.release_kv_cache()
    again = engine.generate([GenerationRequest(p, GREEDY) for p in prompts])
    assert [o.completions[0].token_ids for o in again] == [o.completions[0].token_ids for o in outs]
