"""Speculative decoding: the prompt-lookup index, the exact acceptance rule, and the engine's output with
drafts equal to its output without (greedy: identical tokens; sampling: the same distribution)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.engine import GenerationRequest, PagedEngine, SamplingParams
from posttrain.engine.speculative import NgramIndex, verify

from .helpers import assert_same_token_distribution, tiny


def test_the_index_proposes_what_followed_the_latest_longest_match():
    idx = NgramIndex(1, 3)
    idx.extend([5, 6, 7, 8, 5, 6, 9, 5, 6])
    # suffix (9, 5, 6) never occurred before; (5, 6) last started at 4 and was followed by 9, 5, 6
    assert idx.propose(3) == [9, 5, 6]
    assert idx.propose(1) == [9]
    idx.extend([9])  # suffix (6, 9) / (5, 6, 9): last at 4, followed by 5, 6, 9
    assert idx.propose(8) == [5, 6, 9]  # no further than the sequence's end
    fresh = NgramIndex(2, 2)
    fresh.extend([1, 2, 3, 4])
    assert fresh.propose(4) == []  # (3, 4) never occurred before
    copy = idx.copy()
    copy.extend([1])
    assert idx.tokens[-1] == 9 and copy.tokens[-1] == 1
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramIndex(3, 2)


def _logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_greedy_verification_accepts_the_argmax_prefix_then_corrects():
    g = torch.Generator().manual_seed(0)
    greedy = SamplingParams(temperature=0.0)
    rows = _logits([[0, 5, 1, 0], [0, 0, 0, 4], [3, 0, 0, 0], [0, 0, 2, 0]])  # argmaxes 1, 3, 0, 2
    tokens, lps, accepted, tops = verify(rows, [1, 3, 2], greedy, g)
    assert (tokens, accepted, tops) == ([1, 3, 0], 2, None)
    expected = torch.log_softmax(rows, -1)
    assert lps == pytest.approx([float(expected[0, 1]), float(expected[1, 3]), float(expected[2, 0])])
    tokens, _, accepted, _ = verify(rows, [1, 3, 0], greedy, g)  # all accepted: the bonus token follows
    assert (tokens, accepted) == ([1, 3, 0, 2], 3)
    tokens, _, accepted, _ = verify(rows[:1], [], greedy, g)
    assert (tokens, accepted) == ([1], 0)
    with pytest.raises(ValueError, match="needs 3 logit rows"):
        verify(rows, [1, 2], greedy, g)


def _chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True) if p > 0)


@pytest.mark.parametrize(
    "params, draft_token",
    [
        (SamplingParams(temperature=1.0), 2),  # a likely draft
        (SamplingParams(temperature=0.7), 0),  # an unlikely one
        (SamplingParams(temperature=1.0, top_k=2), 3),  # one the truncation excludes: always rejected
    ],
)
def test_sampled_verification_emits_exactly_the_target_distribution(params, draft_token):
    """The first emitted token is distributed as the sampler's target, whatever the draft: chi-square
    over 12000 draws, 3 degrees of freedom, rejected at p < 0.001 (critical value 16.27)."""
    rows = _logits([[0.2, 1.0, 1.5, -0.5], [0.0, 0.0, 0.0, 0.0]])
    tempered = rows[0] / params.temperature
    if params.top_k:
        kth = torch.topk(tempered, params.top_k).values[-1]
        tempered = tempered.masked_fill(tempered < kth, float("-inf"))
    probs = tempered.softmax(-1).tolist()
    counts = [0, 0, 0, 0]
    accepted_total = 0
    g = torch.Generator().manual_seed(1234)
    for _ in range(12000):
        tokens, lps, accepted, _ = verify(rows, [draft_token], params, g)
        counts[tokens[0]] += 1
        accepted_total += accepted
        assert lps[0] == pytest.approx(float(torch.log_softmax(rows[0] / params.temperature, -1)[tokens[0]]))
    support = [p for p in probs if p > 0]
    assert len([c for c in counts if c]) <= len(support)
    assert _chi_square(counts, probs) < 16.27
    # the acceptance rate is p(draft) (Leviathan et al.): within 4 standard errors
    p = probs[draft_token]
    assert abs(accepted_total / 12000 - p) <= 4 * math.sqrt(max(p * (1 - p), 1e-9) / 12000) + 1e-9


def lively(seed: int, scale: float = 5.0):
    """The tiny random model with its layer weights scaled up: at the usual init its tied head mostly
    echoes the last token; scaled, greedy output mixes repeats (drafts accepted) with new tokens."""
    m = tiny("llama", seed=seed)
    sd = {k: v * scale if "layers" in k and "norm" not in k else v.clone() for k, v in m.state_dict().items()}
    return m.config, sd


def _engine(model, tokenizer, **kw) -> PagedEngine:
    kw = {"num_blocks": 128, "block_size": 8, "max_model_len": 256, **kw}
    return PagedEngine(model, tokenizer, **kw)


# a prompt that repeats itself, so lookup drafts exist from the first decode step on
LOOP = [11, 12, 13, 14, 15, 16, 17, 18] * 4 + [11, 12, 13]


def test_greedy_with_drafts_is_greedy_without_them(tokenizer):
    model = lively(3)
    prompts = [LOOP, LOOP[5:], [7, 8, 9, 7, 8], list(range(100, 140))]
    reqs = [
        GenerationRequest(
            prompt_token_ids=p, params=SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
        )
        for p in prompts
        for m in (1, 3, 17, 40)
    ]
    plain = _engine(model, tokenizer).generate(reqs)
    spec = _engine(model, tokenizer, speculative="ngram", speculative_max_batch=64, prompt_lookup_min=1)
    got = spec.generate(reqs)
    for a, b in zip(plain, got, strict=True):
        assert b.completions[0].token_ids == a.completions[0].token_ids
        assert b.completions[0].finish_reason == a.completions[0].finish_reason
        assert b.completions[0].logprobs == pytest.approx(a.completions[0].logprobs, abs=1e-4)
    stats = spec.speculation_stats()
    assert stats["draft_tokens"] > 0 and 0 < stats["accepted_tokens"] <= stats["draft_tokens"]


def test_drafts_cut_to_the_token_budget_and_stopped_inside(tokenizer, monkeypatch):
    """One request, 3 tokens per step (a 4-token draft is cut to 2), drafts whose second token is wrong,
    and a stop token that arrives inside an accepted draft or as the correction."""
    model = lively(3)
    free = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = _engine(model, tokenizer).generate([GenerationRequest(prompt_token_ids=LOOP, params=free)])
    cont = ref[0].completions[0].token_ids
    stop_tok = next(t for i, t in enumerate(cont) if i >= 8 and t not in cont[:i])
    one = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_tok])
    req = GenerationRequest(prompt_token_ids=LOOP, params=one)
    want = _engine(model, tokenizer, max_num_batched_tokens=3).generate([req])[0].completions[0]
    assert want.token_ids == cont[: cont.index(stop_tok) + 1] and want.finish_reason == "stop"

    def propose(self: NgramIndex, k: int) -> list[int]:
        done = len(self.tokens) - len(LOOP)
        right = cont[done : done + k]  # the second token is wrong (it survives the cut to 2)
        return right[:1] + [(right[1] + 1) % 1000] + right[2:] if len(right) > 1 else right

    monkeypatch.setattr(NgramIndex, "propose", propose)
    small = _engine(model, tokenizer, speculative="ngram", max_num_batched_tokens=3)
    have = small.generate([req])[0].completions[0]
    assert have.token_ids == want.token_ids and have.finish_reason == "stop"
    assert have.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    stats = small.speculation_stats()
    assert stats["verify_steps"] > 0 and stats["draft_tokens"] == 2 * stats["verify_steps"]
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"]


def test_sampling_with_drafts_keeps_the_distribution(tokenizer, monkeypatch):
    """Two-sample chi-square on the second and third sampled tokens of 300 seeded completions with and
    without drafts (the random streams differ, the distributions must not). The draft is forced to the
    greedy continuation (likely under the target, so it is often accepted, and sometimes not): the rule
    is exact for any draft."""
    model = lively(5)
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    g = _engine(model, tokenizer).generate([GenerationRequest(prompt_token_ids=LOOP, params=greedy)])
    cont = g[0].completions[0].token_ids
    monkeypatch.setattr(NgramIndex, "propose", lambda self, k: cont[1:][:k])
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True, n=300, seed=7)
    req = GenerationRequest(prompt_token_ids=LOOP, params=params)
    big = dict(num_blocks=2048, max_num_seqs=512)
    plain = _engine(model, tokenizer, **big).generate([req])[0]
    spec_engine = _engine(model, tokenizer, speculative="ngram", speculative_max_batch=512, **big)
    spec = spec_engine.generate([req])[0]
    stats = spec_engine.speculation_stats()
    assert stats["accepted_tokens"] > 20 and stats["accepted_tokens"] < stats["draft_tokens"]
    for pos in (1, 2):
        assert_same_token_distribution(plain.completions, spec.completions, pos)


def test_verification_reports_top_logprobs_of_every_emitted_token():
    g = torch.Generator().manual_seed(0)
    rows = _logits([[0, 5, 1, 0], [0, 0, 0, 4], [3, 0, 0, 0], [0, 0, 2, 0]])  # argmaxes 1, 3, 0, 2
    tokens, lps, accepted, tops = verify(rows, [1, 3, 2], SamplingParams(temperature=0.0, top_logprobs=2), g)
    assert (tokens, accepted) == ([1, 3, 0], 2) and tops is not None and len(tops) == 3
    ref = torch.log_softmax(rows, -1)
    for i, (tok, top) in enumerate(zip(tokens, tops, strict=True)):
        want = ref[i].topk(2)
        assert [t for t, _ in top] == want.indices.tolist() and top[0][0] == tok
        assert [v for _, v in top] == pytest.approx(want.values.tolist()) and top[0][1] == pytest.approx(
            lps[i]
        )
    sampled = SamplingParams(temperature=0.5, top_logprobs=4)
    tokens, lps, accepted, tops = verify(rows, [1, 3, 2], sampled, g)
    assert tops is not None and len(tops) == len(tokens) == accepted + 1
    ref = torch.log_softmax(rows / 0.5, -1)
    for i, (tok, top) in enumerate(zip(tokens, tops, strict=True)):
        assert [t for t, _ in top] == ref[i].topk(4).indices.tolist()
        assert [v for _, v in top] == pytest.approx(ref[i].topk(4).values.tolist())
        assert dict(top)[tok] == pytest.approx(lps[i])  # 4 of 4 tokens: the emitted one is there


def test_greedy_top_logprobs_with_drafts_equal_those_without(tokenizer):
    model = lively(3)
    prompts = [LOOP, LOOP[5:], [7, 8, 9, 7, 8]]
    reqs = [
        GenerationRequest(
            prompt_token_ids=p,
            params=SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, top_logprobs=5),
        )
        for p in prompts
        for m in (1, 17, 40)
    ]
    plain = _engine(model, tokenizer).generate(reqs)
    spec = _engine(model, tokenizer, speculative="ngram", speculative_max_batch=64, prompt_lookup_min=1)
    got = spec.generate(reqs)
    assert spec.speculation_stats()["accepted_tokens"] > 0
    for a, b in zip(plain, got, strict=True):
        ca, cb = a.completions[0], b.completions[0]
        assert cb.token_ids == ca.token_ids
        assert ca.top_logprobs is not None and cb.top_logprobs is not None
        assert len(cb.top_logprobs) == len(cb.token_ids)
        for tok, ta, tb in zip(ca.token_ids, ca.top_logprobs, cb.top_logprobs, strict=True):
            assert [t for t, _ in tb] == [t for t, _ in ta] and tb[0][0] == tok
            assert [v for _, v in tb] == pytest.approx([v for _, v in ta], abs=1e-4)
