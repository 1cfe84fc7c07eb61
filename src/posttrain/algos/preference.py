"""Preference losses over (chosen, rejected) pairs: DPO, IPO and SimPO, as pure functions of
per-sequence summed logprobs (the policy's, and the reference model's where the loss has one).

Each returns per-pair losses (average them for the batch loss) and the implicit rewards of both
responses. Computing the logprobs, pairing the data and training on it are the caller's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.algos.registry import register_preference_loss


@dataclass
class PreferenceLossOutput:
    loss: Tensor  # [B] per-pair loss (mean it for the batch loss)
    chosen_rewards: Tensor  # [B] implicit reward of the chosen response (detached)
    rejected_rewards: Tensor  # [B] implicit reward of the rejected response (detached)

    @property
    def reward_margin(self) -> Tensor:
        return self.chosen_rewards - self.rejected_rewards

    @property
    def reward_accuracy(self) -> Tensor:
        """Share of pairs whose chosen response has the higher implicit reward."""
        return (self.chosen_rewards > self.rejected_rewards).float().mean()


def _log_ratios(
    name: str,
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    reference_chosen: Tensor | None,
    reference_rejected: Tensor | None,
) -> tuple[Tensor, Tensor]:
    if reference_chosen is None or reference_rejected is None:
        raise ValueError(f"{name} needs the reference model's logprobs of both responses")
    return policy_chosen - reference_chosen, policy_rejected - reference_rejected


@register_preference_loss("dpo", knobs={"beta": "beta", "label_smoothing": "label_smoothing"})
def dpo(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor | None,
    reference_rejected_logps: Tensor | None,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    chosen_tokens: Tensor | None = None,
    rejected_tokens: Tensor | None = None,
) -> PreferenceLossOutput:
    """DPO (Rafailov et al. 2023): -log sigmoid(beta * ((pc - rc) - (pr - rr))).

    `label_smoothing` eps > 0 is conservative DPO (the preference label is wrong with probability eps):
    -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h). Lengths are not used."""
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"dpo: label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen, rejected = _log_ratios(
        "dpo", policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps
    )
    logits = beta * (chosen - rejected)
    loss = -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return PreferenceLossOutput(loss, (beta * chosen).detach(), (beta * rejected).detach())


@register_preference_loss("ipo", knobs={"tau": "tau"})
def ipo(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor | None,
    reference_rejected_logps: Tensor | None,
    *,
    tau: float = 0.1,
    chosen_tokens: Tensor | None = None,
    rejected_tokens: Tensor | None = None,
) -> PreferenceLossOutput:
    """IPO (Azar et al. 2023): (((pc - rc) - (pr - rr)) - 1 / (2 tau))^2.

    A squared loss that pulls the log-ratio gap to the target 1/(2 tau) instead of pushing it to
    infinity as DPO does; a gap beyond the target is pulled back. Implicit rewards are the log ratios.
    (TRL feeds it length-averaged logprobs; pass those here for that variant.)"""
    if tau <= 0:
        raise ValueError(f"ipo: tau must be > 0, got {tau}")
    chosen, rejected = _log_ratios(
        "ipo", policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps
    )
    loss = ((chosen - rejected) - 1.0 / (2.0 * tau)) ** 2
    return PreferenceLossOutput(loss, chosen.detach(), rejected.detach())


@register_preference_loss("simpo", reference=False, knobs={"beta": "simpo_beta", "gamma": "simpo_gamma"})
def simpo(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor | None = None,
    reference_rejected_logps: Tensor | None = None,
    *,
    beta: float = 2.0,
    gamma: float = 1.0,
    chosen_tokens: Tensor | None = None,
    rejected_tokens: Tensor | None = None,
) -> PreferenceLossOutput:
    """SimPO (Meng et al. 2024): -log sigmoid(beta/|yc| log p(yc) - beta/|yr| log p(yr) - gamma).

    No reference model: the implicit reward is the length-normalised logprob times beta, and gamma is
    the target reward margin. `chosen_tokens` / `rejected_tokens` are the responses' token counts."""
    if reference_chosen_logps is not None or reference_rejected_logps is not None:
        raise ValueError("simpo uses no reference model: pass None as the reference logprobs")
    if chosen_tokens is None or rejected_tokens is None:
        raise ValueError("simpo needs chosen_tokens and rejected_tokens (the responses' lengths)")
    lc = torch.as_tensor(chosen_tokens, dtype=policy_chosen_logps.dtype, device=policy_chosen_logps.device)
    lr = torch.as_tensor(rejected_tokens, dtype=policy_chosen_logps.dtype, device=policy_chosen_logps.device)
    if bool((lc <= 0).any()) or bool((lr <= 0).any()):
        raise ValueError("simpo: every response needs at least one token")
    chosen = beta * policy_chosen_logps / lc
    rejected = beta * policy_rejected_logps / lr
    loss = -F.logsigmoid(chosen - rejected - gamma)
    return PreferenceLossOutput(loss, chosen.detach(), rejected.detach())
