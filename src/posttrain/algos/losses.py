"""Policy losses (ppo_clip with asymmetric and dual clip, gspo), value loss, entropy, aggregation.

Losses return per-token loss matrices; `aggregation_weights` turns a mask into per-token weights so
that a loss split over micro-batches sums to exactly the mini-batch aggregate. Pure functions only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.algos.registry import register_policy_loss

AGG_MODES = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")
LOG_RATIO_LIMIT = 20.0


def aggregation_weights(mask: Tensor, mode: str, norm_tokens: float | None = None) -> Tensor:
    """Per-token weights w with `aggregate(L, mask, mode) == (L * w).sum()`.

    token_mean:              sum L / (generated tokens in the batch)
    seq_mean_token_sum:      mean over sequences of (sum L over the sequence)
    seq_mean_token_mean:     mean over sequences of (mean L over the sequence); empty ones give 0
    seq_mean_token_sum_norm: mean over sequences of (sum L / norm_tokens), norm_tokens a constant that
                             Dr. GRPO takes as the generation budget (required: a batch-dependent width,
                             such as the padded length with its prompt, would scale the gradient with it)
    Sequence means divide by all rows B, including rows whose mask is all zero.
    """
    m = mask.to(torch.float32)
    rows = max(m.shape[0], 1)
    if mode == "token_mean":
        return m / m.sum().clamp_min(1.0)
    if mode == "seq_mean_token_sum":
        return m / rows
    if mode == "seq_mean_token_mean":
        return m / (m.sum(-1, keepdim=True).clamp_min(1.0) * rows)
    if mode == "seq_mean_token_sum_norm":
        if norm_tokens is None:
            raise ValueError(
                "seq_mean_token_sum_norm needs norm_tokens, a constant (Dr. GRPO: the generation budget)"
            )
        norm = float(norm_tokens)
        if norm <= 0:
            raise ValueError(f"seq_mean_token_sum_norm needs norm_tokens > 0, got {norm}")
        return m / (norm * rows)
    raise ValueError(f"unknown loss aggregation '{mode}'; choose one of {', '.join(AGG_MODES)}")


def aggregate(loss_mat: Tensor, mask: Tensor, mode: str, norm_tokens: float | None = None) -> Tensor:
    return (loss_mat * aggregation_weights(mask, mode, norm_tokens).to(loss_mat.dtype)).sum()


@dataclass
class PolicyLossOutput:
    loss_tokens: Tensor  # [B, T] per-token loss (importance weights applied), to be aggregated
    clipped: Tensor  # [B, T] bool: the clip (either edge or the dual clip) was active
    ratio: Tensor  # [B, T] pi / pi_old (detached)


def _ratio(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    return torch.exp(torch.clamp(logprobs - old_logprobs, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float, dual_clip: float | None
) -> tuple[Tensor, Tensor]:
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        bound = -advantages * dual_clip
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        was_clipped = was_clipped | dual
    return loss, was_clipped


@register_policy_loss("ppo_clip")
def ppo_clip(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    weights: Tensor | None = None,
    **_: object,
) -> PolicyLossOutput:
    """max(-A r, -A clip(r, 1-clip_low, 1+clip_high)), and for A < 0 at most -A * dual_clip.

    `weights` (e.g. truncated importance weights, detached) multiply the per-token loss.
    """
    ratio = _ratio(logprobs, old_logprobs)
    loss, clipped = _clipped_surrogate(ratio, advantages, clip_low, clip_high, dual_clip)
    if weights is not None:
        loss = loss * weights.detach()
    m = mask.to(loss.dtype)
    return PolicyLossOutput(loss * m, clipped & (m > 0), ratio.detach())


@register_policy_loss("gspo")
def gspo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    dual_clip: float | None = None,
    weights: Tensor | None = None,
    **_: object,
) -> PolicyLossOutput:
    """GSPO: the clipped surrogate on the sequence ratio s = exp(mean_t log(pi/pi_old)).

    Token form s_t = sg(s) * pi_t / sg(pi_t): its value is s, its gradient s * grad log pi_t, so
    with seq_mean_token_mean aggregation the gradient is GSPO's. Clip ranges are GSPO-sized (1e-4s).
    """
    m = mask.to(logprobs.dtype)
    diff = (logprobs - old_logprobs) * m
    seq_log_ratio = diff.sum(-1) / m.sum(-1).clamp_min(1.0)
    log_s = seq_log_ratio.detach()[:, None] + logprobs - logprobs.detach()
    ratio = torch.exp(torch.clamp(log_s, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    loss, clipped = _clipped_surrogate(ratio, advantages, clip_low, clip_high, dual_clip)
    if weights is not None:
        loss = loss * weights.detach()
    return PolicyLossOutput(loss * m, clipped & (m > 0), ratio.detach())


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float | None = None
) -> tuple[Tensor, Tensor]:
    """Per-token 0.5 * max((v - R)^2, (v_clipped - R)^2), v_clipped = v_old + clip(v - v_old, +-clip).

    Returns (loss_tokens, clipped) where clipped marks tokens where the clipped branch was larger.
    """
    unclipped = (values - returns) ** 2
    if clip is None:
        loss = 0.5 * unclipped
        was = torch.zeros_like(loss, dtype=torch.bool)
    else:
        v_clip = old_values + torch.clamp(values - old_values, -clip, clip)
        clipped = (v_clip - returns) ** 2
        loss = 0.5 * torch.maximum(unclipped, clipped)
        was = clipped > unclipped
    m = mask.to(loss.dtype)
    return loss * m, was & (m > 0)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(z) - sum softmax(z) z."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    return lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
