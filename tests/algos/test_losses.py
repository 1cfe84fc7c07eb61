"""Policy/value losses, aggregation modes and entropy against hand-computed values; the PPO gradient
against the policy-gradient estimator on a toy softmax policy."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algos import (
    aggregate,
    aggregation_weights,
    entropy_from_logits,
    get_policy_loss,
    list_policy_losses,
    value_loss,
)

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "norm", "expected"),
    [
        ("token_mean", None, 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq_mean_token_sum", None, 3.5),  # (3 + 4) / 2
        ("seq_mean_token_mean", None, 2.75),  # (1.5 + 4) / 2
        ("seq_mean_token_sum_norm", 10, 0.35),  # (3/10 + 4/10) / 2
    ],
)
def test_aggregation_modes(mode, norm, expected):
    assert aggregate(LOSS, MASK, mode, norm).item() == pytest.approx(expected)


def test_dr_grpo_divisor_is_a_constant_not_the_padded_width():
    # the same two completions behind prompts of 1 and of 6 tokens (mask 0 there): the gradient of the
    # aggregate with respect to each completion token's loss is 1 / (rows * norm) both times
    short = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    long = torch.cat([torch.zeros(2, 5), short], dim=1)
    grads = []
    for mask in (short, long):
        loss = torch.zeros_like(mask, requires_grad=True)
        aggregate(loss, mask, "seq_mean_token_sum_norm", 64).backward()
        grads.append(loss.grad[mask > 0])
    assert grads[0].tolist() == grads[1].tolist() == [1 / (2 * 64)] * 4
    with pytest.raises(ValueError, match="needs norm_tokens"):
        aggregation_weights(short, "seq_mean_token_sum_norm")


def test_aggregation_weights_split_over_micro_batches_sum_to_the_whole():
    w = aggregation_weights(MASK, "seq_mean_token_mean")
    parts = (LOSS[:1] * w[:1]).sum() + (LOSS[1:] * w[1:]).sum()
    assert parts.item() == pytest.approx(2.75)
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
        aggregation_weights(MASK, "mean")


def test_ppo_clip_asymmetric_edges():
    ratio = torch.tensor([[0.5, 1.5, 0.5, 1.5, 1.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 2.0]])
    mask = torch.ones_like(ratio)
    out = get_policy_loss("ppo_clip")(
        ratio.log(), torch.zeros_like(ratio), adv, mask, clip_low=0.2, clip_high=0.28
    )
    # A>0, r=.5: max(-.5, -.8) = -.5 (unclipped); A>0, r=1.5: max(-1.5, -1.28) = -1.28 (high edge)
    # A<0, r=.5: max(.5, .8) = .8 (low edge); A<0, r=1.5: max(1.5, 1.28) = 1.5 (unclipped); r=1: -2
    assert out.loss_tokens[0].tolist() == pytest.approx([-0.5, -1.28, 0.8, 1.5, -2.0], abs=1e-6)
    assert out.clipped[0].tolist() == [False, True, True, False, False]


def test_ppo_dual_clip_bounds_negative_advantage_loss():
    ratio = torch.tensor([[4.0, 2.0, 4.0]])
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    out = get_policy_loss("ppo_clip")(
        ratio.log(),
        torch.zeros_like(ratio),
        adv,
        torch.ones_like(ratio),
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=3.0,
    )
    # A<0, r=4: max(4, 1.28) = 4 -> bounded by 3; r=2: 2 stays; A>0, r=4: -1.28 (dual clip only for A<0)
    assert out.loss_tokens[0].tolist() == pytest.approx([3.0, 2.0, -1.28], abs=1e-6)
    assert out.clipped[0].tolist() == [True, False, True]


def test_ppo_loss_masks_and_importance_weights():
    lp = torch.tensor([[0.0, 0.0]])
    out = get_policy_loss("ppo_clip")(
        lp, lp, torch.tensor([[1.0, 1.0]]), torch.tensor([[1.0, 0.0]]), weights=torch.tensor([[0.5, 2.0]])
    )
    assert out.loss_tokens.tolist() == [[-0.5, 0.0]]


def test_gspo_uses_the_sequence_ratio_and_its_gradient():
    assert {"ppo_clip", "gspo"} <= set(list_policy_losses())
    old = torch.zeros(1, 3)
    lp = torch.tensor([[0.0, 0.1, 0.3]], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    adv = torch.tensor([[0.0, 1.0, 1.0]])
    out = get_policy_loss("gspo")(lp, old, adv, mask, clip_low=1.0, clip_high=1.0)
    s = math.exp(0.2)  # exp(mean of the masked log ratios)
    assert out.ratio[0, 1:].tolist() == pytest.approx([s, s])
    loss = aggregate(out.loss_tokens, mask, "seq_mean_token_mean")
    assert loss.item() == pytest.approx(-s)
    loss.backward()
    # d(-s)/d lp_t = -s / |o| per generated token
    assert lp.grad[0].tolist() == pytest.approx([0.0, -s / 2, -s / 2])
    clipped = get_policy_loss("gspo")(lp.detach(), old, adv, mask, clip_low=3e-4, clip_high=4e-4)
    assert clipped.loss_tokens[0, 1:].tolist() == pytest.approx([-1.0004, -1.0004])
    assert clipped.clipped[0].tolist() == [False, True, True]


def test_value_loss_clipping():
    values = torch.tensor([[1.0, 0.6]])
    old = torch.tensor([[0.5, 0.5]])
    returns = torch.tensor([[2.0, 0.55]])
    loss, clipped = value_loss(values, old, returns, torch.ones(1, 2), clip=0.2)
    # v_clip = 0.7 -> 0.5 * max(1, 1.69) = 0.845; second: v_clip = 0.6 = v -> 0.5 * 0.0025
    assert loss[0].tolist() == pytest.approx([0.845, 0.00125])
    assert clipped[0].tolist() == [True, False]
    unclipped, _ = value_loss(values, old, returns, torch.ones(1, 2), clip=None)
    assert unclipped[0].tolist() == pytest.approx([0.5, 0.00125])


def test_entropy_from_logits():
    assert entropy_from_logits(torch.zeros(4)).item() == pytest.approx(math.log(4))
    p = torch.tensor([0.7, 0.2, 0.1])
    assert entropy_from_logits(p.log()).item() == pytest.approx(-(p * p.log()).sum().item(), rel=1e-5)


def test_ppo_gradient_equals_policy_gradient_estimator_on_toy_softmax():
    """At ratio 1 the PPO loss gradient is -mean_i A_i grad log pi(a_i) = -mean_i A_i (onehot(a_i) - pi)."""
    torch.manual_seed(0)
    theta = torch.randn(5, requires_grad=True)
    actions = torch.tensor([0, 3, 3, 1, 4, 2, 0, 3])
    adv = torch.randn(8)
    logp = torch.log_softmax(theta, -1)[actions]
    out = get_policy_loss("ppo_clip")(logp[:, None], logp.detach()[:, None], adv[:, None], torch.ones(8, 1))
    aggregate(out.loss_tokens, torch.ones(8, 1), "token_mean").backward()
    pi = torch.softmax(theta.detach(), -1)
    expected = -(adv[:, None] * (torch.nn.functional.one_hot(actions, 5).float() - pi)).mean(0)
    assert torch.allclose(theta.grad, expected, atol=1e-6)
