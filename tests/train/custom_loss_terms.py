"""A policy-loss term that lives outside the package: test_custom_loss.py loads it by import path."""

from __future__ import annotations

from posttrain.train.terms import LossInputs, TermResult


class ScaledLogprob:
    """coef x the aggregated logprob of the trained tokens (coef > 0 pushes them down, < 0 up)."""

    sums = ("policy_loss",)

    def __init__(self, coef: float) -> None:
        self.coef = coef

    def __call__(self, x: LossInputs) -> TermResult:
        loss = self.coef * (x.logprobs * x.weights).sum()
        return TermResult(loss, sums={"policy_loss": float(loss.item())})
