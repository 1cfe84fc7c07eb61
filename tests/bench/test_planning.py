"""The planning reference (`oracle_plan`): the learner's expected dynamics, the cross-entropy method, and
what planning with the hidden state reaches."""

import math

import numpy as np
import pytest

from posttrain.bench import planning
from posttrain.bench.curriculum import _ratio, baseline, run_metrics
from posttrain.bench.planning import PlanningOracle, cross_entropy_min, expected_run, move
from posttrain.bench.sim import ORACLE, ORACLE_PLAN, REMOVED_ARM, SimSettings, make_learner, run
from posttrain.cli.bench import run_bench
from posttrain.config import CurriculumConfig


def test_a_groups_mean_gradient_is_p1mp_times_1_minus_1_over_g():
    # Learner.train's group gradient mean((r - mean r)(r - p)) is the rewards' variance r(1-r) for a
    # success rate r = k/G; over Binomial(G, p) it averages p(1-p)(1 - 1/G), the drift expected_run uses.
    for g, p in [(2, 0.5), (8, 0.3), (8, 0.02), (16, 0.9)]:
        mean = sum(math.comb(g, k) * p**k * (1 - p) ** (g - k) * (k / g) * (1 - k / g) for k in range(g + 1))
        assert mean == pytest.approx(p * (1 - p) * (1 - 1 / g), abs=1e-15)


def test_move_reproduces_learner_train_given_the_step():
    learner = make_learner(3)
    rng = np.random.default_rng(0)
    learner.theta = learner.theta + rng.normal(0.0, 0.5, len(learner.arms))
    theta = learner.theta.copy()
    idx = np.array([0, 0, 1, 3, 3, 3, 6])  # arms 2, 4, 5 and 7 get no group: their disuse decay applies
    rewards = (rng.random((len(idx), 8)) < 0.5).astype(float)
    grads = rewards.var(axis=1)
    step = np.zeros(len(learner.arms))
    np.add.at(step, idx, grads)
    step *= learner.eta / len(idx)
    idle = np.ones(len(learner.arms))
    idle[idx] = 0.0
    predicted = move(learner, theta, step, idle)
    learner.train(idx, rewards)
    assert np.abs(predicted - learner.theta).max() < 1e-12


def test_expected_dynamics_predict_uniforms_final_accuracy():
    # The threshold the planner aims at is uniform_by_domain's final macro accuracy as the expected
    # dynamics predict it; the realised (stochastic) runs land within 0.004 of it on these seeds.
    s, cfg = SimSettings(), CurriculumConfig()
    for seed in range(8):
        learner = make_learner(seed)
        predicted = PlanningOracle(cfg, learner.arms, seed, learner, s).threshold
        assert abs(predicted - run("uniform_by_domain", seed, cfg, s).p[-1].mean()) < 0.005


def test_expected_run_splits_plans_into_phases_and_stops_at_the_budget():
    learner, s = make_learner(0), SimSettings()
    k = len(learner.arms)
    only = np.eye(k)
    plans = np.stack([np.stack([only[1], only[1]]), np.stack([only[1], only[7]])])  # (2 plans, 2 phases, k)
    budget = 20 * s.groups_per_step * s.group_size * learner.tokens[1]
    res = expected_run(learner, learner.theta, plans, 0.0, budget, s, np.inf, learner.p)
    # the first phase is the same, so arm 1 gains as much in both up to half the budget; then plan 0 keeps
    # training it (higher final p) and plan 1 trains arm 7 instead
    assert res["final"][0, 1] > res["final"][1, 1]
    assert res["final"][1, 7] > res["final"][0, 7]
    assert np.all(np.isinf(res["reach"]))  # threshold inf: never reached
    assert np.all(res["peak"] >= res["final"] - 1e-15)


