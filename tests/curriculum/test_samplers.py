"""Facts about the samplers: where mass goes, floors, drops and restores, probes, determinism, state."""

import json
import math
from collections import Counter

import pytest
from pydantic import ValidationError

from posttrain.config import ConfigError, CurriculumConfig, load_config
from posttrain.curriculum import SAMPLERS, Arm, make_sampler

HALF = [1.0] * 4 + [0.0] * 4
ZERO = [0.0] * 8
ONE = [1.0] * 8
ARMS4 = [Arm("math", 0), Arm("math", 1), Arm("code", 0), Arm("code", 1)]


def cfg(**kw) -> CurriculumConfig:
    """A curriculum config; a sampler only the simulator offers (uniform_by_data) is set past validation,
    as bench/sim.py does."""
    sampler = kw.pop("sampler", "adaptive")
    c = CurriculumConfig(**kw)
    return c.model_copy(update={"sampler": sampler})


def feed(sampler, step, plan):
    for arm, groups in plan.items():
        sampler.update(step, arm, groups)


def test_mass_concentrates_on_learnable_arms():
    # math:1 and code:0 sit at p = 0.5; math:0 is mastered, code:1 all-fail; equal counts
    s = make_sampler(cfg(), ARMS4, seed=0)
    plan = {ARMS4[0]: [ONE] * 2, ARMS4[1]: [HALF] * 2, ARMS4[2]: [HALF] * 2, ARMS4[3]: [ZERO] * 2}
    for step in range(30):
        feed(s, step, plan)
    w = s.weights()
    # raw scores: bonus b + [0, 0.5 + 0.4 * 0.5, 0.5 + 0.4 * 0.5, 0.4 * 1] (L + weakness * (1 - success));
    # min-max -> [0, 1, 1, 0.4 / 0.7], then softmax over / tau (0.5); eps = 0.2 at the run's start
    e, z = math.exp(2.0), math.exp(0.4 / 0.7 / 0.5)
    assert w[ARMS4[1]] == pytest.approx(0.8 * e / (1 + 2 * e + z) + 0.2 / 4)
    assert w[ARMS4[0]] == pytest.approx(0.8 / (1 + 2 * e + z) + 0.2 / 4)
    assert w[ARMS4[3]] == pytest.approx(0.8 * z / (1 + 2 * e + z) + 0.2 / 4)
    drawn = Counter(s.sample(1000))
    assert drawn[ARMS4[1]] + drawn[ARMS4[2]] >= 723  # 2 x 0.3625 of the draws (systematic: within one each)


def test_every_arm_keeps_eps_over_k_and_cap_holds():
    arms = [Arm("d", i) for i in range(10)]
    s = make_sampler(cfg(eps=0.15, max_share=0.5), arms, seed=1)
    for step in range(50):
        s.update(step, arms[0], [HALF] * 8)  # only arm 0 is ever informative
        for a in arms[1:]:
            s.update(step, a, [ONE] * 8)
    w = s.weights()
    assert min(w.values()) >= 0.015 - 1e-12
    assert max(w.values()) <= 0.5 + 1e-12
    assert sum(w.values()) == pytest.approx(1.0)


def test_dropped_domain_gets_zero_then_regains_share():
    s = make_sampler(cfg(), ARMS4, seed=2)
    for step in range(5):
        feed(s, step, {a: [HALF] * 2 for a in ARMS4})
    before = s.signals()["curriculum/domain_share/code"]
    for a in ARMS4[2:]:
        s.set_data_size(a, 0)
    for step in range(5, 60):
        assert all(a.domain == "math" for a in s.sample(16))
        assert s.signals()["curriculum/domain_share/code"] == 0.0
        feed(s, step, {a: [HALF] * 4 for a in ARMS4[:2]})
    for a in ARMS4[2:]:
        s.set_data_size(a, 500)
    after = s.weights()
    # same learnability, fewer groups seen -> larger exploration bonus -> code now leads
    assert after[ARMS4[2]] > after[ARMS4[0]]
    assert s.signals()["curriculum/domain_share/code"] > max(before, 0.5)
    assert Counter(a.domain for a in s.sample(100))["code"] > 50


def test_decaying_arm_with_falling_probe_gains_share():
    arms = [Arm("math", 0), Arm("code", 0), Arm("tools", 0)]
    s = make_sampler(cfg(forget_z=0.0), arms, seed=3)
    for step in range(10):
        feed(s, step, {a: [ONE] * 4 for a in arms})
        for a in arms:
            s.record_probe(step, a, 0.9)
    w0 = s.weights()
    assert w0[arms[0]] == pytest.approx(1 / 3)
    s.record_probe(10, arms[0], 0.6)  # math:0 forgets: F = 0.3
    w1 = s.weights()
    assert s.signals()["curriculum/F/math:0"] == pytest.approx(0.3)
    # min-max scores [1, 0, 0]: 0.78 before the cap, then 0.5 and the rest split evenly
    assert [w1[a] for a in arms] == pytest.approx([0.5, 0.25, 0.25])
    s.record_probe(20, arms[0], 0.9)  # recovered: no forgetting any more
    assert s.weights()[arms[0]] == pytest.approx(1 / 3)


