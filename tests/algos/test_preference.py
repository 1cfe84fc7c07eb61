"""Preference losses against hand-computed values and the papers' formulas, gradient signs, the
registry, and the errors for missing or unwanted inputs."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algos import (
    dpo,
    get_preference_loss,
    ipo,
    list_preference_losses,
    masked_nll,
    preference_needs_reference,
    simpo,
)


def t(*xs: float, grad: bool = False) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64, requires_grad=grad)


def test_registry_names_and_which_need_a_reference():
    assert list_preference_losses() == ["dpo", "ipo", "simpo"]
    assert get_preference_loss("dpo") is dpo
    assert preference_needs_reference("dpo") and preference_needs_reference("ipo")
    assert not preference_needs_reference("simpo")
    with pytest.raises(KeyError, match="unknown preference loss 'orpo'; registered: dpo, ipo, simpo"):
        get_preference_loss("orpo")


def test_dpo_hand_computed():
    # (pc - rc) - (pr - rr) = (-10 + 12) - (-15 + 13) = 4; beta 0.1 -> -log sigmoid(0.4)
    out = dpo(t(-10.0), t(-15.0), t(-12.0), t(-13.0), beta=0.1)
    assert out.loss.item() == pytest.approx(math.log(1 + math.exp(-0.4)), abs=1e-12)
    assert out.loss.item() == pytest.approx(0.5130152524, abs=1e-9)
    assert out.chosen_rewards.item() == pytest.approx(0.2)  # beta * (pc - rc)
    assert out.rejected_rewards.item() == pytest.approx(-0.2)
    assert out.reward_accuracy.item() == 1.0
    assert out.reward_margin.item() == pytest.approx(0.4)


def test_dpo_batch_equals_the_paper_formula_per_pair():
    pc, pr, rc, rr = t(-3.0, -8.0, -20.0), t(-4.0, -7.5, -2.0), t(-3.5, -8.0, -19.0), t(-3.0, -9.0, -2.5)
    beta = 0.5
    out = dpo(pc, pr, rc, rr, beta=beta)
    for i in range(3):
        h = (pc[i].item() - rc[i].item()) - (pr[i].item() - rr[i].item())
        want = -math.log(1.0 / (1.0 + math.exp(-beta * h)))
        assert out.loss[i].item() == pytest.approx(want, abs=1e-12)


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    pc, pr = t(-10.0, grad=True), t(-15.0, grad=True)
    dpo(pc, pr, t(-12.0), t(-13.0), beta=0.1).loss.sum().backward()
    sig = 1.0 / (1.0 + math.exp(0.4))  # sigmoid(-beta h)
    assert pc.grad.item() == pytest.approx(-0.1 * sig, abs=1e-12)  # descent raises log p(chosen)
    assert pr.grad.item() == pytest.approx(0.1 * sig, abs=1e-12)  # ... and lowers log p(rejected)


def test_dpo_label_smoothing_is_conservative_dpo():
    out = dpo(t(-10.0), t(-15.0), t(-12.0), t(-13.0), beta=0.1, label_smoothing=0.1)
    want = 0.9 * math.log(1 + math.exp(-0.4)) + 0.1 * math.log(1 + math.exp(0.4))
    assert out.loss.item() == pytest.approx(want, abs=1e-12)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        dpo(t(0.0), t(0.0), t(0.0), t(0.0), label_smoothing=0.5)


def test_dpo_and_ipo_need_the_reference():
    with pytest.raises(ValueError, match="dpo needs the reference model's logprobs"):
        dpo(t(-1.0), t(-2.0), None, None)
    with pytest.raises(ValueError, match="ipo needs the reference model's logprobs"):
        ipo(t(-1.0), t(-2.0), t(-1.0), None)


def test_ipo_hand_computed_and_pulls_the_gap_to_its_target():
    # gap h = 4, target 1/(2 tau) = 5 with tau 0.1 -> (4 - 5)^2 = 1, d/dpc = 2 (h - 5) = -2
    pc = t(-10.0, grad=True)
    out = ipo(pc, t(-15.0), t(-12.0), t(-13.0), tau=0.1)
    assert out.loss.item() == pytest.approx(1.0, abs=1e-12)
    out.loss.sum().backward()
    assert pc.grad.item() == pytest.approx(-2.0, abs=1e-12)
    # gap 6 beyond the target: the same loss, and the gradient pulls the chosen logprob back down
    pc2 = t(-8.0, grad=True)
    out2 = ipo(pc2, t(-15.0), t(-12.0), t(-13.0), tau=0.1)
    assert out2.loss.item() == pytest.approx(1.0, abs=1e-12)
    out2.loss.sum().backward()
    assert pc2.grad.item() == pytest.approx(2.0, abs=1e-12)
    # exactly at the target: zero loss
    assert ipo(t(-9.0), t(-15.0), t(-12.0), t(-13.0), tau=0.1).loss.item() == pytest.approx(0.0, abs=1e-12)
    assert out.chosen_rewards.item() == pytest.approx(2.0) and out.rejected_rewards.item() == pytest.approx(
        -2.0
    )
    with pytest.raises(ValueError, match="tau must be > 0"):
        ipo(t(0.0), t(0.0), t(0.0), t(0.0), tau=0.0)


def test_simpo_hand_computed_length_normalised():
    # beta/|yc| log p(yc) = 2 * -10 / 5 = -4; beta/|yr| log p(yr) = 2 * -30 / 10 = -6; gamma 1
    # -> -log sigmoid(-4 + 6 - 1) = log(1 + e^-1)
    out = simpo(t(-10.0), t(-30.0), chosen_tokens=t(5.0), rejected_tokens=t(10.0), beta=2.0, gamma=1.0)
    assert out.loss.item() == pytest.approx(math.log(1 + math.exp(-1.0)), abs=1e-12)
    assert out.chosen_rewards.item() == pytest.approx(-4.0)
    assert out.rejected_rewards.item() == pytest.approx(-6.0)
    # summed, the rejected response (-30) would look far worse than the chosen (-10); per token it
    # is -3 vs -2: the loss sees only the per-token gap
    same_per_token = simpo(
        t(-20.0), t(-30.0), chosen_tokens=t(10.0), rejected_tokens=t(10.0), beta=2.0, gamma=1.0
    )
    assert same_per_token.loss.item() == pytest.approx(out.loss.item(), abs=1e-12)


def test_simpo_gamma_is_a_margin_and_gradients_have_the_right_sign():
    pc, pr = t(-10.0, grad=True), t(-30.0, grad=True)
    base = simpo(pc, pr, chosen_tokens=t(5.0), rejected_tokens=t(10.0), beta=2.0, gamma=0.0)
    wider = simpo(t(-10.0), t(-30.0), chosen_tokens=t(5.0), rejected_tokens=t(10.0), beta=2.0, gamma=1.5)
    assert base.loss.item() == pytest.approx(math.log(1 + math.exp(-2.0)), abs=1e-12)
    assert wider.loss.item() > base.loss.item()
    base.loss.sum().backward()
    sig = 1.0 / (1.0 + math.exp(2.0))  # sigmoid(-(margin - gamma))
    assert pc.grad.item() == pytest.approx(-2.0 / 5.0 * sig, abs=1e-12)
    assert pr.grad.item() == pytest.approx(2.0 / 10.0 * sig, abs=1e-12)


def test_simpo_rejects_a_reference_and_needs_lengths():
    with pytest.raises(ValueError, match="simpo uses no reference model"):
        simpo(t(-1.0), t(-2.0), t(-1.0), t(-2.0), chosen_tokens=t(1.0), rejected_tokens=t(1.0))
    with pytest.raises(ValueError, match="simpo needs chosen_tokens and rejected_tokens"):
        simpo(t(-1.0), t(-2.0))
    with pytest.raises(ValueError, match="at least one token"):
        simpo(t(-1.0), t(-2.0), chosen_tokens=t(0.0), rejected_tokens=t(3.0))


def test_masked_nll_token_mean_over_micro_batches_adds_up():
    lp = torch.tensor([[0.0, -1.0, -2.0, 0.0], [0.0, 0.0, -3.0, -6.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0]])
    w = mask / mask.sum()  # token mean over 4 tokens: (1 + 2 + 3 + 6) / 4 = 3
    assert masked_nll(lp, w).item() == pytest.approx(3.0)
    assert (masked_nll(lp[:1], w[:1]) + masked_nll(lp[1:], w[1:])).item() == pytest.approx(3.0)
