"""KL estimators and controllers; truncated importance sampling, ratio masking, mismatch metrics."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algos import (
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    make_kl_controller,
    mismatch_metrics,
    ratio_mask,
    tis_weights,
)


def test_kl_estimators_match_their_definitions():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])  # log r = 1
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(1.0)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.5)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(math.exp(-1) + 1 - 1)
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_estimate(lp, ref, "k4")


def test_k3_nonnegative_and_estimators_agree_with_exact_kl_in_expectation():
    torch.manual_seed(0)
    a, b = torch.randn(1000), torch.randn(1000)
    assert bool((kl_estimate(a, b, "k3") >= 0).all())
    assert bool((kl_estimate(a, b, "k2") >= 0).all())
    p_logits, q_logits = torch.tensor([1.0, 0.0, -1.0]), torch.tensor([0.0, 0.5, 0.0])
    logp, logq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    exact = (logp.exp() * (logp - logq)).sum().item()
    x = torch.multinomial(logp.exp(), 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    for kind in ("k1", "k3"):  # unbiased estimators
        assert kl_estimate(logp[x], logq[x], kind).mean().item() == pytest.approx(exact, abs=0.01)


def test_adaptive_kl_controller_and_state_round_trip():
    ctl = AdaptiveKLController(0.1, target=1.0, horizon=100)
    ctl.update(current_kl=2.0, n_steps=10)  # error clipped to 0.2 -> x (1 + 0.2 * 10 / 100)
    assert ctl.value == pytest.approx(0.102)
    ctl.update(current_kl=0.9, n_steps=10)  # error -0.1 -> x (1 - 0.01)
    assert ctl.value == pytest.approx(0.102 * 0.99)
    other = AdaptiveKLController(0.5, target=3.0, horizon=7)
    other.load_state_dict(ctl.state_dict())
    assert (other.value, other.target, other.horizon) == (ctl.value, 1.0, 100)
    fixed = make_kl_controller(0.3)
    fixed.update(5.0, 10)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.3
    assert isinstance(make_kl_controller(0.3, target=0.1), AdaptiveKLController)


def test_tis_token_and_sequence_weights_are_capped():
    learner = torch.tensor([[0.0, -1.0, -1.0]])
    behavior = torch.tensor([[0.0, -2.0, -0.5]])  # log ratios 1, -0.5
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    tok = tis_weights(learner, behavior, mask, cap=2.0, level="token")
    assert tok[0].tolist() == pytest.approx([0.0, 2.0, math.exp(-0.5)])
    seq = tis_weights(learner, behavior, mask, cap=2.0, level="sequence")
    assert seq[0].tolist() == pytest.approx([0.0, math.exp(0.5), math.exp(0.5)])
    seq_capped = tis_weights(learner, behavior, mask, cap=1.5, level="sequence")
    assert seq_capped[0].tolist() == pytest.approx([0.0, 1.5, 1.5])
    with pytest.raises(ValueError, match="cap must be > 0"):
        tis_weights(learner, behavior, mask, cap=0.0)


def test_ratio_mask_and_mismatch_metrics():
    learner = torch.tensor([[0.0, -1.0, -1.0, -1.0]])
    behavior = torch.tensor([[0.0, -2.0, -0.5, -1.0]])  # ratios e, e^-0.5, 1
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    kept = ratio_mask(learner, behavior, mask, low=0.5, high=2.0)
    assert kept[0].tolist() == [0.0, 0.0, 1.0, 1.0]
    assert ratio_mask(learner, behavior, mask, low=None, high=None).tolist() == mask.tolist()
    # sequence level: the product e^0.5 is inside [0.5, 2] -> whole sequence kept
    assert ratio_mask(learner, behavior, mask, 0.5, 2.0, level="sequence")[0].tolist() == [0.0, 1.0, 1.0, 1.0]
    m = mismatch_metrics(learner, behavior, mask, cap=2.0, kept_mask=kept)
    assert m["mismatch_abs_log_ratio"] == pytest.approx(0.5)  # (1 + 0.5 + 0) / 3
    assert m["mismatch_max_abs_log_ratio"] == pytest.approx(1.0)
    assert m["tis_clip_frac"] == pytest.approx(1 / 3)
    assert m["ratio_masked_frac"] == pytest.approx(1 / 3)
    k3 = ((math.e - 1 - 1) + (math.exp(-0.5) - 1 + 0.5)) / 3
    assert m["mismatch_kl_k3"] == pytest.approx(k3, rel=1e-5)
