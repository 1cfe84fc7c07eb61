"""Advantage estimators: gae, grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline.

Pure functions over `[batch, tokens]` tensors in token-position layout (column t is token t of the
sequence; `mask` is 1 where the model generated token t). Each returns advantages, returns and a
per-sequence flag for groups whose scores are all equal. No state, no model, no config objects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.algos.registry import register_advantage

EQUAL_SCORE_ATOL = 1e-6


@dataclass
class AdvantageOutput:
    advantages: Tensor  # [B, T], zero where mask is 0
    returns: Tensor  # [B, T]: regression targets for a value function (= advantages for critic-free ones)
    zero_signal: Tensor  # [B] bool: the sequence's group (size > 1) has all-equal scores


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp_min(1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp_min(1.0)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over masked entries (unbiased variance), zero where mask is 0."""
    mask_f = mask.to(x.dtype)
    n = mask_f.sum()
    mean = (x * mask_f).sum() / n.clamp_min(1.0)
    var = (((x - mean) ** 2) * mask_f).sum() / (n - 1).clamp_min(1.0)
    return (x - mean) * torch.rsqrt(var + eps) * mask_f


def sequence_scores(token_rewards: Tensor, mask: Tensor) -> Tensor:
    """A sequence's scalar score: the sum of its token rewards over generated tokens."""
    return (token_rewards * mask.to(token_rewards.dtype)).sum(-1)


@dataclass
class GroupStats:
    index: Tensor  # [B] dense group index 0..G-1
    size: Tensor  # [B] size of the row's group
    mean: Tensor  # [B] group mean of scores
    std: Tensor  # [B] unbiased group std (0 for singletons)
    equal: Tensor  # [B] bool: group has >1 member and all scores equal


