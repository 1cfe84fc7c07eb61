"""Advantage estimators against hand-computed values (masks, equal-reward groups, singletons)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algos import discounted_returns, get_advantage, list_advantages, register_advantage


def outcome(rewards: list[float], masks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """token rewards with each reward on its row's last masked token."""
    mask = torch.tensor(masks, dtype=torch.float32)
    tr = torch.zeros_like(mask)
    for i, r in enumerate(rewards):
        last = max(j for j, m in enumerate(masks[i]) if m)
        tr[i, last] = r
    return tr, mask


def test_registry_lists_all_estimators_and_rejects_unknown_names():
    assert {"gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"} <= set(
        list_advantages()
    )
    with pytest.raises(KeyError, match="unknown advantage estimator 'nope'.*grpo"):
        get_advantage("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(lambda *a, **k: None)


def test_grpo_group_normalised_with_equal_group_zero_and_singleton():
    # group 0: [1, 0, 0, 1]; group 1: [1, 1] (equal); group 2: [0.3] (singleton)
    masks = [[0, 1, 1], [0, 1, 0], [0, 1, 1], [0, 0, 1], [0, 1, 1], [0, 1, 1], [0, 1, 1]]
    tr, mask = outcome([1, 0, 0, 1, 1, 1, 0.3], masks)
    gid = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    out = get_advantage("grpo")(tr, mask, gid, normalize_std=True)
    a = 0.5 / math.sqrt(1 / 3)  # unbiased std of [1,0,0,1] is sqrt(1/3)
    expected_seq = [a, -a, -a, a, 0.0, 0.0, 0.0]  # a singleton has no baseline: 0, not its raw score 0.3
    for i, e in enumerate(expected_seq):
        assert out.advantages[i].tolist() == pytest.approx([e * m for m in masks[i]], abs=1e-5)
    assert out.zero_signal.tolist() == [False, False, False, False, True, True, False]
    assert torch.equal(out.returns, out.advantages)


def test_grpo_without_std_and_dr_grpo_are_the_centred_scores():
    tr, mask = outcome([1, 0, 0, 1], [[0, 1]] * 4)
    gid = torch.zeros(4, dtype=torch.long)
    for out in (
        get_advantage("grpo")(tr, mask, gid, normalize_std=False),
        get_advantage("dr_grpo")(tr, mask, gid),
    ):
        assert out.advantages[:, 1].tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5])
        assert out.advantages[:, 0].tolist() == [0, 0, 0, 0]


def test_a_lone_group_member_gets_no_advantage_from_group_estimators():
    # group 0 lost all but one member (e.g. to infrastructure failures): its raw score is no signal
    tr, mask = outcome([0.7, 1, 0], [[0, 1]] * 3)
    gid = torch.tensor([0, 1, 1])
    for name in ("grpo", "dr_grpo", "rloo"):
        out = get_advantage(name)(tr, mask, gid)
        assert out.advantages[0].tolist() == [0.0, 0.0], name
    from posttrain.algos import uses_group_baseline

    assert all(uses_group_baseline(n) for n in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"))
    assert not uses_group_baseline("reinforce_pp") and not uses_group_baseline("gae")


def test_rloo_leave_one_out_baseline():
    tr, mask = outcome([1, 0, 0, 1, 2, 2], [[0, 1]] * 6)
    gid = torch.tensor([0, 0, 0, 0, 1, 1])
    out = get_advantage("rloo")(tr, mask, gid)
    # r=1: others mean (0+0+1)/3 -> 2/3; r=0: others mean 2/3 -> -2/3; equal group -> 0
    assert out.advantages[:, 1].tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0])
    assert out.zero_signal.tolist() == [False] * 4 + [True, True]