def test_forgetting_discounts_probe_noise():
    arms = [Arm("math", 0), Arm("code", 0)]
    s = make_sampler(cfg(forget_z=1.0, probe_size=64), arms, seed=0)
    s.record_probe(0, arms[0], 0.9)  # n defaults to probe_size = 64
    s.record_probe(10, arms[0], 0.6, n=32)
    # shrunk scores (0.9*64+1)/66 and (0.6*32+1)/34; SE = sqrt(b(1-b)/64 + c(1-c)/32)
    b, c = 58.6 / 66, 20.2 / 34
    se = math.sqrt(b * (1 - b) / 64 + c * (1 - c) / 32)
    assert s.forgetting()[0] == pytest.approx(0.3 - se)
    assert 0.2 < 0.3 - se < 0.23
    # a drop inside one standard error is noise: no forgetting, no extra share
    s.record_probe(0, arms[1], 0.55, n=16)
    s.record_probe(10, arms[1], 0.5, n=16)
    assert s.forgetting()[1] == 0.0
    assert s._s["probe_best"][1] == 0.55 and s._s["probe_best_n"][1] == 16
    with pytest.raises(ValueError, match=r"record_probe\(math:0\): n must be an integer >= 1, got 0"):
        s.record_probe(20, arms[0], 0.5, n=0)


def test_probe_due_only_for_adaptive():
    a = make_sampler(cfg(probe_every=10), ARMS4, seed=0)
    assert [st for st in range(31) if a.probe_due(st)] == [0, 10, 20, 30]
    assert not make_sampler(cfg(probe_every=0), ARMS4, seed=0).probe_due(0)
    assert not make_sampler(cfg(sampler="sec"), ARMS4, seed=0).probe_due(10)


def _drive(s, steps, start=0):
    picks = []
    for step in range(start, start + steps):
        arms = s.sample(8)
        picks.append([a.key for a in arms])
        by_arm = {}
        for i, a in enumerate(arms):
            r = HALF if (i + step) % 3 else ([1.0] + [0.0] * 7)
            by_arm.setdefault(a, []).append(r)
        feed(s, step, by_arm)
        pid = s.choose_prompt(arms[0], [f"p{j}" for j in range(6)])
        s.record_prompt(arms[0], pid, [1.0, 0.0, float(step % 2)])
        picks.append(pid)
        if s.probe_due(step):
            for a in ARMS4:
                s.record_probe(step, a, 0.5 + 0.01 * ((step * 7 + a.difficulty) % 5))
    return picks


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_same_seed_same_sequence(name):
    a = make_sampler(cfg(sampler=name), ARMS4, seed=7)
    b = make_sampler(cfg(sampler=name), ARMS4, seed=7)
    assert _drive(a, 25) == _drive(b, 25)
    if name not in ("uniform_by_domain", "dapo_filter_only", "uniform_by_data"):
        c = make_sampler(cfg(sampler=name), ARMS4, seed=8)
        assert _drive(c, 25) != _drive(make_sampler(cfg(sampler=name), ARMS4, seed=7), 25)


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_state_round_trip_is_exact(name):
    s = make_sampler(cfg(sampler=name), ARMS4, seed=11)
    _drive(s, 15)
    saved = json.loads(json.dumps(s.state_dict()))
    t = make_sampler(cfg(sampler=name), ARMS4, seed=999)
    t.load_state_dict(saved)
    assert t.state_dict() == s.state_dict()
    assert t.weights() == s.weights()
    assert _drive(t, 15, start=15) == _drive(s, 15, start=15)
    assert t.signals() == s.signals()


def test_state_from_other_sampler_or_arms_is_rejected():
    saved = make_sampler(cfg(sampler="sec"), ARMS4, seed=0).state_dict()
    with pytest.raises(ValueError, match="saved by sampler 'sec'"):
        make_sampler(cfg(), ARMS4, seed=0).load_state_dict(saved)
    with pytest.raises(ValueError, match="has arms"):
        make_sampler(cfg(sampler="sec"), ARMS4[:3], seed=0).load_state_dict(saved)


