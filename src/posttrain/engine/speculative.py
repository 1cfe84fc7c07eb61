"""Speculative decoding for the paged engine: prompt-lookup drafts and the exact acceptance rule.

Owns the n-gram index of one sequence (which earlier positions follow each of its recent n-grams, kept
up to date as tokens are appended, so a lookup costs a few dict probes however long the sequence is),
the draft it proposes, and the verification of a draft against the target model's logits at every
drafted position. Verification follows Leviathan et al. (2023) for a deterministic draft: draft token
d is accepted with probability p(d) under the distribution the sampler would draw from (temperature,
then top-k/top-p/min-p), and the first rejected position draws from p with d removed, so every emitted
token has exactly the distribution plain decoding gives; under greedy a draft token is accepted iff it
is the argmax, so the output is plain greedy decoding's. Does not schedule or run the model (paged.py).
"""

from __future__ import annotations

import torch

from posttrain.engine.sampling import TopLogprobs, top_of_logprobs, truncate
from posttrain.engine.types import SamplingParams


class NgramIndex:
    """For n in [min_n, max_n]: the latest start of each n-gram of the sequence that has a token after it."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]

    def extend(self, tokens: list[int]) -> None:
        for tok in tokens:
            self.tokens.append(tok)
            end = len(self.tokens) - 1  # the n-grams ending just before the new token now have a successor
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.latest[n][tuple(self.tokens[end - n : end])] = end - n

    def sync(self, tokens: list[int]) -> None:
        """Catch up with `tokens`, the sequence's ids (which only ever grow by appending)."""
        if len(tokens) > len(self.tokens):
            self.extend(tokens[len(self.tokens) :])

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        toks = self.tokens
        L = len(toks)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            start = self.latest[n].get(tuple(toks[L - n :]))
            if start is not None:
                return toks[start + n : min(start + n + k, L)]
        return []

    def copy(self) -> NgramIndex:
        out = NgramIndex(self.min_n, self.max_n)
        out.tokens = list(self.tokens)
        out.latest = [dict(d) for d in self.latest]
        return out


def can_speculate(params: SamplingParams) -> bool:
    """Whether a request's sampling allows exact verification here (a penalty changes each position's
    distribution with the tokens before it, and a json_schema grammar masks each position by the tokens
    before it, so those requests decode one token a step)."""
    return not params.penalised and params.json_schema is None


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the sampler draws from, for rows of float32 logits `[n, vocab]` (temperature > 0)."""
    tempered = logits / params.temperature
    if params.top_k or params.top_p < 1.0 or params.min_p > 0.0:
        tempered = torch.stack([truncate(row, params.top_k, params.top_p, params.min_p) for row in tempered])
    return tempered.softmax(-1)


def verify(
    logits: torch.Tensor, draft: list[int], params: SamplingParams, generator: torch.Generator
) -> tuple[list[int], list[float], int, list[TopLogprobs] | None]:
    """Tokens to append after checking `draft` against the target logits `[len(draft) + 1, vocab]` (row i
    predicts the token at draft position i; the last row follows the whole draft).

    Returns (tokens, their logprobs, drafts accepted, top logprobs): the accepted draft tokens, then one
    token from the target (the correction at the first rejection, or the bonus token after a fully
    accepted draft). Logprobs are those `sample()` reports: under the tempered, untruncated distribution
    (greedy: the untempered one); top logprobs (None unless `params.top_logprobs` > 0) are the top-N
    (token, logprob) pairs of every emitted token under that same distribution, as `sample()` gives them."""
    k = len(draft)
    if logits.shape[0] != k + 1:
        raise ValueError(f"verify needs {k + 1} logit rows for {k} draft tokens, got {logits.shape[0]}")
    if params.temperature == 0.0:
        best = logits.argmax(-1).tolist()
        a = 0
        while a < k and best[a] == draft[a]:
            a += 1
        tokens = draft[:a] + [best[a]]
        lps = torch.log_softmax(logits[: a + 1], -1)
    else:
        probs = target_probs(logits, params)
        # k acceptance tests, then one fresh uniform for the emitted token (a rejection's uniform is not
        # uniform any more once it is known to exceed p(d))
        uniforms = torch.rand(k + 1, generator=generator, dtype=torch.float64).tolist()
        a = 0
        while a < k and uniforms[a] < float(probs[a, draft[a]]):
            a += 1
        p = probs[a]
        if a < k:  # rejected: the residual max(p - q, 0) of a one-hot draft is p without the draft token
            p = p.clone()
            p[draft[a]] = 0.0
        cdf = p.cumsum(-1, dtype=torch.float64)
        target = (1.0 - uniforms[k]) * float(cdf[-1])  # in (0, total]: never a zero-probability token
        last = int(
            torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64)).clamp_(max=p.numel() - 1)
        )
        tokens = draft[:a] + [last]
        lps = torch.log_softmax(logits[: a + 1] / params.temperature, -1)
    rows = torch.arange(a + 1)
    tops = top_of_logprobs(lps, [params.top_logprobs] * (a + 1)) if params.top_logprobs > 0 else None
    return tokens, lps[rows, torch.tensor(tokens)].tolist(), a, tops
