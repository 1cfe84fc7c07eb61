"""Turning next-token logits into tokens and their logprobs, one generator per sequence.

Order (as transformers applies it): repetition penalty, temperature, then top-k, top-p, min-p.
The logprob returned is that of the sampled token under the distribution after repetition penalty
and temperature, before truncation (for temperature 0, greedy, under the untempered softmax); a request's `top_logprobs`
N > 0 adds the N most likely (token, logprob) pairs under that same distribution. Each
row draws from its own torch.Generator, so a seeded sequence samples the same tokens whatever else
is in the batch. Does not decide when to stop (paged.py does).
"""

from __future__ import annotations

import torch

from posttrain.engine.types import SamplingParams

TopLogprobs = list[tuple[int, float]]  # (token id, logprob), most likely first

_MIX = 0x9E3779B97F4A7C15


def seed_for(seed: int, index: int) -> int:
    """The generator seed of completion `index` of a request seeded `seed` (distinct across (seed, index))."""
    return (seed * _MIX + index * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)


def apply_repetition_penalty(logits: torch.Tensor, token_ids: list[int], penalty: float) -> torch.Tensor:
    """HF semantics: a seen token's logit is divided by the penalty if positive, multiplied if negative."""
    if penalty == 1.0 or not token_ids:
        return logits
    ids = torch.tensor(sorted(set(token_ids)), dtype=torch.long, device=logits.device)
    seen = logits.index_select(-1, ids)
    logits = logits.clone()
    logits[..., ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, history: list[int], output: list[int]
) -> torch.Tensor:
    """The repetition penalty over `history` (prompt and completion), then OpenAI's presence and
    frequency penalties over `output` (the completion's tokens)."""
    logits = apply_repetition_penalty(logits, history, params.repetition_penalty)
    if not output or (params.presence_penalty == 0.0 and params.frequency_penalty == 0.0):
        return logits
    ids, counts = torch.tensor(output, dtype=torch.long, device=logits.device).unique(return_counts=True)
    cut = params.presence_penalty + params.frequency_penalty * counts.to(logits.dtype)
    return logits.index_add(-1, ids, -cut)


