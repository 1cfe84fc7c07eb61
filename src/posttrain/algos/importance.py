"""Importance corrections between the behaviour policy (the engine, possibly stale) and the learner.

Truncated importance sampling weights (token or sequence level, capped), masking of tokens whose
ratio is out of range, and mismatch metrics. Pure functions; the Learner decides where they apply.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOG_RATIO_LIMIT = 20.0


def _log_ratio(learner_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor, level: str) -> Tensor:
    m = mask.to(learner_logprobs.dtype)
    log_r = (learner_logprobs - behavior_logprobs) * m
    if level == "token":
        return log_r
    if level == "sequence":
        return log_r.sum(-1, keepdim=True).expand_as(log_r) * m
    raise ValueError(f"unknown importance level '{level}'; choose 'token' or 'sequence'")


def tis_weights(
    learner_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor, cap: float, level: str = "token"
) -> Tensor:
    """min(pi_learner / pi_behavior, cap), per token or per sequence (product over its tokens).

    Detached; 0 where the mask is 0.
    """
    if cap <= 0:
        raise ValueError(f"TIS cap must be > 0, got {cap}")
    with torch.no_grad():
        log_r = _log_ratio(learner_logprobs, behavior_logprobs, mask, level)
        w = torch.exp(torch.clamp(log_r, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)).clamp_max(cap)
        return w * mask.to(w.dtype)


def ratio_mask(
    learner_logprobs: Tensor,
    behavior_logprobs: Tensor,
    mask: Tensor,
    low: float | None,
    high: float | None,
    level: str = "token",
) -> Tensor:
    """The mask with tokens (or whole sequences) whose ratio lies outside [low, high] set to 0."""
    with torch.no_grad():
        ratio = torch.exp(
            torch.clamp(
                _log_ratio(learner_logprobs, behavior_logprobs, mask, level),
                -LOG_RATIO_LIMIT,
                LOG_RATIO_LIMIT,
            )
        )
        keep = mask.bool()
        if low is not None:
            keep = keep & (ratio >= low)
        if high is not None:
            keep = keep & (ratio <= high)
        return keep.to(mask.dtype)


def mismatch_metrics(
    learner_logprobs: Tensor,
    behavior_logprobs: Tensor,
    mask: Tensor,
    cap: float | None = None,
    kept_mask: Tensor | None = None,
) -> dict[str, float]:
    """How far the behaviour logprobs are from the learner's on generated tokens.

    mismatch_abs_log_ratio: mean |log pi_learner - log pi_behavior|; mismatch_kl_k3: mean k3 estimate
    of KL(behavior || learner); tis_clip_frac: fraction of tokens whose ratio exceeds `cap`;
    ratio_masked_frac: fraction of tokens removed by `ratio_mask`.
    """
    with torch.no_grad():
        m = mask.to(torch.float32)
        n = m.sum().clamp_min(1.0)
        log_r = (learner_logprobs.float() - behavior_logprobs.float()) * m
        k3 = (torch.exp(torch.clamp(log_r, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)) - 1.0 - log_r) * m
        out = {
            "mismatch_abs_log_ratio": float((log_r.abs().sum() / n).item()),
            "mismatch_max_abs_log_ratio": float(log_r.abs().max().item()) if log_r.numel() else 0.0,
            "mismatch_kl_k3": float((k3.sum() / n).item()),
        }
        if cap is not None:
            out["tis_clip_frac"] = float((((torch.exp(log_r) > cap).float() * m).sum() / n).item())
        if kept_mask is not None:
            out["ratio_masked_frac"] = float(
                ((m - kept_mask.to(torch.float32)).clamp_min(0).sum() / n).item()
            )
        return out