def test_bad_configs_rejected_with_clear_errors():
    with pytest.raises(ValidationError, match="eps"):
        CurriculumConfig(eps=1.5)
    with pytest.raises(ConfigError, match="'curriculum.eps'"):
        load_config(None, ["curriculum.eps=-0.1"])
    with pytest.raises(ValueError, match=r"curriculum.eps must be in \[0, 1\], got 2.0"):
        make_sampler(
            CurriculumConfig.model_construct(**{**CurriculumConfig().model_dump(), "eps": 2.0}), ARMS4, 0
        )
    with pytest.raises(ConfigError, match="'curriculum.eps_end'"):
        load_config(None, ["curriculum.eps_end=1.5"])
    with pytest.raises(ConfigError, match="'curriculum.domain_mix'"):
        load_config(None, ["curriculum.domain_mix=-0.1"])
    with pytest.raises(ValueError, match=r"curriculum.domain_mix must be in \[0, 1\], got 2.0"):
        make_sampler(
            CurriculumConfig.model_construct(**{**CurriculumConfig().model_dump(), "domain_mix": 2.0}),
            ARMS4,
            0,
        )
    with pytest.raises(ValueError, match=r"curriculum.eps_end must be in \[0, 1\] or None, got nan"):
        make_sampler(
            CurriculumConfig.model_construct(**{**CurriculumConfig().model_dump(), "eps_end": float("nan")}),
            ARMS4,
            0,
        )
    with pytest.raises(ValueError, match="sampler 'bandit' is unknown"):
        make_sampler(
            CurriculumConfig.model_construct(**{**CurriculumConfig().model_dump(), "sampler": "bandit"}),
            ARMS4,
            0,
        )


def test_unknown_domain_and_bad_arms_rejected():
    s = make_sampler(cfg(), ARMS4, seed=0)
    with pytest.raises(ValueError, match="unknown domain 'chess'.*domains \\['code', 'math'\\]"):
        s.update(0, Arm("chess", 0), [HALF])
    with pytest.raises(ValueError, match=r"unknown arm math:7: domain 'math' has difficulties \[0, 1\]"):
        s.record_probe(0, Arm("math", 7), 0.5)
    with pytest.raises(ValueError, match="arm listed twice"):
        make_sampler(cfg(), [Arm("math", 0), ("math", 0)], seed=0)
    with pytest.raises(ValueError, match="at least one arm"):
        make_sampler(cfg(), [], seed=0)
    with pytest.raises(ValueError, match="must not contain ':'"):
        make_sampler(cfg(), [Arm("a:b", 0)], seed=0)
    with pytest.raises(ValueError, match="non-empty list of rewards"):
        s.update(0, ARMS4[0], [[]])
    with pytest.raises(ValueError, match="no arm has data"):
        for a in ARMS4:
            s.set_data_size(a, 0)
        s.sample(1)


def test_filter_groups_drops_all_equal():
    s = make_sampler(cfg(sampler="dapo_filter_only"), ARMS4, seed=0)
    assert s.filters_groups and not make_sampler(cfg(), ARMS4, seed=0).filters_groups
    assert s.filter_groups([[1, 1, 1], [0, 1, 0], [0, 0], [0.5, 0.5, 0.25]]) == [False, True, False, True]


def test_uniform_samplers_weights():
    arms = [Arm("math", 0), Arm("math", 1), Arm("code", 0)]
    w = make_sampler(cfg(sampler="uniform_by_domain"), arms, seed=0).weights()
    assert list(w.values()) == pytest.approx([0.25, 0.25, 0.5])
    sizes = {arms[0]: 100, arms[1]: 300}
    w = make_sampler(cfg(sampler="uniform_by_data"), arms, seed=0, data_sizes=sizes).weights()
    assert list(w.values()) == pytest.approx([100 / 600, 300 / 600, 200 / 600])  # unknown -> mean known


def test_real_config_offers_only_samplers_the_loop_can_run():
    # uniform_by_data needs data sizes, which the task generators do not have: only the simulator has it
    with pytest.raises(ConfigError, match="'curriculum.sampler': got \"uniform_by_data\""):
        load_config(None, ["curriculum.sampler=uniform_by_data"])
    with pytest.raises(ConfigError, match="did you mean 'adaptive'"):
        load_config(None, ["curriculum.sampler=adaptiv"])
    assert load_config(None, ["curriculum.sampler=dapo_filter_only"]).curriculum.sampler == "dapo_filter_only"