def truncate(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask (to -inf) what top-k, then top-p, then min-p exclude from one row of tempered logits."""
    neg = torch.finfo(logits.dtype).min
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, neg)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cum <= (1.0 - top_p)
        remove_sorted[-1] = False  # always keep the most likely token
        remove = torch.zeros_like(remove_sorted).scatter(0, order, remove_sorted)
        logits = logits.masked_fill(remove, neg)
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), neg)
    return logits


def reported_logits(
    logits: torch.Tensor, params: SamplingParams, history: list[int], output: list[int] = ()
) -> torch.Tensor:
    """One row of logits `[vocab]` whose log_softmax is the distribution logprobs are reported under:
    after the penalties and temperature (greedy: untempered)."""
    logits = apply_penalties(logits, params, history, list(output))
    return logits if params.temperature == 0.0 else logits / params.temperature


def top_logprobs_of(rows: torch.Tensor, ns: list[int]) -> list[TopLogprobs]:
    """The `ns[i]` most likely (token, logprob) pairs of each row of reported logits `rows` `[B, vocab]`
    (see `reported_logits`), in one batched topk; ties keep topk's order."""
    if not ns:
        return []
    return top_of_logprobs(torch.log_softmax(rows, -1), ns)


def top_of_logprobs(logprobs: torch.Tensor, ns: list[int]) -> list[TopLogprobs]:
    """The `ns[i]` largest (token, logprob) pairs of each row of log-probabilities `[B, vocab]`, one topk;
    impossible tokens (logprob -inf, as a grammar's mask leaves them) are never listed."""
    if not ns:
        return []
    k = min(max(ns), logprobs.shape[-1])
    values, ids = logprobs.topk(k, dim=-1)
    vals, toks = values.tolist(), ids.tolist()
    return [
        [(t, v) for t, v in zip(toks[i][:n], vals[i][:n], strict=True) if v != float("-inf")]
        for i, n in enumerate(ns)
    ]


def sample_row(
    logits: torch.Tensor,
    params: SamplingParams,
    history: list[int],
    generator: torch.Generator,
    output: list[int] = (),
) -> tuple[int, float, TopLogprobs | None]:
    """One token, its logprob and (for `params.top_logprobs` > 0, else None) the top-N (token, logprob)
    pairs, from one row of float32 logits `[vocab]`; `history` feeds the repetition penalty, `output`
    (the completion so far) the presence and frequency penalties."""
    token, lp = _sample_row(logits, params, history, generator, output)
    if params.top_logprobs <= 0:
        return token, lp, None
    return (
        token,
        lp,
        top_logprobs_of(reported_logits(logits, params, history, output)[None, :], [params.top_logprobs])[0],
    )


def _sample_row(
    logits: torch.Tensor,
    params: SamplingParams,
    history: list[int],
    generator: torch.Generator,
    output: list[int] = (),
) -> tuple[int, float]:
    """One token and its logprob from one row of float32 logits `[vocab]`."""
    logits = apply_penalties(logits, params, history, list(output))
    if params.temperature == 0.0:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, -1)[token])
    tempered = logits / params.temperature
    uniform = torch.rand(1, generator=generator, dtype=torch.float64)
    if not (params.top_k or params.top_p < 1.0 or params.min_p > 0.0):
        tokens, lps = _sample_untruncated(tempered[None, :], uniform)  # as sample() batches them
        return int(tokens[0]), float(lps[0])
    probs = truncate(tempered, params.top_k, params.top_p, params.min_p).softmax(-1)
    token = int(_inverse_cdf(probs[None, :], uniform)[0])
    return token, float(torch.log_softmax(tempered, -1)[token])


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` `[B, V]` from one uniform in [0, 1) per row (float64 cumsum).

    The target (1 - u) * total lies in (0, total], so the first index whose cumulative mass reaches it
    always has non-zero probability."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    target = (1.0 - uniforms) * cdf[:, -1]
    return torch.searchsorted(cdf, target[:, None]).clamp_(max=probs.shape[-1] - 1)[:, 0]


_CDF_CHUNK = 1024  # the inverse CDF runs over per-chunk sums, then within one chunk (no full-vocab scan)


def _sample_untruncated(tempered: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and their logprobs from tempered logits `[B, V]`, one uniform per row.

    Inverse CDF in two levels: the chunk of the vocabulary whose cumulative mass (float64 over float32
    chunk sums) first reaches the target, then the token within that chunk (a float64 cumsum of one
    chunk), instead of a float64 cumsum over the whole vocabulary (several times slower on CPU). The
    chosen token always has non-zero probability."""
    B, V = tempered.shape
    probs = torch.softmax(tempered, -1)
    nc = -(-V // _CDF_CHUNK)
    padded = probs if nc * _CDF_CHUNK == V else torch.nn.functional.pad(probs, (0, nc * _CDF_CHUNK - V))
    chunks = padded.view(B, nc, _CDF_CHUNK)
    chunk_cdf = chunks.sum(-1).double().cumsum(-1)
    target = (1.0 - uniforms) * chunk_cdf[:, -1]  # in (0, total]
    c = torch.searchsorted(chunk_cdf, target[:, None]).clamp_(max=nc - 1)  # [B, 1]
    before = torch.where(c > 0, chunk_cdf.gather(1, (c - 1).clamp(min=0)), 0.0)[:, 0]
    local_cdf = chunks[torch.arange(B), c[:, 0]].cumsum(-1, dtype=torch.float64)  # [B, chunk]
    local_target = torch.minimum(target - before, local_cdf[:, -1])  # > 0: chunk c holds mass
    j = torch.searchsorted(local_cdf, local_target[:, None]).clamp_(max=_CDF_CHUNK - 1)[:, 0]
    tokens = c[:, 0] * _CDF_CHUNK + j
    return tokens, probs.gather(-1, tokens[:, None])[:, 0].double().log()


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[list[int]],
    generators: list[torch.Generator],
    outputs: list[list[int]] | None = None,
) -> tuple[list[int], list[float], list[TopLogprobs | None]]:
    """Tokens, logprobs and top logprobs for a batch `[B, vocab]`; greedy rows without penalties go
    through one argmax. `tops[i]` is None for a row whose `top_logprobs` is 0, else its top-N
    (token, logprob) pairs under the distribution `logprobs[i]` is reported under (one batched topk over
    those rows)."""
    B = logits.shape[0]
    tokens: list[int] = [0] * B
    logprobs: list[float] = [0.0] * B
    outs = outputs if outputs is not None else [[] for _ in range(B)]
    simple_greedy = [i for i, p in enumerate(params) if p.temperature == 0.0 and not p.penalised]
    if simple_greedy:
        rows = logits if len(simple_greedy) == B else logits.index_select(0, torch.tensor(simple_greedy))
        top = rows.argmax(-1)
        lp = torch.log_softmax(rows, -1).gather(-1, top[:, None])[:, 0]
        for j, i in enumerate(simple_greedy):
            tokens[i], logprobs[i] = int(top[j]), float(lp[j])
    plain = [
        i
        for i, p in enumerate(params)
        if p.temperature > 0.0 and not p.penalised and not (p.top_k or p.top_p < 1.0 or p.min_p > 0.0)
    ]
    if plain:
        rows = logits if len(plain) == B else logits.index_select(0, torch.tensor(plain))
        temps = [params[i].temperature for i in plain]
        if any(t != 1.0 for t in temps):
            rows = rows / torch.tensor(temps, dtype=logits.dtype)[:, None]
        uniforms = torch.cat([torch.rand(1, generator=generators[i], dtype=torch.float64) for i in plain])
        top, lp = _sample_untruncated(rows, uniforms)
        for j, i in enumerate(plain):
            tokens[i], logprobs[i] = int(top[j]), float(lp[j])
    done = set(simple_greedy) | set(plain)
    for i in range(B):
        if i not in done:
            tokens[i], logprobs[i] = _sample_row(logits[i], params[i], histories[i], generators[i], outs[i])
    tops: list[TopLogprobs | None] = [None] * B
    want = [i for i, p in enumerate(params) if p.top_logprobs > 0]
    if want:
        rows = torch.stack([reported_logits(logits[i], params[i], histories[i], outs[i]) for i in want])
        for i, top in zip(want, top_logprobs_of(rows, [params[i].top_logprobs for i in want]), strict=True):
            tops[i] = top
    return tokens, logprobs, tops
