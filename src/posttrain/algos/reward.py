"""Reward-model losses as pure functions of scalar scores: the Bradley-Terry pairwise loss, its
pairwise accuracy, and the weighted mix of a learned reward with a verifier's.

The scores come from a reward model (`train.reward_model`); pairing the data and training are the caller's.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def bradley_terry(chosen_scores: Tensor, rejected_scores: Tensor, margin: float = 0.0) -> Tensor:
    """Per-pair Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - margin) (InstructGPT's reward
    loss; `margin` > 0 is Llama 2's margin term). Mean it for the batch loss. Its gradient in r_chosen
    is -sigmoid(-(r_chosen - r_rejected - margin)), the probability the model gives the wrong order."""
    if chosen_scores.shape != rejected_scores.shape:
        raise ValueError(
            f"bradley_terry: chosen and rejected scores must have the same shape, got "
            f"{tuple(chosen_scores.shape)} and {tuple(rejected_scores.shape)}"
        )
    return -F.logsigmoid(chosen_scores - rejected_scores - margin)


def pairwise_accuracy(chosen_scores: Tensor, rejected_scores: Tensor) -> float:
    """Share of pairs whose chosen response scores strictly higher (a tie counts as wrong)."""
    if chosen_scores.numel() == 0:
        return 0.0
    return float((chosen_scores > rejected_scores).float().mean().item())


def mix_rewards(verifier: float, learned: float, verifier_weight: float, learned_weight: float) -> float:
    """The reward an RL step trains on: verifier_weight x verifier + learned_weight x learned."""
    return verifier_weight * verifier + learned_weight * learned