def test_domain_weights_set_the_prior_shares():
    arms = [Arm("math", 0), Arm("math", 1), Arm("code", 0)]
    weights = {"math": 1.0, "code": 3.0}
    w = make_sampler(cfg(sampler="uniform_by_domain"), arms, seed=0, domain_weights=weights).weights()
    assert list(w.values()) == pytest.approx([0.125, 0.125, 0.75])  # domains 1 : 3, math split over 2 levels
    # adaptive, before any evidence: the softmax part follows the prior, the eps/K floor stays uniform
    # (code 1.5 keeps it under max_share 0.5)
    ad = make_sampler(cfg(), arms, seed=0, domain_weights={"math": 1.0, "code": 1.5}).weights()
    q = [1 / 3.5, 1 / 3.5, 1.5 / 3.5]
    assert list(ad.values()) == pytest.approx([0.8 * x + 0.2 / 3 for x in q])
    # sec and dump multiply their softmax by the prior
    sec = make_sampler(cfg(sampler="sec"), arms, seed=0, domain_weights=weights).weights()
    assert list(sec.values()) == pytest.approx([1 / 5, 1 / 5, 3 / 5])
    # equal weights are the plain rule, bit for bit
    plain = make_sampler(cfg(), arms, seed=0).weights()
    same = make_sampler(cfg(), arms, seed=0, domain_weights={"math": 2.0, "code": 2.0}).weights()
    assert plain == same
    with pytest.raises(ValueError, match="domain weights name \\['tools'\\]"):
        make_sampler(cfg(), arms, seed=0, domain_weights={"tools": 1.0})


def test_sec_and_dump_hand_computed():
    arms = [Arm("math", 0), Arm("code", 0)]
    sec = make_sampler(cfg(sampler="sec", sec_alpha=0.5, sec_tau=1.0), arms, seed=0)
    sec.update(0, arms[0], [[1.0, 0.0, 1.0, 0.0]])  # |A| = 0.5 / (0.5 + 1e-6) for all four
    q = 0.5 * 0.5 / (0.5 + 1e-6)
    assert sec.weights()[arms[0]] == pytest.approx(math.exp(q) / (math.exp(q) + 1))
    dump = make_sampler(cfg(sampler="dump", dump_tau=0.1, dump_window=3), arms, seed=0)
    dump.update(0, arms[0], [[1.0, 0.0, 1.0, 0.0]])  # window keeps the last 3 of 4 |A| values
    adv = 0.5 / (0.5 + 1e-6)
    u0 = adv + math.sqrt(2 * math.log(5) / 5)
    u1 = 0.0 + math.sqrt(2 * math.log(5) / 1)
    p0 = 1 / (1 + math.exp((u1 - u0) / 0.1))
    assert dump.weights()[arms[0]] == pytest.approx(p0)
    assert len(dump.state_dict()["stats"]["dump_window"][0]) == 3


def test_systematic_sampling_counts_within_one():
    s = make_sampler(cfg(sampler="uniform_by_domain"), [Arm("a", 0), Arm("b", 0), Arm("b", 1)], seed=5)
    counts = Counter(s.sample(10))
    assert counts[Arm("a", 0)] == 5 and abs(counts[Arm("b", 0)] - 2.5) <= 1


def test_choose_prompt_prefers_half_and_replays_mastered():
    arm = Arm("math", 0)
    s = make_sampler(cfg(replay_rate=0.0), [arm], seed=0)
    for _ in range(5):
        s.record_prompt(arm, "half", HALF)
        s.record_prompt(arm, "easy", ONE)
        s.record_prompt(arm, "hard", ZERO)
    picks = Counter(s.choose_prompt(arm, ["half", "easy", "hard"]) for _ in range(400))
    assert picks["easy"] == 0  # mastered and no replay
    assert picks["half"] > 380
    picks = Counter(s.choose_prompt(arm, ["half", "new", "hard"]) for _ in range(400))
    assert picks["half"] > picks["new"] > picks["hard"]  # unseen = unknown: between the two
    r = make_sampler(cfg(replay_rate=1.0), [arm], seed=0)
    r.record_prompt(arm, "easy", ONE)
    assert {r.choose_prompt(arm, ["easy", "x", "y"]) for _ in range(20)} == {"easy"}


def test_reward_scale_normalises_learnability_across_domains():
    arms = [Arm("math", 0), Arm("judge", 0)]
    s = make_sampler(cfg(), arms, seed=0)
    s.update(0, arms[0], [[1.0, 0.0]])  # binary: |r - mean| = 0.5, range 1
    s.update(0, arms[1], [[10.0, 0.0]])  # 0..10 scores: |r - mean| = 5, range 10
    sig = s.signals()
    assert sig["curriculum/L/math:0"] == pytest.approx(0.5)
    assert sig["curriculum/L/judge:0"] == pytest.approx(0.5)


def test_numpy_integers_are_accepted():
    import numpy as np

    s = make_sampler(cfg(), [Arm("math", np.int64(0))], seed=np.int64(3))
    s.update(np.int64(2), Arm("math", np.int64(0)), [HALF])
    assert s.sample(np.int64(2)) == [Arm("math", 0), Arm("math", 0)]
    with pytest.raises(ValueError, match="step must be an integer >= 0, got 1.5"):
        s.update(1.5, Arm("math", 0), [HALF])
