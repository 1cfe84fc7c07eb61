"""Facts about the adaptive sampler's optional signals: learning progress, retention read from training
groups, probes skipped for arms the training groups already measure, batch coverage, old state."""

import math
from collections import Counter

import pytest

from posttrain.config import CurriculumConfig
from posttrain.curriculum import Arm, make_sampler
from posttrain.curriculum.samplers import STATE_VERSION

ZERO = [0.0] * 8
ONE = [1.0] * 8
HALF = [1.0] * 4 + [0.0] * 4
ARMS3 = [Arm("math", 0), Arm("code", 0), Arm("tools", 0)]


def cfg(**kw) -> CurriculumConfig:
    return CurriculumConfig(**kw)


def test_learning_progress_hand_computed():
    s = make_sampler(cfg(lp_fast=0.5, lp_slow=0.25, forget_z=0.0), ARMS3, seed=0)
    s.update(0, ARMS3[0], [ZERO])
    s.update(1, ARMS3[0], [ONE])  # fast 0.5, slow 0.25
    assert s.learning_progress().tolist() == pytest.approx([0.25, 0.0, 0.0])
    assert s.signals()["curriculum/LP/math:0"] == pytest.approx(0.25)
    # with the noise discount: each update's variance s(1-s)/n with s = 1/10 or 9/10 and n = 8
    t = make_sampler(cfg(lp_fast=0.5, lp_slow=0.25, forget_z=1.0), ARMS3, seed=0)
    t.update(0, ARMS3[0], [ZERO])
    t.update(1, ARMS3[0], [ONE])
    v = 0.09 / 8
    var_fast, var_slow = 0.25 * v + 0.25 * v, 0.5625 * v + 0.0625 * v
    assert t.learning_progress()[0] == pytest.approx(0.25 - math.sqrt(var_fast + var_slow))


def _rising_hard_arm(lp_weight: float) -> tuple[float, list[float]]:
    """Arm math:1 fails everything for 20 steps, then its success rate climbs 1/8, 2/8, 3/8, 3/8; the
    others stay put. Only the learning-progress term differs between the two runs."""
    arms = [Arm("math", 0), Arm("math", 1), Arm("code", 0), Arm("logic", 0)]
    s = make_sampler(cfg(lp_weight=lp_weight, weakness=0.0, train_retention=False, c=0.0), arms, seed=0)
    rising = [[1.0] * k + [0.0] * (8 - k) for k in (1, 2, 3, 3)]
    for step in range(24):
        hard = ZERO if step < 20 else rising[step - 20]
        s.update(step, arms[0], [ONE] * 4)
        s.update(step, arms[1], [hard] * 4)
        s.update(step, arms[2], [HALF] * 4)
        s.update(step, arms[3], [[1.0] * 3 + [0.0] * 5] * 4)
    return s.weights()[arms[1]], s.learning_progress().tolist()


def test_arm_whose_success_rate_starts_rising_gains_share():
    without, _ = _rising_hard_arm(0.0)
    with_lp, lp = _rising_hard_arm(1.0)
    assert lp[1] > 0.04 and lp[0] == lp[2] == lp[3] == 0.0  # steady arms show no progress
    assert with_lp > without + 0.03


def test_train_retention_reads_forgetting_from_training_groups():
    on = make_sampler(cfg(train_retention=True, lp_fast=1.0, lp_slow=0.5, forget_z=0.0), ARMS3, seed=0)
    off = make_sampler(cfg(train_retention=False, lp_fast=1.0, lp_slow=0.5, forget_z=0.0), ARMS3, seed=0)
    for s in (on, off):
        for step in range(3):
            for a in ARMS3:
                s.update(step, a, [ONE])
        s.update(3, ARMS3[0], [ZERO])  # slow EMA of math:0 drops from 1 to 0.5
    assert on.forgetting().tolist() == pytest.approx([0.5, 0.0, 0.0])
    assert off.forgetting().tolist() == [0.0, 0.0, 0.0]
    w = on.weights()
    assert w[ARMS3[0]] > w[ARMS3[1]] == pytest.approx(w[ARMS3[2]])
    # a drop within the noise of the training evidence is not forgetting
    noisy = make_sampler(cfg(train_retention=True, lp_fast=1.0, lp_slow=0.5, forget_z=1.0), ARMS3, seed=0)
    noisy.update(0, ARMS3[0], [[1.0, 1.0]])
    noisy.update(1, ARMS3[0], [[1.0, 0.0]])  # 1 -> 0.75 on two rollouts each
    assert noisy.forgetting()[0] == 0.0


