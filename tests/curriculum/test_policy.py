"""Hand-computed checks of the pure functions behind the samplers."""

import math

import numpy as np
import pytest

from posttrain.curriculum.policy import (
    adaptive_policy,
    bounded_renormalise,
    group_abs_dev,
    grpo_abs_advantages,
    minmax,
    softmax,
)


def test_group_abs_dev_binary_is_2p1mp():
    assert group_abs_dev([1, 0, 0, 0]) == pytest.approx(2 * 0.25 * 0.75)
    assert group_abs_dev([1, 1, 0, 0]) == pytest.approx(0.5)
    assert group_abs_dev([1, 1, 1]) == 0.0


def test_grpo_abs_advantage_binary_mean_is_2_sqrt_p1mp():
    adv = grpo_abs_advantages([1, 0, 0, 0])
    assert adv.mean() == pytest.approx(2 * math.sqrt(0.25 * 0.75), rel=1e-5)
    assert grpo_abs_advantages([0.3, 0.3]).tolist() == [0.0, 0.0]


def test_minmax_and_softmax():
    assert minmax(np.array([2.0, 4.0, 3.0])).tolist() == [0.0, 1.0, 0.5]
    assert minmax(np.array([1.0, 1.0])).tolist() == [0.0, 0.0]
    assert softmax(np.array([0.0, math.log(3.0)])).tolist() == pytest.approx([0.25, 0.75])


def test_bounded_renormalise_caps_then_spreads_in_proportion():
    # 0.8 capped to 0.5; the 0.3 it loses goes to the others in proportion 1:3
    out = bounded_renormalise(np.array([0.8, 0.05, 0.15]), lo=0.0, hi=0.5)
    assert out.tolist() == pytest.approx([0.5, 0.125, 0.375])
    # the second arm would exceed the cap after the first spread -> capped too (water-filling)
    out = bounded_renormalise(np.array([0.7, 0.25, 0.05]), lo=0.0, hi=0.4)
    assert out.tolist() == pytest.approx([0.4, 0.4, 0.2])


def test_bounded_renormalise_floor_and_infeasible_bounds():
    out = bounded_renormalise(np.array([0.98, 0.01, 0.01]), lo=0.1, hi=1.0)
    assert out.tolist() == pytest.approx([0.8, 0.1, 0.1])
    with pytest.raises(ValueError, match="cannot hold 3 weights"):
        bounded_renormalise(np.array([1.0, 1.0, 1.0]), lo=0.0, hi=0.2)


def test_adaptive_policy_hand_computed():
    # two arms at L=0.5, two at L=0, equal counts: min-max scores [0, 1, 0, 1]
    pi, s = adaptive_policy(
        np.array([0.0, 0.5, 0.0, 0.5]),
        np.full(4, 10.0),
        40,
        np.zeros(4),
        c=1.0,
        lam=1.0,
        tau=0.4,
        eps=0.15,
        max_share=0.5,
    )
    e = math.exp(2.5)
    hi = 0.85 * e / (2 + 2 * e) + 0.15 / 4
    lo = 0.85 * 1 / (2 + 2 * e) + 0.15 / 4
    assert pi.tolist() == pytest.approx([lo, hi, lo, hi])
    bonus = math.sqrt(math.log(41) / 11)
    assert s.tolist() == pytest.approx([bonus, 0.5 + bonus, bonus, 0.5 + bonus])


def test_adaptive_policy_cap_binds():
    # one dominant arm of three: unclipped 0.78 -> capped at 0.5, the rest split evenly
    pi, _ = adaptive_policy(
        np.array([0.4, 0.0, 0.0]),
        np.full(3, 5.0),
        15,
        np.zeros(3),
        c=1.0,
        lam=1.0,
        tau=0.4,
        eps=0.15,
        max_share=0.5,
    )
    assert pi.tolist() == pytest.approx([0.5, 0.25, 0.25])


def test_adaptive_policy_progress_and_cost_terms():
    # progress adds mu * LP to the raw score before the min-max normalisation
    pi, s = adaptive_policy(
        np.zeros(2),
        np.full(2, 3.0),
        6,
        np.zeros(2),
        c=0.0,
        lam=1.0,
        tau=0.5,
        eps=0.0,
        max_share=1.0,
        progress=np.array([0.2, 0.0]),
        mu=2.0,
    )
    assert s.tolist() == pytest.approx([0.4, 0.0])
    e = math.exp(2.0)
    assert pi.tolist() == pytest.approx([e / (1 + e), 1 / (1 + e)])
    # cost divides the softmax part: equal scores, arm 1 three times as long -> groups 3:1
    pi, _ = adaptive_policy(
        np.zeros(2),
        np.full(2, 3.0),
        6,
        np.zeros(2),
        c=0.0,
        lam=1.0,
        tau=0.5,
        eps=0.2,
        max_share=1.0,
        cost=np.array([0.5, 1.5]),
    )
    assert pi.tolist() == pytest.approx([0.8 * 0.75 + 0.1, 0.8 * 0.25 + 0.1])
