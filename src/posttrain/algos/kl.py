"""KL to the reference policy: per-token estimators k1/k2/k3 and the fixed/adaptive coefficient.

Estimators are pure functions of sampled-token logprobs. The controllers hold one float (and a
target) and expose state_dict/load_state_dict so a resumed run continues with the same coefficient.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3")
LOG_RATIO_LIMIT = 20.0


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman's k1/k2/k3).

    k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) + log r - 1  with log r = log pi - log pi_ref.
    k1 is unbiased but signed; k3 is unbiased and >= 0; k2 is biased and >= 0.
    """
    log_r = torch.clamp(logprobs - ref_logprobs, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    if kind == "k1":
        return log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        return torch.exp(-log_r) + log_r - 1.0
    raise ValueError(f"unknown KL estimator '{kind}'; choose one of {', '.join(KL_ESTIMATORS)}")


class KLController(Protocol):
    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...
    def state_dict(self) -> dict[str, float]: ...
    def load_state_dict(self, state: dict[str, float]) -> None: ...


class FixedKLController:
    def __init__(self, value: float) -> None:
        self.value = float(value)

    def update(self, current_kl: float, n_steps: int) -> None:
        return None

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. (2019): beta *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon."""

    def __init__(self, init_value: float, target: float, horizon: int) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target}, {horizon}")
        self.value = float(init_value)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": float(self.horizon)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = int(state["horizon"])


def make_kl_controller(coef: float, target: float | None = None, horizon: int = 10000) -> KLController:
    return FixedKLController(coef) if target is None else AdaptiveKLController(coef, target, horizon)