def test_probes_go_to_the_arm_training_does_not_measure():
    s = make_sampler(cfg(probe_every=10, probe_skip_rollouts=64), ARMS3, seed=0)
    assert s.probe_arms(0) == ARMS3 and s.probe_due(0)
    for a in ARMS3:
        s.record_probe(0, a, 0.8)
    for step in range(1, 10):
        s.update(step, ARMS3[0], [HALF] * 8)  # 64 rollouts per step
        s.update(step, ARMS3[1], [HALF] * 8)
        if step == 9:
            s.update(step, ARMS3[2], [ONE])  # 8 rollouts in ten steps: still at risk
    assert s.probe_arms(5) == [] and not s.probe_due(5)  # not a probe step
    assert s.probe_arms(10) == [ARMS3[2]] and s.probe_due(10)
    s.record_probe(10, ARMS3[2], 0.7)
    s.update(10, ARMS3[2], [ONE] * 7)
    assert s.probe_arms(20) == [ARMS3[2]]  # its count restarted at the probe: 56 < 64
    s.update(11, ARMS3[2], [ONE])
    assert s.probe_arms(20) == [] and not s.probe_due(20)  # 64: measured by training, no probe needed
    # probe_skip_rollouts = 0 probes every arm, as before
    t = make_sampler(cfg(probe_every=10, probe_skip_rollouts=0), ARMS3, seed=0)
    t.update(0, ARMS3[0], [HALF] * 100)
    assert t.probe_arms(10) == ARMS3
    assert make_sampler(cfg(sampler="sec"), ARMS3, seed=0).probe_arms(0) == []


def test_cover_batch_gives_every_arm_a_group():
    arms = [Arm("d", i) for i in range(6)]

    def drive(cover: bool) -> tuple[list[Counter], list[int]]:
        s = make_sampler(cfg(cover_batch=cover, eps=0.06, tau=0.4, c=1.0, weakness=0.15), arms, seed=4)
        counts, small = [], []
        for step in range(20):
            s.update(step, arms[0], [HALF] * 8)
            for a in arms[1:]:
                s.update(step, a, [ONE])
            counts.append(Counter(s.sample(12)))
            small.append(len(s.sample(4)))
        return counts, small

    covered, small = drive(True)
    assert all(c[a] >= 1 for c in covered for a in arms)
    assert all(sum(c.values()) == 12 for c in covered) and small == [4] * 20  # too small a batch: no cover
    plain, _ = drive(False)
    assert any(c[a] == 0 for c in plain for a in arms)  # the eps/K = 0.01 floor alone leaves arms out
    # an arm without data is never covered
    s = make_sampler(cfg(cover_batch=True), arms, seed=0)
    s.set_data_size(arms[5], 0)
    assert Counter(s.sample(6))[arms[5]] == 0


def test_lp_rates_must_be_ordered():
    with pytest.raises(ValueError, match=r"curriculum.lp_slow must be in \(0, lp_fast = 0.2\), got 0.3"):
        make_sampler(cfg(lp_slow=0.3), ARMS3, seed=0)