def group_stats(scores: Tensor, group_ids: Tensor) -> GroupStats:
    if scores.ndim != 1 or group_ids.shape != scores.shape:
        raise ValueError(
            f"scores and group_ids must both be [B]; got {tuple(scores.shape)} and {tuple(group_ids.shape)}"
        )
    _, index = torch.unique(group_ids, return_inverse=True)
    g = int(index.max().item()) + 1 if index.numel() else 0
    ones = torch.ones_like(scores)
    count = torch.zeros(g, dtype=scores.dtype, device=scores.device).index_add_(0, index, ones)
    total = torch.zeros_like(count).index_add_(0, index, scores)
    mean = total / count
    sq = torch.zeros_like(count).index_add_(0, index, (scores - mean[index]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp_min(1.0))
    hi = torch.full_like(count, -float("inf")).scatter_reduce_(0, index, scores, reduce="amax")
    lo = torch.full_like(count, float("inf")).scatter_reduce_(0, index, scores, reduce="amin")
    equal = (hi - lo <= EQUAL_SCORE_ATOL) & (count > 1)
    return GroupStats(index, count[index], mean[index], std[index], equal[index])


def _outcome(adv_seq: Tensor, mask: Tensor, zero_signal: Tensor) -> AdvantageOutput:
    adv_seq = torch.where(zero_signal, torch.zeros_like(adv_seq), adv_seq)
    adv = adv_seq[:, None] * mask.to(adv_seq.dtype)
    return AdvantageOutput(adv, adv.clone(), zero_signal)


@register_advantage("grpo", group_baseline=True)
def grpo(
    token_rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    **_: object,
) -> AdvantageOutput:
    """(score - group mean) / (group std + eps), std unbiased. A group of one has no baseline: its
    advantage is 0 (its raw score would push every such answer up)."""
    scores = sequence_scores(token_rewards, mask)
    st = group_stats(scores, group_ids)
    multi = st.size > 1
    centred = torch.where(multi, scores - st.mean, torch.zeros_like(scores))
    std = torch.where(multi, st.std, torch.ones_like(st.std))
    adv = centred / (std + eps) if normalize_std else centred
    return _outcome(adv, mask, st.equal)


@register_advantage("dr_grpo", group_baseline=True)
def dr_grpo(token_rewards: Tensor, mask: Tensor, group_ids: Tensor, **_: object) -> AdvantageOutput:
    """Dr. GRPO: score - group mean, no std division (pair it with loss_agg=seq_mean_token_sum_norm)."""
    return grpo(token_rewards, mask, group_ids, normalize_std=False)


@register_advantage("rloo", group_baseline=True)
def rloo(token_rewards: Tensor, mask: Tensor, group_ids: Tensor, **_: object) -> AdvantageOutput:
    """Leave-one-out baseline: score_i - mean of the other members' scores; 0 for a group of one (no others)."""
    scores = sequence_scores(token_rewards, mask)
    st = group_stats(scores, group_ids)
    n = st.size
    others = (st.mean * n - scores) / (n - 1).clamp_min(1.0)
    adv = torch.where(n > 1, scores - others, torch.zeros_like(scores))
    return _outcome(adv, mask, st.equal)


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Return-to-go over generated tokens only: tokens with mask 0 neither earn nor discount."""
    m = mask.to(token_rewards.dtype)
    out = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        nxt = token_rewards[:, t] + gamma * running
        running = torch.where(m[:, t] > 0, nxt, running)
        out[:, t] = running * m[:, t]
    return out


@register_advantage("reinforce_pp")
def reinforce_pp(
    token_rewards: Tensor, mask: Tensor, group_ids: Tensor, *, gamma: float = 1.0, **_: object
) -> AdvantageOutput:
    """REINFORCE++: discounted return-to-go, whitened over all generated tokens of the batch.

    The baseline is the batch, not the group, so groups of equal score still carry signal here:
    they are flagged but not zeroed.
    """
    returns = discounted_returns(token_rewards, mask, gamma)
    adv = masked_whiten(returns, mask)
    st = group_stats(sequence_scores(token_rewards, mask), group_ids)
    return AdvantageOutput(adv, returns, st.equal)


@register_advantage("reinforce_pp_baseline", group_baseline=True)
def reinforce_pp_baseline(
    token_rewards: Tensor, mask: Tensor, group_ids: Tensor, **_: object
) -> AdvantageOutput:
    """REINFORCE++-baseline: score - group mean, then whitened over the batch's generated tokens.

    Groups of equal score are set to exactly zero after whitening (whitening would shift them).
    """
    scores = sequence_scores(token_rewards, mask)
    st = group_stats(scores, group_ids)
    centred = torch.where(st.size > 1, scores - st.mean, scores)
    m = mask.to(scores.dtype)
    adv = masked_whiten(centred[:, None] * m, mask)
    adv = torch.where(st.equal[:, None], torch.zeros_like(adv), adv)
    return AdvantageOutput(adv, centred[:, None] * m, st.equal)


@register_advantage("gae", needs_values=True)
def gae(
    token_rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    *,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten: bool = True,
    **_: object,
) -> AdvantageOutput:
    """Generalised advantage estimation over generated tokens (observation tokens are skipped).

    `values[:, t]` is V of the state before token t. Returns are the un-whitened advantages plus
    values (the critic's target); advantages are whitened over generated tokens when `whiten`.
    """
    if values is None:
        raise ValueError("advantage 'gae' needs values from a critic (trainer.critic = 'copy' or 'separate')")
    if values.shape != token_rewards.shape:
        raise ValueError(
            f"values {tuple(values.shape)} and token_rewards {tuple(token_rewards.shape)} differ in shape"
        )
    m = mask.to(token_rewards.dtype)
    values = values.to(token_rewards.dtype)
    adv = torch.zeros_like(token_rewards)
    next_value = torch.zeros_like(token_rewards[:, 0])
    last = torch.zeros_like(next_value)
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        on = m[:, t] > 0
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        cur = delta + gamma * lam * last
        adv[:, t] = cur * m[:, t]
        next_value = torch.where(on, values[:, t], next_value)
        last = torch.where(on, cur, last)
    returns = (adv + values) * m
    st = group_stats(sequence_scores(token_rewards, mask), group_ids)
    out = masked_whiten(adv, mask) if whiten else adv
    return AdvantageOutput(out, returns, st.equal)