def test_expected_run_gives_the_removed_arm_nothing_while_its_data_is_away():
    learner, s = make_learner(0), SimSettings()
    rm = learner.arms.index(REMOVED_ARM)
    k = len(learner.arms)
    budget = 40 * s.groups_per_step * s.group_size * learner.tokens.mean()
    start = 0.5 * budget  # inside the removal window [0.35, 0.65) of the budget
    only_removed = np.eye(k)[rm][None, None, :]
    away = expected_run(learner, learner.theta, only_removed, start, budget, s, np.inf, learner.p, removed=rm)
    idle = expected_run(learner, learner.theta, only_removed, start, budget, s, np.inf, learner.p)
    # with its data away, the all-on-code:0 plan trains the other arms (uniformly) until the data returns;
    # without a window it trains code:0 alone, so the other domains' arms only decay
    elsewhere = learner.domain_of != learner.domain_of[rm]
    assert np.all(away["final"][0, elsewhere] > idle["final"][0, elsewhere])
    assert np.all(idle["final"][0, elsewhere] <= learner.p[elsewhere] + 1e-12)
    assert away["final"][0, rm] < idle["final"][0, rm]  # code:0 itself trained less
    # a window over the whole run: the plan is exactly uniform over the arms with data
    always = SimSettings(removed_from=0.0, removed_until=2.0)
    rest = np.where(np.arange(k) == rm, 0.0, 1.0 / (k - 1))[None, None, :]
    a = expected_run(learner, learner.theta, only_removed, 0.0, budget, always, np.inf, learner.p, removed=rm)
    b = expected_run(learner, learner.theta, rest, 0.0, budget, always, np.inf, learner.p, removed=rm)
    assert np.array_equal(a["final"], b["final"])


def test_batched_cross_entropy_equals_the_pointwise_one():
    def f(x: np.ndarray) -> float:
        return float(((x - np.array([1.0, -2.0])) ** 2).sum())

    a = cross_entropy_min(f, np.zeros(2), np.ones(2), 12, 20, 5, np.random.default_rng(7))
    b = cross_entropy_min(
        lambda xs: [f(x) for x in xs],
        np.zeros(2),
        np.ones(2),
        12,
        20,
        5,
        np.random.default_rng(7),
        batched=True,
    )
    assert a[0] == b[0] and np.array_equal(a[1], b[1])
    assert a[0] < 0.05  # it found the minimum (1, -2)


def test_planning_oracle_is_deterministic_and_beats_the_greedy_oracle():
    cfg, s = CurriculumConfig(), SimSettings()
    ratios = {ORACLE: [], ORACLE_PLAN: []}
    for seed in (0, 1):
        budget, threshold, base_m, _ = baseline(seed, cfg, s)
        for name in ratios:
            r = run(name, seed, cfg, s)
            ratios[name].append(_ratio(run_metrics(r, budget, threshold), budget, base_m))
    assert np.array_equal(
        r.groups_by_arm, run(ORACLE_PLAN, 1, cfg, s).groups_by_arm
    )  # r: oracle_plan, seed 1
    # measured: oracle 0.744 and 0.729, oracle_plan 0.604 and 0.720 (uniform = 1)
    assert np.mean(ratios[ORACLE_PLAN]) < np.mean(ratios[ORACLE]) - 0.05
    assert max(ratios[ORACLE_PLAN]) < 0.75


def test_replan_keeps_the_previous_plan_unless_the_search_beats_it(monkeypatch):
    learner = make_learner(0)
    oracle = PlanningOracle(CurriculumConfig(), learner.arms, 0, learner, SimSettings())
    oracle.weights()  # the first plan
    first, logits = oracle._plan.copy(), oracle._mu.copy()
    monkeypatch.setattr(planning, "cross_entropy_min", lambda score, mu, *a, **kw: (math.inf, mu + 5.0))
    oracle._replan()
    assert np.array_equal(oracle._plan, first) and np.array_equal(oracle._mu, logits)
    monkeypatch.setattr(
        planning, "cross_entropy_min", lambda score, mu, *a, **kw: (-math.inf, np.zeros_like(mu))
    )
    oracle._replan()
    assert oracle._plan == pytest.approx(np.full(len(learner.arms), 1 / len(learner.arms)))


def test_bench_runs_oracle_plan_only_when_named(capsys):
    out = run_bench(
        "curriculum", ["--seeds", "1", "--samplers", "uniform_by_domain,oracle_plan", "--boot", "50"]
    )
    assert set(out["tokens_to_threshold_ratio"]) == {"uniform_by_domain", ORACLE_PLAN}
    assert out["tokens_to_threshold_ratio"][ORACLE_PLAN] < 1.0
    assert (
        ORACLE_PLAN
        not in run_bench("curriculum", ["--seeds", "1", "--boot", "50"])["tokens_to_threshold_ratio"]
    )