def test_discounted_returns_skip_unmasked_tokens():
    tr = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 5.0, 1.0]])
    mask = torch.tensor([[0.0, 1, 1, 1], [0.0, 1, 0, 1]])
    ret = discounted_returns(tr, mask, gamma=0.5)
    assert ret[0].tolist() == pytest.approx([0, 0.25, 0.5, 1.0])
    # the observation token (mask 0) neither earns its reward nor costs a discount
    assert ret[1].tolist() == pytest.approx([0, 0.5, 0, 1.0])


def test_reinforce_pp_whitens_returns_over_batch_tokens():
    tr, mask = outcome([1.0, 0.0, 0.0], [[0, 1, 1], [0, 1, 1], [0, 1, 0]])
    out = get_advantage("reinforce_pp")(tr, mask, torch.tensor([0, 0, 1]), gamma=1.0)
    # returns on masked tokens: [1, 1], [0, 0], [0] -> mean 0.4, unbiased var (2*.36 + 3*.16)/4 = 0.3
    s = math.sqrt(0.3)
    assert out.advantages[0].tolist() == pytest.approx([0, 0.6 / s, 0.6 / s], abs=1e-5)
    assert out.advantages[1].tolist() == pytest.approx([0, -0.4 / s, -0.4 / s], abs=1e-5)
    assert out.advantages[2].tolist() == pytest.approx([0, -0.4 / s, 0], abs=1e-5)
    assert out.returns[0].tolist() == [0, 1, 1]


def test_reinforce_pp_baseline_centres_by_group_then_whitens_and_zeroes_equal_groups():
    tr, mask = outcome([1, 0, 1, 1], [[0, 1]] * 4)
    out = get_advantage("reinforce_pp_baseline")(tr, mask, torch.tensor([0, 0, 1, 1]))
    # centred [.5, -.5, 0, 0]: mean 0, unbiased std sqrt(1/6)
    a = 0.5 / math.sqrt(1 / 6)
    assert out.advantages[:, 1].tolist() == pytest.approx([a, -a, 0, 0], abs=1e-5)
    assert out.zero_signal.tolist() == [False, False, True, True]


def test_gae_hand_computed_and_skips_observation_tokens():
    gae = get_advantage("gae")
    tr = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    mask = torch.tensor([[0.0, 1, 1, 0], [0.0, 1, 0, 1]])
    values = torch.tensor([[7.0, 0.5, 0.2, 7.0], [7.0, 0.5, 9.0, 0.2]])
    out = gae(tr, mask, torch.tensor([0, 1]), values=values, gamma=1.0, lam=0.5, whiten=False)
    # t=last: delta = 1 - 0.2 = 0.8; t=first: delta = 0.2 - 0.5 = -0.3, A = -0.3 + 0.5 * 0.8 = 0.1
    assert out.advantages[0].tolist() == pytest.approx([0, 0.1, 0.8, 0])
    assert out.advantages[1].tolist() == pytest.approx([0, 0.1, 0, 0.8])
    assert out.returns[0].tolist() == pytest.approx([0, 0.6, 1.0, 0])
    with pytest.raises(ValueError, match="needs values"):
        gae(tr, mask, torch.tensor([0, 1]))


def test_gae_discount_and_whitening():
    tr = torch.tensor([[0.0, 0.0, 2.0]])
    mask = torch.tensor([[0.0, 1, 1]])
    values = torch.tensor([[0.0, 1.0, 1.0]])
    raw = get_advantage("gae")(tr, mask, torch.tensor([0]), values=values, gamma=0.9, lam=1.0, whiten=False)
    # t2: 2 - 1 = 1; t1: 0 + 0.9 * 1 - 1 + 0.9 * 1 = 0.8
    assert raw.advantages[0].tolist() == pytest.approx([0, 0.8, 1.0])
    white = get_advantage("gae")(tr, mask, torch.tensor([0]), values=values, gamma=0.9, lam=1.0)
    # [0.8, 1.0]: mean 0.9, unbiased std sqrt(0.02)
    s = math.sqrt(0.02)
    assert white.advantages[0].tolist() == pytest.approx([0, -0.1 / s, 0.1 / s], rel=1e-4)