def test_version_2_state_loads_with_empty_new_signals():
    s = make_sampler(cfg(), ARMS3, seed=1)
    s.update(0, ARMS3[0], [HALF])
    state = s.state_dict()
    new_keys = ("succ_fast", "succ_slow", "succ_best", "since_probe", "fresh", "tokens")
    old = {**state, "version": 2, "stats": {k: v for k, v in state["stats"].items() if k not in new_keys}}
    t = make_sampler(cfg(), ARMS3, seed=5)
    t.load_state_dict(old)
    assert t.state_dict()["version"] == STATE_VERSION == 3
    assert (
        t._s["succ_fast"] == [None] * 3 and t._s["since_probe"] == [0] * 3 and t._s["tokens"][0] == [0.0, 0]
    )
    assert t._s["n_groups"] == s._s["n_groups"] and t.weights() == pytest.approx(s.weights())
    with pytest.raises(ValueError, match="expected version 3"):
        t.load_state_dict({**state, "version": 1})


def test_relative_cost_and_cost_aware_split_tokens():
    arms = [Arm("math", 0), Arm("code", 0)]
    s = make_sampler(cfg(cost_aware=True, c=0.0, max_share=1.0), arms, seed=0)
    assert s.relative_cost().tolist() == [1.0, 1.0]  # nothing reported yet
    s.update(0, arms[0], [HALF], tokens=800.0)  # 100 tokens per rollout
    assert s.relative_cost().tolist() == [1.0, 1.0]
    s.update(0, arms[1], [HALF, HALF], tokens=4800.0)  # 300 per rollout
    assert s.relative_cost().tolist() == pytest.approx([0.5, 1.5])
    # equal scores: the softmax part (1/2, 1/2) divided by cost -> (3/4, 1/4), then eps/K mixing (eps = 0.2)
    w = s.weights()
    assert [w[a] for a in arms] == pytest.approx([0.8 * 0.75 + 0.1, 0.8 * 0.25 + 0.1])
    # tokens spent per arm are then equal in the softmax part: 0.75 * 0.5 == 0.25 * 1.5
    off = make_sampler(cfg(cost_aware=False, c=0.0, max_share=1.0), arms, seed=0)
    off.update(0, arms[0], [HALF], tokens=800.0)
    off.update(0, arms[1], [HALF, HALF], tokens=4800.0)
    assert list(off.weights().values()) == pytest.approx([0.5, 0.5])
    default = make_sampler(cfg(c=0.0, max_share=1.0), arms, seed=0)  # cost_aware is off by default
    default.update(0, arms[0], [HALF], tokens=800.0)
    default.update(0, arms[1], [HALF, HALF], tokens=4800.0)
    assert default.weights() == off.weights()
    with pytest.raises(ValueError, match=r"update\(math:0\): tokens must be a finite number > 0, got -1.0"):
        s.update(1, arms[0], [HALF], tokens=-1)


def test_state_round_trip_with_every_option_on():
    import json

    opts = cfg(lp_weight=1.0, cover_batch=True, cost_aware=True, probe_skip_rollouts=16, probe_every=3)
    arms = ARMS3 + [Arm("math", 1)]

    def drive(s, start, steps):
        out = []
        for step in range(start, start + steps):
            for a in s.probe_arms(step):
                s.record_probe(step, a, 0.5 + 0.1 * ((step + a.difficulty) % 3), n=8)
            picked = s.sample(6)
            out.append([a.key for a in picked])
            for j, a in enumerate(sorted(set(picked))):
                k = (step + j) % 5
                s.update(step, a, [[1.0] * k + [0.0] * (8 - k)], tokens=100.0 * (1 + a.difficulty) * 8)
        return out, s.weights(), s.signals()

    s = make_sampler(opts, arms, seed=3)
    drive(s, 0, 12)
    t = make_sampler(opts, arms, seed=99)
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert t.state_dict() == s.state_dict()
    assert drive(t, 12, 12) == drive(s, 12, 12)


