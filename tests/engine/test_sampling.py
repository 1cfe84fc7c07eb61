"""Sampling: truncation against hand-computed cases and transformers' warpers, chi-square tests of the
sampled distribution, seeded determinism whatever the batch."""

from __future__ import annotations

import copy
import math

import torch

from engine.helpers import random_prompts, tiny
from posttrain.engine import GenerationRequest, PagedEngine, SamplingParams
from posttrain.engine.sampling import apply_repetition_penalty, sample, truncate

# chi-square critical values at alpha = 0.001, by degrees of freedom
CHI2_CRIT_001 = {
    1: 10.83,
    2: 13.82,
    3: 16.27,
    4: 18.47,
    5: 20.52,
    6: 22.46,
    7: 24.32,
    8: 26.12,
    9: 27.88,
    10: 29.59,
    11: 31.26,
    12: 32.91,
    13: 34.53,
    14: 36.12,
    15: 37.70,
}


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True))


def kept(logits: torch.Tensor) -> list[int]:
    return [i for i, v in enumerate(logits.tolist()) if v > torch.finfo(logits.dtype).min]


LOGITS = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))


def test_truncation_hand_computed():
    # top-p keeps the smallest set of most likely tokens holding >= p: {0.5, 0.3} holds 0.8
    assert kept(truncate(LOGITS, 0, 0.79, 0.0)) == [0, 1]
    assert kept(truncate(LOGITS, 0, 0.81, 0.0)) == [0, 1, 2]
    assert kept(truncate(LOGITS, 0, 0.5, 0.0)) == [0]
    assert kept(truncate(LOGITS, 0, 0.96, 0.0)) == [0, 1, 2, 3]
    assert kept(truncate(LOGITS, 2, 1.0, 0.0)) == [0, 1]
    assert kept(truncate(LOGITS, 1, 1.0, 0.0)) == [0]
    assert kept(truncate(LOGITS, 3, 0.5, 0.0)) == [0]
    # min-p 0.2: threshold 0.2 * 0.5 = 0.1 drops 0.05; min-p 0.4 (0.2) also drops 0.15
    assert kept(truncate(LOGITS, 0, 1.0, 0.2)) == [0, 1, 2]
    assert kept(truncate(LOGITS, 0, 1.0, 0.4)) == [0, 1]


def test_truncation_matches_transformers_warpers():
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(50, generator=g) * 3
        ids = torch.zeros(1, 1, dtype=torch.long)
        ref = TopKLogitsWarper(7)(ids, logits[None].clone())
        ref = TopPLogitsWarper(0.7)(ids, ref)
        ref = MinPLogitsWarper(0.05)(ids, ref)[0]
        ours = truncate(logits, 7, 0.7, 0.05)
        assert kept(ours) == [i for i, v in enumerate(ref.tolist()) if v != -math.inf]


def test_repetition_penalty_hand_computed():
    out = apply_repetition_penalty(torch.tensor([2.0, -1.0, 0.5]), [0, 1, 0], 2.0)
    assert out.tolist() == [1.0, -2.0, 0.5]


def _sample_counts(params: SamplingParams, logits: torch.Tensor, n: int, seed: int = 0) -> list[int]:
    gens = [torch.Generator().manual_seed(seed * 100_000 + i) for i in range(n)]
    tokens, _ = sample(logits.expand(n, -1).clone(), [params] * n, [[]] * n, gens)
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).tolist()


def test_sampled_distribution_matches_softmax_chi_square():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = torch.log(probs) * 2.0  # temperature 2 undoes the scaling
    counts = _sample_counts(SamplingParams(temperature=2.0), logits, 6000)
    assert chi_square(counts, probs.tolist()) < CHI2_CRIT_001[5]
    # the test has power: temperature 1 samples from a sharper distribution and is rejected
    sharper = _sample_counts(SamplingParams(temperature=1.0), logits, 6000)
    assert chi_square(sharper, probs.tolist()) > CHI2_CRIT_001[5]


def test_top_k_samples_only_the_top_and_renormalizes():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    counts = _sample_counts(SamplingParams(temperature=1.0, top_k=3), torch.log(probs), 4000, seed=1)
    assert counts[3:] == [0, 0, 0]
    top = (probs[:3] / probs[:3].sum()).tolist()
    assert chi_square(counts[:3], top) < CHI2_CRIT_001[2]


def test_engine_first_token_distribution_matches_hf_softmax(tokenizer):
    model = copy.deepcopy(tiny("llama"))
    with torch.no_grad():
        model.model.norm.weight.mul_(30.0)  # sharpen the random model's next-token distribution
    prompt = [5, 6, 7]
    with torch.inference_mode():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    engine = PagedEngine(model, tokenizer, block_size=4, num_blocks=64, max_num_seqs=100)
    params = [SamplingParams(temperature=1.0, max_tokens=1, n=100, seed=s) for s in range(8)]
    outs = engine.generate([GenerationRequest(prompt, p) for p in params])
    tokens = [c.token_ids[0] for o in outs for c in o.completions]
    n = len(tokens)
    order = probs.argsort(descending=True).tolist()
    bins = [t for t in order if probs[t] * n >= 5]
    counts = [tokens.count(t) for t in bins] + [sum(t not in bins for t in tokens)]
    expected = [float(probs[t]) for t in bins] + [1.0 - float(probs[bins].sum())]
    assert chi_square(counts, expected) < CHI2_CRIT_001[len(bins)]


def test_same_seed_same_output_whatever_the_batch(tokenizer):
    model = tiny("llama")
    engine = PagedEngine(model, tokenizer, block_size=4, num_blocks=128)
    target = GenerationRequest(
        random_prompts([11], seed=9)[0], SamplingParams(temperature=1.0, max_tokens=12, seed=42)
    )
    alone = engine.generate([target])[0].completions[0]
    others = [
        GenerationRequest(p, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=7, seed=i))
        for i, p in enumerate(random_prompts([3, 25, 8], seed=10))
    ]
    batched = engine.generate(others[:2] + [target] + others[2:])[2].completions[0]
    assert batched.token_ids == alone.token_ids
    # a different batch shape changes float rounding in the matmuls, not the sampled tokens
    assert max(abs(a - b) for a, b in zip(batched.logprobs, alone.logprobs, strict=True)) < 1e-5
    other_seed = GenerationRequest(
        target.prompt_token_ids, SamplingParams(temperature=1.0, max_tokens=12, seed=43)
    )
    assert engine.generate([other_seed])[0].completions[0].token_ids != alone.token_ids


def test_n_samples_differ_and_repeat_with_the_seed(tokenizer):
    engine = PagedEngine(tiny("llama"), tokenizer, block_size=4, num_blocks=128)
    req = GenerationRequest(
        random_prompts([6], seed=11)[0], SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=5)
    )
    first = [c.token_ids for c in engine.generate([req])[0].completions]
    second = [c.token_ids for c in engine.generate([req])[0].completions]
    assert first == second
    assert len({tuple(t) for t in first}) == 3
