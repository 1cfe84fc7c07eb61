"""Loss terms: the seam between the Learner's micro-batch loop and the math in `posttrain.algos`.

`LossInputs` holds one micro-batch's tensors; a `LossTerm` turns them into a `TermResult` (its share of
the loss, or None when it adds nothing this time, and its metrics). The loop adds up the terms it is
handed, in order, and differentiates the sum: it knows no term by name. This module builds the RL term
set from the config (`policy_terms`, `critic_terms`), loads a user's policy loss by import path
(`algorithm.policy_loss: {type: custom, path: "pkg.mod:Class", kwargs: {...}}`), and holds the
supervised (`NllTerm`) and preference (`PreferenceTerm`) terms. It runs no model.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from posttrain.algos import (
    get_policy_loss,
    get_preference_loss,
    kl_estimate,
    masked_nll,
    value_loss,
)


@dataclass
class LossInputs:
    """One micro-batch, `[b, L]` tensors in token-position layout (0 off the masks)."""

    logprobs: Tensor  # the policy's, with gradient
    weights: Tensor  # per-token aggregation weights of the loss (algorithm.loss_agg; token mean for SFT)
    loss_mask: Tensor  # 1 on generated (trained) tokens
    entropy: Tensor | None = None  # the policy's per-token entropy, with gradient
    mask: Tensor | None = None  # the policy loss's mask: loss_mask x the ratio mask
    old_logprobs: Tensor | None = None  # the policy before the update (detached)
    ref_logprobs: Tensor | None = None  # the reference's, when a KL is taken
    behavior_logprobs: Tensor | None = None  # the engine's
    advantages: Tensor | None = None
    is_weights: Tensor | None = None  # truncated importance weights behaviour -> learner (detached)
    token_weights: Tensor | None = None  # token-mean weights (the value loss's aggregation)
    values: Tensor | None = None  # the critic's, with gradient (critic terms only)
    old_values: Tensor | None = None
    returns: Tensor | None = None
    token_share: float = 1.0  # this micro-batch's share of its mini-batch's sequence tokens
    grad_scale: float = 1.0  # the loss scale of this rank's micro-batch (data parallel; 0: a repeat)


@dataclass
class TermResult:
    """A term's contribution to the loss (None: none this time) and its metrics: `sums` add up over a
    mini-batch's micro-batches, `means` are (value, weight) pairs averaged by weight over the update,
    `maxima` keep their largest value."""

    loss: Tensor | None
    sums: dict[str, float] = field(default_factory=dict)
    means: dict[str, tuple[float, float]] = field(default_factory=dict)
    maxima: dict[str, float] = field(default_factory=dict)


class LossTerm(Protocol):
    """One term of the loss. `sums` names the keys its results' `sums` always hold (the loop reduces them
    over data-parallel ranks in that order, so every rank must know them before any micro-batch)."""

    sums: tuple[str, ...]

    def __call__(self, inputs: LossInputs) -> TermResult: ...


def add_terms(terms: Sequence[LossTerm], inputs: LossInputs) -> tuple[Tensor | None, list[TermResult]]:
    """The sum of the terms' losses, in order (None when none adds one), and their results."""
    total: Tensor | None = None
    results = []
    for term in terms:
        out = term(inputs)
        results.append(out)
        if out.loss is not None:
            total = out.loss if total is None else total + out.loss
    return total, results


# ----------------------------------------------------------------------------------------------
# the RL terms


