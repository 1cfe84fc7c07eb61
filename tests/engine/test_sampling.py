"""Sampling: truncation against hand-computed cases and transformers' warpers, chi-square tests of the
sampled distribution, seeded determinism whatever the batch."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from engine.helpers import random_prompts, tiny
from posttrain.engine import BadRequestError, GenerationRequest, PagedEngine, SamplingParams
from posttrain.engine.sampling import apply_penalties, apply_repetition_penalty, sample, sample_row, truncate

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
    tokens, _, _ = sample(logits.expand(n, -1).clone(), [params] * n, [[]] * n, gens)
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


def _reference_top(
    logits: torch.Tensor, params: SamplingParams, history: list[int]
) -> list[tuple[int, float]]:
    """By hand: repetition penalty (HF semantics), temperature (none when greedy), log_softmax, sort."""
    row = logits.clone()
    for t in set(history):
        row[t] = row[t] / params.repetition_penalty if row[t] > 0 else row[t] * params.repetition_penalty
    if params.temperature > 0.0:
        row = row / params.temperature
    lp = row - torch.logsumexp(row, -1)
    order = sorted(range(row.shape[0]), key=lambda t: -float(lp[t]))
    return [(t, float(lp[t])) for t in order[: params.top_logprobs]]


def test_top_logprobs_equal_a_hand_log_softmax_in_every_sampling_path():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=g) * 3
    params = [
        SamplingParams(temperature=0.0, top_logprobs=5),  # the batched greedy argmax
        SamplingParams(temperature=0.0, repetition_penalty=1.5, top_logprobs=3),  # greedy, penalised
        SamplingParams(temperature=0.7, top_logprobs=4),  # untruncated sampling
        SamplingParams(temperature=1.3, top_k=5, top_p=0.9, top_logprobs=20),  # truncated: not in the top
        SamplingParams(temperature=0.9, repetition_penalty=0.8, min_p=0.1, top_logprobs=1),
        SamplingParams(temperature=1.0),  # none asked for
    ]
    histories = [[], [int(logits[1].argmax()), 7, 7], [], [], [int(logits[4].argmax()), 2], []]
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    tokens, logprobs, tops = sample(logits.clone(), params, histories, gens)
    assert tops[5] is None
    for i in range(5):
        want = _reference_top(logits[i], params[i], histories[i])
        got = tops[i]
        assert got is not None and len(got) == params[i].top_logprobs
        assert [t for t, _ in got] == [t for t, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=1e-5)
        assert all(a[1] >= b[1] for a, b in zip(got, got[1:], strict=False))
        # the reported logprob of the chosen token is its entry among the top ones, when it is there
        by_token = dict(got)
        if params[i].temperature == 0.0:
            assert got[0][0] == tokens[i] and got[0][1] == pytest.approx(logprobs[i], abs=1e-6)
        elif tokens[i] in by_token:
            assert by_token[tokens[i]] == pytest.approx(logprobs[i], abs=1e-5)
    # sample_row gives one row what sample gives it in a batch
    for i in (0, 1, 3):
        tok, lp, top = sample_row(
            logits[i].clone(), params[i], histories[i], torch.Generator().manual_seed(i)
        )
        assert tok == tokens[i] and lp == pytest.approx(logprobs[i], abs=1e-6)
        assert top is not None and [t for t, _ in top] == [t for t, _ in tops[i]]
    assert sample_row(logits[5], params[5], [], torch.Generator())[2] is None


def test_top_logprobs_validated_to_zero_through_twenty():
    SamplingParams(top_logprobs=0).validate()
    SamplingParams(top_logprobs=20).validate()
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(BadRequestError, match="top_logprobs"):
            SamplingParams(top_logprobs=bad).validate()


def test_engine_completions_carry_top_logprobs_per_token(tokenizer):
    model = tiny("llama")
    engine = PagedEngine(model, tokenizer, block_size=4, num_blocks=64)
    prompts = random_prompts([9, 12], seed=5)
    reqs = [
        GenerationRequest(
            prompts[0], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, top_logprobs=3)
        ),
        GenerationRequest(
            prompts[1],
            SamplingParams(temperature=0.8, max_tokens=4, n=2, seed=1, ignore_eos=True, top_logprobs=2),
        ),
        GenerationRequest(prompts[1], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)),
    ]
    out = engine.generate(reqs)
    assert out[2].completions[0].top_logprobs is None
    with torch.no_grad():
        ref = model(torch.tensor([prompts[0] + out[0].completions[0].token_ids])).logits[0].float()
    comp = out[0].completions[0]
    assert comp.top_logprobs is not None and len(comp.top_logprobs) == len(comp.token_ids) == 5
    for i, (tok, top) in enumerate(zip(comp.token_ids, comp.top_logprobs, strict=True)):
        want = torch.log_softmax(ref[len(prompts[0]) - 1 + i], -1).topk(3)
        assert [t for t, _ in top] == want.indices.tolist() and top[0][0] == tok
        assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=1e-4)
    for c in out[1].completions:
        assert c.top_logprobs is not None and len(c.top_logprobs) == len(c.token_ids) == 4
        assert all(len(top) == 2 and top[0][1] >= top[1][1] for top in c.top_logprobs)


def test_presence_and_frequency_penalties_hand_computed():
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0, -1.0])
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    # token 1 generated twice, token 3 once: 2 - (0.5 + 2 x 0.25) = 1.0 and 4 - (0.5 + 0.25) = 3.25
    got = apply_penalties(logits, p, history=[], output=[1, 3, 1])
    assert got.tolist() == [1.0, 1.0, 3.0, 3.25, -1.0]
    # after the repetition penalty (over prompt + completion): token 4 (in the prompt) -1 x 2 = -2
    both = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5)
    got = apply_penalties(logits, both, history=[4, 1], output=[1])
    assert got.tolist() == [1.0, 0.5, 3.0, 4.0, -2.0]
    assert apply_penalties(logits, SamplingParams(), [1], [1]) is logits  # off: the same tensor
    with pytest.raises(BadRequestError, match=r"frequency_penalty must be in \[-2, 2\]"):
        SamplingParams(frequency_penalty=2.5).validate()


def test_engine_penalties_match_a_hand_loop_over_full_forwards(tokenizer):
    """Greedy with presence and frequency penalties: each token is the argmax of the full-sequence
    forward's last logits minus the penalties counted by hand over the completion so far; the
    speculative engine decodes penalised requests one token a step, with the same result."""
    model = tiny("llama", seed=4)
    prompt = random_prompts([12], seed=9, vocab=model.config.vocab_size)[0]
    params = SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.7
    )
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(10):
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float().clone()
            for tok in set(out):
                logits[tok] -= 1.5 + 0.7 * out.count(tok)
            out.append(int(logits.argmax()))
    assert len(set(out)) > 3  # the penalties bite: the tiny model alone repeats its last token
    engine = PagedEngine(model, tokenizer, block_size=8, num_blocks=64, max_model_len=256)
    got = engine.generate([GenerationRequest(prompt, params)])[0].completions[0].token_ids
    assert got == out
    spec = PagedEngine(model, tokenizer, block_size=8, num_blocks=64, max_model_len=256, speculative="ngram")
    assert spec.generate([GenerationRequest(prompt, params)])[0].completions[0].token_ids == out
    assert spec.speculation_stats()["verify_steps"] == 0