def test_success_rate_reads_only_fresh_prompts_once_prompts_are_reported():
    arm = Arm("math", 0)
    s = make_sampler(cfg(lp_fast=1.0, lp_slow=0.5), [arm], seed=0)
    s.record_prompt(arm, "a", HALF)  # new prompt: counts
    s.update(0, arm, [HALF])
    assert s._s["succ_fast"][0][0] == 0.5 and s._s["since_probe"][0] == 8
    s.record_prompt(arm, "a", ZERO)  # re-used prompt (picked for being near p = 0.5): does not count
    s.update(1, arm, [ZERO])
    assert s._s["succ_fast"][0][0] == 0.5 and s._s["since_probe"][0] == 8
    s.record_prompt(arm, "b", ONE)
    s.record_prompt(arm, "a", ZERO)
    s.update(2, arm, [ONE, ZERO])  # only b's rewards: fast = 1, slow = 0.5 * 0.5 + 0.5 * 1
    assert s._s["succ_fast"][0][0] == 1.0 and s._s["succ_slow"][0][0] == 0.75
    assert s._s["n_groups"][0] == 4  # the learnability signal and counts still see every group
    # without record_prompt (the simulator) every group counts
    t = make_sampler(cfg(lp_fast=1.0, lp_slow=0.5), [arm], seed=0)
    t.update(0, arm, [HALF, ONE])
    assert t._s["succ_fast"][0][0] == 0.75


def test_schedule_ramps_eps_and_blends_uniform_by_domain_with_progress():
    # math has two arms, code one; equal signals everywhere, so the adaptive part is uniform over arms (1/3 each)
    arms = [Arm("math", 0), Arm("math", 1), Arm("code", 0)]
    s = make_sampler(cfg(eps=0.2, eps_end=0.3, domain_mix=0.3), arms, seed=0)
    for a in arms:
        s.update(0, a, [HALF])
    assert s.scheduled() == (0.2, 0.0)
    assert list(s.weights().values()) == pytest.approx([1 / 3] * 3)
    s.set_progress(0.5)
    assert s.scheduled() == pytest.approx((0.25, 0.15))
    # 0.85 * 1/3 + 0.15 * uniform_by_domain (1/4, 1/4, 1/2)
    assert list(s.weights().values()) == pytest.approx(
        [0.85 / 3 + 0.0375, 0.85 / 3 + 0.0375, 0.85 / 3 + 0.075]
    )
    s.set_progress(1.0)
    assert list(s.weights().values()) == pytest.approx([0.7 / 3 + 0.075, 0.7 / 3 + 0.075, 0.7 / 3 + 0.15])
    # all of it from uniform_by_domain, yet every arm keeps eps_end / K: 1/4 for each math arm is under 0.3
    arms5 = [Arm("math", i) for i in range(4)] + [Arm("code", 0)]
    t = make_sampler(cfg(eps=0.9, eps_end=None, domain_mix=1.0, max_share=1.0), arms5, seed=0)
    t.set_progress(1.0)
    w = list(t.weights().values())
    assert min(w) == pytest.approx(0.9 / 5) and sum(w) == pytest.approx(1.0)
    assert w[:4] == pytest.approx([0.18] * 4) and w[4] == pytest.approx(
        0.28
    )  # the code arm gives up the rest
    # eps_end = None keeps eps; the progress is saved with the state and bad values are refused
    assert make_sampler(cfg(eps=0.2, eps_end=None), arms, seed=0).scheduled() == (0.2, 0.0)
    u = make_sampler(cfg(eps=0.2, eps_end=0.3, domain_mix=0.3), arms, seed=1)
    u.load_state_dict(s.state_dict())
    assert u.progress == 1.0 and u.weights() == s.weights()
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"set_progress: the run's spent share must be in \[0, 1\]"):
            s.set_progress(bad)
    assert s.progress == 1.0  # a refused value leaves the schedule where it was
    old = s.state_dict()
    del old["stats"]["progress"]  # saved before set_progress existed
    u.load_state_dict(old)
    assert u.progress == 0.0


def test_uniform_by_domain_ignores_progress():
    arms = [Arm("math", 0), Arm("math", 1), Arm("code", 0)]
    s = make_sampler(cfg(sampler="uniform_by_domain"), arms, seed=0)
    before = s.weights()
    s.set_progress(0.9)
    assert s.weights() == before == {arms[0]: 0.25, arms[1]: 0.25, arms[2]: 0.5}