class PolicyLossTerm:
    """A registered policy loss (`@register_policy_loss`): `fn(logprobs, old, advantages, mask, **params)`
    aggregated with the micro-batch's weights. Metrics: policy_loss (summed), clipfrac and approx_kl
    (token means over the policy mask), ratio_max."""

    sums = ("policy_loss",)

    def __init__(self, fn: Any, params: dict[str, Any]) -> None:
        self.fn, self.params = fn, params

    def __call__(self, x: LossInputs) -> TermResult:
        assert x.old_logprobs is not None and x.advantages is not None and x.mask is not None
        out = self.fn(x.logprobs, x.old_logprobs, x.advantages, x.mask, **self.params, weights=x.is_weights)
        loss = (out.loss_tokens * x.weights).sum()
        m = x.mask > 0
        n = float(m.sum().item())
        with torch.no_grad():
            log_ratio = (x.logprobs - x.old_logprobs)[m]
            result = TermResult(
                loss,
                sums={"policy_loss": float(loss.item())},
                means={
                    "clipfrac": (float(out.clipped[m].float().mean().item()) if n else 0.0, n),
                    "approx_kl": (
                        float((torch.exp(-log_ratio) - 1 + log_ratio).mean().item()) if n else 0.0,
                        n,
                    ),
                },
            )
            if n:
                result.maxima["ratio_max"] = float(out.ratio[m].max().item())
        return result


class EntropyTerm:
    """-coef x the aggregated entropy (a bonus); `coef` may move between steps (algorithm.entropy_floor).
    Reports the token-mean entropy whatever the coefficient."""

    sums = ()

    def __init__(self, coef: float) -> None:
        self.coef = coef

    def __call__(self, x: LossInputs) -> TermResult:
        assert x.entropy is not None
        loss = -(self.coef * (x.entropy * x.weights).sum()) if self.coef != 0.0 else None
        with torch.no_grad():
            n = float(x.loss_mask.sum().item())
            mean = float(x.entropy[x.loss_mask > 0].mean().item())
        return TermResult(loss, means={"entropy": (mean, n)})


class KlTerm:
    """coef x the aggregated KL estimate of the policy from the reference (the KL as a loss, when it is not
    folded into the reward); the coefficient is the KL controller's at the call. Metric kl_loss."""

    sums = ()

    def __init__(self, controller: Any, estimator: str) -> None:
        self.controller, self.estimator = controller, estimator

    def __call__(self, x: LossInputs) -> TermResult:
        if x.ref_logprobs is None or self.controller.value <= 0:
            return TermResult(None)
        kl_tok = kl_estimate(x.logprobs, x.ref_logprobs, self.estimator) * x.loss_mask
        kl = (kl_tok * x.weights).sum()
        return TermResult(self.controller.value * kl, means={"kl_loss": (float(kl.item()), 1.0)})


class MoeAuxTerm:
    """The MoE routers' auxiliary losses of the last forward (train/moe.py), weighted by the micro-batch's
    share of the mini-batch's tokens."""

    sums = ()

    def __init__(self, moe: Any) -> None:
        self.moe = moe

    def __call__(self, x: LossInputs) -> TermResult:
        aux = self.moe.loss()
        return TermResult(None if aux is None else aux * x.token_share)


class ValueTerm:
    """value_coef x the token-mean clipped value loss (a critic term: it differentiates the critic),
    scaled like the policy's loss by `grad_scale`. Metrics: value_loss (summed), vf_clipfrac."""

    sums = ("value_loss",)

    def __init__(self, coef: float, clip: float | None) -> None:
        self.coef, self.clip = coef, clip

    def __call__(self, x: LossInputs) -> TermResult:
        assert x.values is not None and x.old_values is not None and x.returns is not None
        assert x.token_weights is not None
        tokens, clipped = value_loss(x.values, x.old_values, x.returns, x.loss_mask, self.clip)
        loss = (tokens * x.token_weights).sum()
        n = float(x.loss_mask.sum().item())
        return TermResult(
            self.coef * x.grad_scale * loss,
            sums={"value_loss": float(loss.item())},
            means={"vf_clipfrac": (float(clipped[x.loss_mask > 0].float().mean().item()), n)},
        )


def load_custom_term(path: str, kwargs: dict[str, Any]) -> LossTerm:
    """`Class(**kwargs)` of the class at `path` ('package.module:Class')."""
    module_name, _, name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"algorithm.policy_loss.path '{path}': cannot load it ({err})") from None
    return cls(**kwargs)


def policy_loss_term(algo_cfg: Any) -> LossTerm:
    """The policy-loss term of `algorithm.policy_loss`: a registered loss with its config's parameters over
    the clipped surrogate's shared ones (algorithm.clip_low/clip_high/dual_clip), or a custom class."""
    cfg = algo_cfg.policy_loss
    if isinstance(cfg, str):  # a config built past validation (model_construct)
        name, own = cfg, {}
    else:
        own = cfg.model_dump(exclude={"type"})
        name = cfg.type
        if "path" in own:
            return load_custom_term(own["path"], own["kwargs"])
    params = {"clip_low": algo_cfg.clip_low, "clip_high": algo_cfg.clip_high, "dual_clip": algo_cfg.dual_clip}
    return PolicyLossTerm(get_policy_loss(name), {**params, **own})


def policy_terms(
    policy_loss: LossTerm, algo_cfg: Any, kl_controller: Any, entropy: EntropyTerm, moe: Any = None
) -> list[LossTerm]:
    """The RL step's terms on the policy, in the order they are added: the policy loss, MoE auxiliary
    losses (an MoE policy), the entropy bonus, the KL loss (unless the KL is folded into the reward)."""
    terms: list[LossTerm] = [policy_loss]
    if moe is not None:
        terms.append(MoeAuxTerm(moe))
    terms.append(entropy)
    if not algo_cfg.kl_in_reward:
        terms.append(KlTerm(kl_controller, algo_cfg.kl_estimator))
    return terms


def critic_terms(algo_cfg: Any) -> list[LossTerm]:
    """The RL step's terms on the critic: the value loss."""
    return [ValueTerm(algo_cfg.value_coef, algo_cfg.value_clip)]


# ----------------------------------------------------------------------------------------------
# supervised and preference terms


class NllTerm:
    """The weighted negative log-likelihood of the loss-masked tokens (SFT, and replay's nll)."""

    sums = ("nll",)

    def __call__(self, x: LossInputs) -> TermResult:
        loss = masked_nll(x.logprobs, x.weights)
        return TermResult(loss, sums={"nll": float(loss.item())})


@dataclass
class PairInputs:
    """Per-sequence logprob sums of k (chosen, rejected) pairs and their references (None: no reference)."""

    chosen: Tensor
    rejected: Tensor
    ref_chosen: Tensor | None
    ref_rejected: Tensor | None
    chosen_tokens: Tensor
    rejected_tokens: Tensor
    pairs: int  # all pairs of the step: each pair's loss is divided by it


class PreferenceTerm:
    """A registered preference loss (`@register_preference_loss`: dpo, ipo, simpo) with its
    hyperparameters, averaged over the step's pairs. Metrics (sums over pairs): loss, margin,
    chosen_reward, rejected_reward, correct."""

    sums = ("loss", "margin", "chosen_reward", "rejected_reward", "correct")

    def __init__(self, name: str, params: dict[str, Any]) -> None:
        self.fn, self.params = get_preference_loss(name), params

    def __call__(self, x: PairInputs) -> TermResult:
        out = self.fn(
            x.chosen,
            x.rejected,
            x.ref_chosen,
            x.ref_rejected,
            chosen_tokens=x.chosen_tokens,
            rejected_tokens=x.rejected_tokens,
            **self.params,
        )
        loss = out.loss.sum() / x.pairs
        return TermResult(
            loss,
            sums={
                "loss": float(loss.item()),
                "margin": float(out.reward_margin.sum().item()),
                "chosen_reward": float(out.chosen_rewards.sum().item()),
                "rejected_reward": float(out.rejected_rewards.sum().item()),
                "correct": float((out.chosen_rewards > out.rejected_rewards).sum().item()),
            },
        )
