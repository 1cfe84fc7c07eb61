"""The simulator's dynamics, the benchmark's metrics and contract, and the domain-share plot."""

import json
import subprocess
import sys

import numpy as np
import pytest

from posttrain.bench.curriculum import (
    auc_vs_tokens,
    bootstrap_ci,
    first_crossing,
    per_arm_figures,
    run_metrics,
    target_intervals,
)
from posttrain.bench.plot import domain_shares, plot_domain_shares
from posttrain.bench.sim import Learner, OracleSampler
from posttrain.cli.bench import run_bench
from posttrain.config import CurriculumConfig
from posttrain.curriculum import Arm


def main(args: list[str]) -> dict:
    """`posttrain bench curriculum ARGS` in this process."""
    return run_bench("curriculum", args)


def _learner(theta, arms, **kw) -> Learner:
    k = len(arms)
    return Learner(
        arms=arms,
        roles=["learnable"] * k,
        theta=np.array(theta, dtype=float),
        floor=np.full(k, -10.0),
        eta=np.ones(k),
        kappa=kw.get("kappa", np.zeros(k)),
        delta=kw.get("delta", np.zeros(k)),
        tokens=np.full(k, 100.0),
        data_size=np.full(k, 100),
        rho=kw.get("rho", {a.domain: 0.0 for a in arms}),
    )


def test_learner_step_is_bernoulli_policy_gradient():
    L = _learner([0.0], [Arm("a", 0)])
    L.train(np.array([0]), np.array([[1.0, 0.0]]))
    # p = 0.5: mean((r - 0.5) * (r - 0.5)) = 0.25, eta 1, one group in the batch
    assert L.theta[0] == pytest.approx(0.25)
    L.train(np.array([0]), np.array([[1.0, 1.0]]))  # all-equal group teaches nothing
    assert L.theta[0] == pytest.approx(0.25)


def test_learner_transfer_interference_and_disuse():
    arms = [Arm("a", 0), Arm("a", 1), Arm("b", 0)]
    L = _learner(
        [0.0, 0.0, 0.0],
        arms,
        rho={"a": 0.5, "b": 0.0},
        kappa=np.array([0.0, 0.0, 1.0]),
        delta=np.array([0.0, 0.0, 0.1]),
    )
    L.train(np.array([0]), np.array([[1.0, 0.0]]))
    assert L.theta[0] == pytest.approx(0.25)
    assert L.theta[1] == pytest.approx(0.125)  # same-domain transfer rho * step
    # arm b: disuse exp(-0.1) then interference exp(-1 * 0.25) toward the floor -10
    assert L.theta[2] == pytest.approx(-10 + 10 * np.exp(-0.1) * np.exp(-0.25))


def test_oracle_weights_follow_hidden_gain():
    arms = [Arm("a", 0), Arm("a", 1)]
    L = _learner([0.0, np.log(9.0)], arms)  # p = 0.5 and 0.9, eta 1
    o = OracleSampler(CurriculumConfig(eps=0.2), arms, 0, L)
    g = np.array([0.25**2, 0.09**2])
    w = o.weights()
    assert [w[a] for a in arms] == pytest.approx(list(0.8 * g / g.sum() + 0.1))
    assert not o.uses_probes


def test_metrics_hand_computed():
    tokens = np.array([0.0, 10.0, 20.0, 30.0])
    macro = np.array([0.0, 0.5, 0.4, 1.0])
    assert first_crossing(tokens, macro, 0.45) == 10.0
    assert first_crossing(tokens, macro, 1.1) == float("inf")
    # trapezoids 2.5 + 4.5 + then cut at 25 tokens: (0.4 + 0.7)/2 * 5 = 2.75 -> 9.75 / 25
    assert auc_vs_tokens(tokens, macro, 25.0) == pytest.approx(9.75 / 25)
    lo, hi = bootstrap_ci(np.array([1.0, 2.0, 3.0]), 500)
    assert 1.0 <= lo < 2.0 < hi <= 3.0


def test_bench_small_run_reports_every_sampler(tmp_path):
    png = tmp_path / "shares.png"
    out = main(
        ["--seeds", "2", "--budget-steps", "15", "--groups-per-step", "8", "--boot", "50", "--plot", str(png)]
    )
    for key in (
        "tokens_to_threshold_ratio",
        "forgetting",
        "worst_arm_accuracy",
        "auc",
        "final_macro_accuracy",
    ):
        assert set(out[key]) == {
            "uniform_by_domain",
            "uniform_by_data",
            "dapo_filter_only",
            "sec",
            "dump",
            "adaptive",
            "oracle",
        }
    assert out["tokens_to_threshold_ratio"]["uniform_by_domain"] == 1.0
    assert out["probe_token_share"]["adaptive"] > 0 and out["probe_token_share"]["sec"] == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert list(out["per_arm"]["adaptive"]) == [
        "math:0",
        "math:1",
        "math:2",
        "code:0",
        "code:1",
        "tools:0",
        "tools:1",
        "logic:0",
    ]
    per_arm_forgetting = np.mean([v["forgetting"] for v in out["per_arm"]["sec"].values()])
    assert per_arm_forgetting == pytest.approx(out["forgetting"]["sec"])  # the headline is the mean over arms
    assert "uniform_by_domain" not in out["largest_shortfall_vs_uniform"]
    assert set(out["adaptive_forgetting_minus_ci95"]) == {"sec", "dump"}
    # one seed: the paired interval of adaptive - sec collapses onto that seed's difference
    one = main(
        [
            "--seeds",
            "1",
            "--budget-steps",
            "15",
            "--groups-per-step",
            "8",
            "--boot",
            "50",
            "--samplers",
            "uniform_by_domain,sec,adaptive",
        ]
    )
    lo, hi = one["adaptive_forgetting_minus_ci95"]["sec"]
    assert lo == hi == pytest.approx(one["forgetting"]["adaptive"] - one["forgetting"]["sec"])
    assert set(one["adaptive_forgetting_minus_ci95"]) == {"sec"}
    assert set(one["targets_ci95"]) == set(one["targets"])
    assert one["targets_ci95"]["forgetting_better_than_sec"]["interval"] == [lo, hi]


def test_targets_read_from_intervals_say_met_tie_or_missed():
    """The interval verdicts: met only when the whole interval is on the target's side of its limit."""
    out = {
        "tokens_to_threshold_ratio_ci95": {"adaptive": [0.80, 0.90]},  # all above 0.75: missed
        "worst_arm_accuracy_diff_vs_uniform_ci95": {"adaptive": [0.01, 0.20]},  # all above 0: met
        "forgetting_diff_vs_uniform_ci95": {"adaptive": [-0.0004, 0.0019]},  # holds 0: tie
        "adaptive_forgetting_minus_ci95": {"sec": [-0.007, -0.002], "dump": [0.001, 0.004]},  # met, missed
    }
    got = {k: (v["verdict"], v["limit"], v["interval"]) for k, v in target_intervals(out).items()}
    assert got == {
        "tokens_to_threshold_ratio<=0.75": ("missed", 0.75, [0.80, 0.90]),
        "worst_arm_not_worse_than_uniform": ("met", 0.0, [0.01, 0.20]),
        "forgetting_not_worse_than_uniform": ("tie", 0.0, [-0.0004, 0.0019]),
        "forgetting_better_than_sec": ("met", 0.0, [-0.007, -0.002]),
        "forgetting_better_than_dump": ("missed", 0.0, [0.001, 0.004]),
    }
    out["tokens_to_threshold_ratio_ci95"]["adaptive"] = [0.70, 0.74]
    out["worst_arm_accuracy_diff_vs_uniform_ci95"]["adaptive"] = [-0.02, 0.0]  # touches the limit: a tie
    again = target_intervals(out)
    assert again["tokens_to_threshold_ratio<=0.75"]["verdict"] == "met"
    assert again["worst_arm_not_worse_than_uniform"]["verdict"] == "tie"


def test_per_arm_figures_hand_computed():
    final = {
        "uniform_by_domain": [np.array([0.5, 0.5]), np.array([0.6, 0.4])],
        "adaptive": [np.array([0.7, 0.3]), np.array([0.6, 0.6])],
    }
    forget = {
        "uniform_by_domain": [np.zeros(2), np.zeros(2)],
        "adaptive": [np.array([0.1, 0.0]), np.array([0.3, 0.0])],
    }
    out = per_arm_figures(final, forget, ["a:0", "b:0"], 200)
    ada = out["per_arm"]["adaptive"]
    assert ada["a:0"]["final"] == pytest.approx(0.65) and ada["a:0"]["forgetting"] == pytest.approx(0.2)
    assert ada["a:0"]["final_minus_uniform"] == pytest.approx(0.1)
    assert ada["b:0"]["final_minus_uniform"] == pytest.approx(0.0)
    # seed 0: arm b ends 0.2 below uniform's; seed 1: no arm below (0, not -0.2) -> mean 0.1
    assert out["largest_shortfall_vs_uniform"] == {"adaptive": pytest.approx(0.1)}
    lo, hi = out["largest_shortfall_vs_uniform_ci95"]["adaptive"]
    assert 0.0 <= lo <= 0.1 <= hi <= 0.2


def test_bench_real_wiring_on_a_tiny_model(tmp_path):
    from posttrain.telemetry import read_metrics

    out = main(
        [
            "--real",
            "--quick",
            "--model",
            "tiny:llama",
            "--domains",
            "math:0;tools.apis:0",
            "--steps",
            "2",
            "--prompts-per-step",
            "2",
            "--samples-per-prompt",
            "2",
            "--n-eval",
            "2",
            "--max-new-tokens",
            "8",
            "--probe-every",
            "1",
            "--probe-size",
            "1",
            "--seed-start",
            "5",
            "--out",
            str(tmp_path),
        ]
    )
    assert out["seeds"] == [5] and out["rollouts_per_uniform_run"] == 2 * 2 * 2 and out["budget"] == "tokens"
    uni, ada = out["per_seed"]["uniform_by_domain"][0], out["per_seed"]["adaptive"][0]
    assert uni["seed"] == 5 and "seed: 5" in (tmp_path / "adaptive-seed5" / "config.yaml").read_text()
    assert uni["steps"] == 2 and sum(uni["groups_by_arm"].values()) == 4 and uni["probes"] == 0
    # adaptive's budget is the tokens uniform generated; it stops at the first step that reaches it
    (budget,) = out["token_budget_per_seed"]
    assert budget == uni["generated_tokens"] + uni["probe_tokens"]
    rows = read_metrics(tmp_path / "adaptive-seed5" / "metrics.jsonl")
    spent = np.cumsum([r["rollout/generated_tokens"] + r.get("heldout/generated_tokens", 0.0) for r in rows])
    assert spent[-1] == ada["generated_tokens"] + ada["probe_tokens"]
    assert (spent[-1] >= budget or len(rows) == 3 * 2) and (len(rows) == 1 or spent[-2] < budget)
    assert [len(v) for v in ada["per_task"].values()] == [2, 2]  # kept for pooling across invocations
    assert ada["probes"] == len(rows)  # probe_every 1: a probe after every step, charged to the budget
    for sampler in ("uniform_by_domain", "adaptive"):
        assert set(out["per_domain"][sampler]) == {"math", "tools.apis", "all"}
        assert out["per_domain"][sampler]["all"]["n"] == 4  # 2 held-out tasks x 2 arms
        assert (tmp_path / f"{sampler}-seed5" / "policy" / "config.json").is_file()
        assert not (tmp_path / f"{sampler}-seed5" / "checkpoints").exists()
    assert set(out["delta_adaptive_minus_uniform"]["5"]["per_domain"]) == {"math", "tools.apis"}
    assert set(out["base"]) == {"math", "tools.apis", "all"} and out["base"]["all"]["n"] == 4
    saved = json.loads((tmp_path / "result.json").read_text())  # what --pool reads
    assert saved == json.loads(json.dumps(out))
    again = main(["--pool", str(tmp_path)])  # one saved result pools to itself
    assert again["per_domain"] == saved["per_domain"] and again["seeds"] == [5]

    # --reuse-uniform: only adaptive runs, on the saved seeds, budgets, sizes and held-out tasks. With the
    # same settings it reproduces the saved adaptive run exactly; with --set it records what it changed.
    same = main(["--real", "--reuse-uniform", str(tmp_path), "--out", str(tmp_path / "same")])
    assert not (tmp_path / "same" / "uniform_by_domain-seed5").exists()
    assert same["per_seed"]["uniform_by_domain"] == saved["per_seed"]["uniform_by_domain"]
    assert same["base"] == saved["base"] and same["token_budget_per_seed"] == [budget]
    assert same["sizes"] == saved["sizes"] and same["quick"] is True and same["uniform_from"] == str(tmp_path)
    mine, theirs = same["per_seed"]["adaptive"][0], saved["per_seed"]["adaptive"][0]
    assert {k: v for k, v in mine.items() if k != "train_s"} == {
        k: v for k, v in theirs.items() if k != "train_s"
    }
    assert same["delta_adaptive_minus_uniform"] == saved["delta_adaptive_minus_uniform"]
    other = main(
        ["--real", "--reuse-uniform", str(tmp_path), "--set", "lam=0", "--out", str(tmp_path / "lam0")]
    )
    assert "lam: 0.0" in (tmp_path / "lam0" / "adaptive-seed5" / "config.yaml").read_text()
    assert other["adaptive_overrides"] == ["lam=0"] and other["uniform_overrides"] == []
    assert (
        other["adaptive_curriculum"]["lam"] == 0.0
        and same["adaptive_curriculum"]["lam"] == CurriculumConfig().lam
    )
    assert other["per_seed"]["uniform_by_domain"] == saved["per_seed"]["uniform_by_domain"]
    with pytest.raises(SystemExit):  # two adaptive settings are not one matrix
        main(["--pool", str(tmp_path / "same"), str(tmp_path / "lam0")])


def test_bench_real_rejects_bad_domains(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--real", "--quick", "--model", "tiny:llama", "--domains", "math:9"])
    assert exc.value.code == 2
    assert "'math' has no difficulty 9" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--real", "--domains", "math"])
    assert "is not of the form name:level" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--real", "--quick", "--model", "tiny:llama", "--steps", "0"])
    assert "--steps must be >= 1, got 0" in capsys.readouterr().err


def test_domain_shares_and_plot(tmp_path):
    rows = [
        {
            "step": 1,
            "curriculum/weight/math:0": 0.2,
            "curriculum/weight/math:1": 0.3,
            "curriculum/weight/code:0": 0.5,
        },
        {"step": 2, "loss": 1.0},
        {
            "step": 3,
            "curriculum/weight/math:0": 0.1,
            "curriculum/weight/math:1": 0.1,
            "curriculum/weight/code:0": 0.8,
        },
    ]
    steps, shares = domain_shares(rows)
    assert steps == [1.0, 3.0]
    assert shares["math"] == pytest.approx([0.5, 0.2]) and shares["code"] == pytest.approx([0.5, 0.8])
    out = plot_domain_shares(rows, tmp_path / "d" / "p.png")
    assert out.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_domain_shares([{"step": 1, "loss": 0.1}], tmp_path / "x.png")


def test_curriculum_does_not_import_torch():
    code = "import sys, posttrain.curriculum, posttrain.bench.curriculum; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sim_probes_and_charges_only_the_arms_the_sampler_names():
    from posttrain.bench.sim import SimSettings, make_learner, run

    s = SimSettings(groups_per_step=8, budget_uniform_steps=30)
    learner = make_learner(0)
    per_domain = {d: sum(1 for a in learner.arms if a.domain == d) for d in {a.domain for a in learner.arms}}
    full = sum((16 // per_domain[a.domain]) * t for a, t in zip(learner.arms, learner.tokens, strict=True))
    every = run("adaptive", 0, CurriculumConfig(probe_skip_rollouts=0), s)
    steps = len(every.tokens) - 1
    assert every.probe_tokens == pytest.approx(full * len(range(0, steps, 10)))
    # skip any arm with a training rollout since its last probe: step 0 probes all, later only the unsampled
    some = run("adaptive", 0, CurriculumConfig(probe_skip_rollouts=1), s)
    assert full <= some.probe_tokens < every.probe_tokens


def test_bench_seed_start_picks_other_learners(capsys):
    args = [
        "--seeds",
        "1",
        "--budget-steps",
        "10",
        "--groups-per-step",
        "8",
        "--boot",
        "20",
        "--samplers",
        "uniform_by_domain,adaptive",
    ]
    a, b = main(args), main([*args, "--seed-start", "100"])
    assert a["seed_start"] == 0 and b["seed_start"] == 100
    assert a["final_macro_accuracy"] != b["final_macro_accuracy"]
    with pytest.raises(SystemExit):
        main([*args, "--seed-start", "-1"])
    assert "--seed-start must be >= 0, got -1" in capsys.readouterr().err


def test_layouts_parse_and_reach_the_learner_and_the_bench(capsys):
    from posttrain.bench.sim import LAYOUT, LAYOUTS, make_learner, parse_layout

    spelt = ",".join(f"{d}:{lv}={role}" for d, lv, role in LAYOUT)
    assert parse_layout(spelt) == LAYOUT == parse_layout(" default ")
    assert parse_layout("code:0=learnable, x:2=too_hard") == (("code", 0, "learnable"), ("x", 2, "too_hard"))
    for bad, says in (
        ("nope", "neither a preset"),
        ("code:0=learnable,a:1=easy", "role 'easy' is not one of"),
        ("code:0=learnable,a=mastered", "'a=mastered' must be domain:level=role"),
        ("a:0=mastered,a:1=learnable", "must include code:0"),
        ("code:0=learnable,code:0=mastered", "names an arm twice"),
        ("code:0=learnable", "needs an arm besides code:0"),
    ):
        with pytest.raises(ValueError, match=says):
            parse_layout(bad)
    idle = make_learner(5, LAYOUTS["idle_heavy"])
    assert [a.key for a in idle.arms] == [f"{d}:{lv}" for d, lv, _ in LAYOUTS["idle_heavy"]]
    assert (
        idle.roles[6:] == ["mastered", "too_hard"] and 0.85 <= idle.p[6] <= 0.95 and 0.01 <= idle.p[7] <= 0.03
    )
    assert np.array_equal(make_learner(5).theta, make_learner(5, LAYOUT).theta)

    args = [
        "--seeds",
        "1",
        "--budget-steps",
        "10",
        "--groups-per-step",
        "8",
        "--boot",
        "20",
        "--samplers",
        "uniform_by_domain,adaptive",
    ]
    default, same = main(args), main([*args, "--layout", spelt])
    assert default["layout"] == "default" and same["forgetting"] == default["forgetting"]
    out = main([*args, "--layout", "idle_heavy"])
    assert out["layout"] == "idle_heavy" and list(out["per_arm"]["adaptive"])[-2:] == ["tools:1", "logic:0"]
    assert out["final_macro_accuracy"] != default["final_macro_accuracy"]
    with pytest.raises(SystemExit):
        main([*args, "--layout", "math:0=mastered"])
    assert "--layout: layout 'math:0=mastered' must include code:0" in capsys.readouterr().err


def test_static_sampler_holds_its_weights_and_rejects_bad_ones():
    from posttrain.bench.sim import StaticSampler

    arms = [Arm("a", 0), Arm("a", 1), Arm("b", 0)]
    s = StaticSampler(CurriculumConfig(), arms, 0, np.array([0.0, 3.0, 1.0]))
    assert list(s.weights().values()) == [0.0, 0.75, 0.25]
    s.set_data_size(Arm("a", 1), 0)  # a removed arm's share goes to the others in proportion
    assert list(s.weights().values()) == [0.0, 0.0, 1.0]
    for bad in ([1.0, 1.0], [1.0, -1.0, 1.0], [0.0, 0.0, 0.0], [1.0, float("nan"), 1.0]):
        with pytest.raises(ValueError, match="StaticSampler"):
            StaticSampler(CurriculumConfig(), arms, 0, np.array(bad))


def test_hindsight_search_returns_the_best_mix_it_tried():
    from posttrain.bench.curriculum import hindsight_search
    from posttrain.bench.sim import HINDSIGHT, SimSettings, budget_tokens, make_learner, run

    cfg, s = CurriculumConfig(), SimSettings(groups_per_step=8, budget_uniform_steps=20)
    budget = budget_tokens(make_learner(3), s)
    threshold = float(run("uniform_by_domain", 3, cfg, s).p[-1].mean())
    limits = (0.001, 0.5)  # tight: every candidate pays some penalty
    w, r = hindsight_search(3, cfg, s, budget, threshold, rounds=1, population=4, elite=2, limits=limits)
    # replay the one round by hand: the same candidates, scored by the stated objective
    logits = np.random.default_rng(30_000 + 3).standard_normal((4, 8))
    scores, runs = [], []
    for x in logits:
        cand = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
        rr = run(HINDSIGHT, 3, cfg, s, static_weights=cand)
        macro = rr.p.mean(axis=1)
        t = first_crossing(rr.tokens, macro, threshold)
        score = t if np.isfinite(t) else budget * (1 + max(0.0, threshold - macro[-1]))
        forgetting = (rr.p.max(axis=0) - rr.p[-1]).mean()
        scores.append(score + 100 * budget * (max(0.0, forgetting - 0.001) + max(0.0, 0.5 - rr.p[-1].min())))
        runs.append(cand)
    assert w == pytest.approx(runs[int(np.argmin(scores))])
    assert np.array_equal(r.p, run(HINDSIGHT, 3, cfg, s, static_weights=w).p)


def test_static_sampler_plan_switches_rows_with_the_spent_budget():
    from posttrain.bench.sim import StaticSampler

    arms = [Arm("a", 0), Arm("b", 0)]
    s = StaticSampler(CurriculumConfig(), arms, 0, np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 2.0]]))
    for frac, want in (
        (0.0, [1.0, 0.0]),
        (0.33, [1.0, 0.0]),
        (0.34, [0.5, 0.5]),
        (0.67, [0.0, 1.0]),
        (1.0, [0.0, 1.0]),
    ):
        s.set_progress(frac)
        assert list(s.weights().values()) == want, frac
    for bad in ([[1.0, 1.0], [0.0, 0.0]], [[1.0, 1.0, 1.0]], np.ones((2, 2, 2))):
        with pytest.raises(ValueError, match="one per phase"):
            StaticSampler(CurriculumConfig(), arms, 0, np.array(bad))


def test_sim_run_plan_and_fresh_noise():
    from posttrain.bench.sim import HINDSIGHT, SimSettings, run

    cfg, s = CurriculumConfig(), SimSettings(groups_per_step=8, budget_uniform_steps=12)
    w = np.linspace(1.0, 2.0, 8)
    flat = run(HINDSIGHT, 2, cfg, s, static_weights=w)
    assert np.array_equal(
        flat.p, run(HINDSIGHT, 2, cfg, s, static_weights=np.stack([w, w, w])).p
    )  # a plan of equal rows
    two = np.stack([w, np.eye(8)[5]])  # second half of the budget: only arm 5 (tools:0)
    plan = run(HINDSIGHT, 2, cfg, s, static_weights=two)
    half = int(np.searchsorted(plan.tokens, plan.tokens[-1] / 2))
    assert np.array_equal(plan.p[:half], flat.p[:half])
    late = plan.groups_by_arm - run(HINDSIGHT, 2, cfg, s, static_weights=w).groups_by_arm
    assert late[5] > 0 and np.all(np.delete(late, 5) <= 0)
    assert np.array_equal(flat.p, run(HINDSIGHT, 2, cfg, s, static_weights=w, noise=0).p)
    fresh = run(HINDSIGHT, 2, cfg, s, static_weights=w, noise=1)
    assert np.array_equal(fresh.p[0], flat.p[0]) and not np.array_equal(
        fresh.p, flat.p
    )  # same learner, other draws


def test_bench_hindsight_plan_is_scored_on_a_fresh_run(capsys):
    from posttrain.bench.curriculum import hindsight_search
    from posttrain.bench.sim import HINDSIGHT, SimSettings, budget_tokens, make_learner, run

    args = [
        "--seeds",
        "1",
        "--budget-steps",
        "10",
        "--groups-per-step",
        "8",
        "--boot",
        "20",
        "--samplers",
        "uniform_by_domain",
        "--hindsight",
        "1",
        "--hindsight-phases",
        "2",
    ]
    out = main(args)
    assert out["hindsight_phases"] == 2 and len(out["hindsight_weights"]) == 2
    assert all(sum(row.values()) == pytest.approx(1.0) for row in out["hindsight_weights"])
    cfg, s = CurriculumConfig(), SimSettings(groups_per_step=8, budget_uniform_steps=10)
    base = run("uniform_by_domain", 0, cfg, s)
    budget, threshold = budget_tokens(make_learner(0), s), float(base.p[-1].mean())
    base_m = run_metrics(base, budget, threshold)
    plan, r = hindsight_search(
        0, cfg, s, budget, threshold, 1, limits=(base_m["forgetting"], base_m["worst_arm_accuracy"]), phases=2
    )
    assert plan.shape == (2, 8)
    assert out["hindsight_in_sample"]["forgetting"] == pytest.approx(
        run_metrics(r, budget, threshold)["forgetting"]
    )
    fresh = run_metrics(run(HINDSIGHT, 0, cfg, s, static_weights=plan, noise=1), budget, threshold)
    assert out["forgetting"][HINDSIGHT] == pytest.approx(fresh["forgetting"])
    assert out["worst_arm_accuracy"][HINDSIGHT] == pytest.approx(fresh["worst_arm_accuracy"])
    with pytest.raises(SystemExit):
        main([*args[:-1], "0"])
    assert "--hindsight-phases must be >= 1, got 0" in capsys.readouterr().err


def test_real_bench_pools_seeds_pairwise():
    from posttrain.bench.curriculum_real import _pool
    from posttrain.orchestrator.eval.evaluate import EvalReport, paired_delta

    ada = [EvalReport("a0", {"math": [1.0, 0.0]}), EvalReport("a1", {"math": [1.0, 1.0]})]
    uni = [EvalReport("u0", {"math": [0.0, 0.0]}), EvalReport("u1", {"math": [1.0, None]})]
    pooled = _pool(ada)
    assert pooled.per_task == {"math": [1.0, 0.0, 1.0, 1.0]}
    d = paired_delta(pooled, _pool(uni))
    # pairs (task, seed): 1-0, 0-0, 1-1; the infra failure (None) drops its pair
    assert d["n_tasks"] == 3 and d["delta"] == pytest.approx(1 / 3)


def _saved_result(path, seeds, ada, uni, **meta):
    """A --real result as main_real saves it, with per-task scores `ada`/`uni` (one list per seed)."""
    from posttrain.bench.curriculum_real import PRESETS, summarise

    def rows(scores):
        return [
            {
                "seed": s,
                "per_task": {"math": sc},
                "steps": 1,
                "generated_tokens": 10.0,
                "probe_tokens": 0.0,
                "probes": 0,
                "groups_by_arm": {},
                "train_s": 1.0,
            }
            for s, sc in zip(seeds, scores, strict=True)
        ]

    m = {
        "mode": "real",
        "model": "tiny:llama",
        "domains": "math:0",
        "sizes": PRESETS["quick"],
        "eval_seed": 7,
        "budget": "tokens",
        "rollouts_per_uniform_run": 4,
        "run_root": str(path.parent),
        **meta,
    }
    base = {"math": {"accuracy": 0.5, "ci_low": 0.0, "ci_high": 1.0, "n": 3}}
    out = summarise(
        m,
        {**base, "all": base["math"]},
        {"uniform_by_domain": rows(uni), "adaptive": rows(ada)},
        [10] * len(seeds),
    )
    path.write_text("a table first\n" + json.dumps(out))  # a --json capture: the object on the last line
    return out


def test_real_bench_pools_saved_results_of_separate_invocations(tmp_path, capsys):
    a = _saved_result(tmp_path / "a.json", [0], ada=[[1.0, 0.0, 1.0]], uni=[[0.0, 0.0, 1.0]])
    _saved_result(
        tmp_path / "b.json",
        [1, 2],
        ada=[[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]],
        uni=[[1.0, None, 0.0], [1.0, 0.0, 0.0]],
    )
    out = main(["--pool", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert out["seeds"] == [0, 1, 2] and out["token_budget_per_seed"] == [10, 10, 10]
    assert out["per_domain"]["adaptive"]["all"]["accuracy"] == pytest.approx(4 / 9)
    assert out["per_domain"]["uniform_by_domain"]["all"]["n"] == 8  # the None is an infra failure, not a 0
    d = out["delta_adaptive_minus_uniform"]
    assert d["0"]["delta"] == pytest.approx(1 / 3) and d["0"] == a["delta_adaptive_minus_uniform"]["0"]
    # pairs (task, seed): +1 0 0 | 0 . 0 | -1 0 0 -> 0 over 8 pairs
    assert d["pooled"]["n_tasks"] == 8 and d["pooled"]["delta"] == pytest.approx(0.0)
    assert "seeds pooled: adaptive - uniform: all +0.000" in capsys.readouterr().out


def test_real_bench_reads_results_saved_with_the_old_batch_names(tmp_path):
    """A result saved before the run config's batch section recorded tasks_per_step / group_size and may
    replay --run-set values with the old config keys: both read under today's names, so it pools with
    a new result of the same settings."""
    from posttrain.bench.curriculum_real import PRESETS, load_result

    old_sizes = {
        ("tasks_per_step" if k == "prompts_per_step" else "group_size" if k == "samples_per_prompt" else k): v
        for k, v in PRESETS["quick"].items()
    }
    _saved_result(
        tmp_path / "old.json",
        [0],
        ada=[[1.0]],
        uni=[[0.0]],
        sizes=old_sizes,
        run_overrides=["trainer.micro_batch_tokens=512", "trainer.lr=1e-5"],
    )
    _saved_result(
        tmp_path / "new.json",
        [1],
        ada=[[0.0]],
        uni=[[0.0]],
        run_overrides=["batch.micro_batch_tokens=512", "trainer.lr=1e-5"],
    )
    old = load_result(tmp_path / "old.json")
    assert old["sizes"] == PRESETS["quick"]
    assert old["run_overrides"] == ["batch.micro_batch_tokens=512", "trainer.lr=1e-5"]
    assert main(["--pool", str(tmp_path / "old.json"), str(tmp_path / "new.json")])["seeds"] == [0, 1]


def test_real_bench_pool_rejects_what_cannot_be_pooled(tmp_path, capsys):
    _saved_result(tmp_path / "a.json", [0], ada=[[1.0]], uni=[[0.0]])
    _saved_result(tmp_path / "b.json", [1], ada=[[1.0]], uni=[[0.0]], eval_seed=8)
    _saved_result(tmp_path / "c.json", [0], ada=[[0.0]], uni=[[0.0]])
    d = _saved_result(tmp_path / "d.json", [1], ada=[[1.0]], uni=[[0.0]])
    d["base"]["math"]["accuracy"] = 0.25
    (tmp_path / "d.json").write_text(json.dumps(d))
    (tmp_path / "sim.json").write_text(json.dumps({"seeds": 32, "forgetting": {}}))
    (tmp_path / "junk.txt").write_text("no json here")
    cases = [
        (["b.json"], "b.json differs from", "in 'eval_seed': 8 vs 7"),
        (["c.json"], "seed 0 is in both", "c.json"),
        (["d.json"], "d.json differs from", "in the base model's held-out scores"),
        (["sim.json"], "sim.json is not the result of `bench curriculum --real`", ""),
        (["junk.txt"], "junk.txt does not end with a JSON object", ""),
        (["missing.json"], "cannot read", "missing.json"),
    ]
    for extra, *needles in cases:
        with pytest.raises(SystemExit) as exc:
            main(["--pool", str(tmp_path / "a.json"), *[str(tmp_path / e) for e in extra]])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert all(n in err for n in needles), err


def test_reuse_uniform_rejects_flags_that_differ_from_the_saved_result(tmp_path, capsys):
    _saved_result(tmp_path / "a.json", [0], ada=[[1.0]], uni=[[0.0]], run_overrides=["engine.device=cpu"])
    cases = [
        (["--steps", "9"], "--steps 9 differs from the saved result's 4"),
        (["--eval-seed", "8"], "--eval-seed 8 differs from the saved result's 7"),
        (["--model", "smollm2-135m"], "--model 'smollm2-135m' differs from the saved result's 'tiny:llama'"),
        (["--seeds", "2"], "runs the saved result's seeds [0]; leave out --seeds and --seed-start"),
        (["--run-set", "engine.device=cuda"], "--run-set ['engine.device=cuda'] differs"),
    ]
    for flags, needle in cases:
        with pytest.raises(SystemExit) as exc:
            main(["--real", "--reuse-uniform", str(tmp_path / "a.json"), *flags])
        assert exc.value.code == 2
        assert needle in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--real", "--reuse-uniform", str(tmp_path / "missing.json")])
    assert exc.value.code == 2 and "--reuse-uniform: cannot read" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--reuse-uniform", str(tmp_path / "a.json")])
    assert exc.value.code == 2 and "--reuse-uniform needs --real" in capsys.readouterr().err


def test_pool_rejects_results_of_other_sampler_settings(tmp_path, capsys):
    _saved_result(tmp_path / "a.json", [0], ada=[[1.0]], uni=[[0.0]])  # saved before settings were recorded
    _saved_result(
        tmp_path / "b.json",
        [1],
        ada=[[1.0]],
        uni=[[0.0]],
        adaptive_overrides=[],
        uniform_overrides=[],
        quick=False,
        run_overrides=[],
    )
    _saved_result(tmp_path / "c.json", [2], ada=[[1.0]], uni=[[0.0]], adaptive_overrides=["cost_aware=false"])
    out = main(["--pool", str(tmp_path / "a.json"), str(tmp_path / "b.json")])  # absent = no --set: the same
    assert out["seeds"] == [0, 1] and out["adaptive_overrides"] == [] and out["run_overrides"] == []
    with pytest.raises(SystemExit) as exc:
        main(["--pool", str(tmp_path / "a.json"), str(tmp_path / "c.json")])
    assert exc.value.code == 2
    assert (
        "c.json differs from" in (err := capsys.readouterr().err)
        and "adaptive --set values: ['cost_aware=false'] vs []" in err
    )
    # the resolved config is what counts: the same --set values under other defaults do not pool
    on = CurriculumConfig(cost_aware=True, lam=6.0).model_dump(mode="json")
    off = CurriculumConfig(cost_aware=False, lam=3.0).model_dump(mode="json")
    _saved_result(tmp_path / "d.json", [3], ada=[[1.0]], uni=[[0.0]], adaptive_curriculum=on)
    _saved_result(tmp_path / "e.json", [4], ada=[[1.0]], uni=[[0.0]], adaptive_curriculum=off)
    # the same resolved config spelt as a --set value or taken from the defaults of its version pools
    _saved_result(
        tmp_path / "f.json",
        [5],
        ada=[[0.0]],
        uni=[[0.0]],
        adaptive_curriculum=on,
        adaptive_overrides=["cost_aware=true"],
    )
    assert main(["--pool", str(tmp_path / "d.json"), str(tmp_path / "f.json")])["seeds"] == [3, 5]
    for other, needle in (
        ("e.json", "curriculum config: cost_aware False vs True, lam 3.0 vs 6.0"),
        ("a.json", "a.json does not record it"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["--pool", str(tmp_path / "d.json"), str(tmp_path / other)])
        assert exc.value.code == 2 and needle in capsys.readouterr().err
    # --pool-any-config: the caller vouches for the adaptive settings; everything else is still checked
    out = main(
        [
            "--pool",
            str(tmp_path / "d.json"),
            str(tmp_path / "a.json"),
            str(tmp_path / "c.json"),
            "--pool-any-config",
        ]
    )
    assert out["seeds"] == [3, 0, 2] and out["adaptive_config_checked"] is False
    assert "settings were not compared across the results (--pool-any-config)" in capsys.readouterr().out
    assert "adaptive_config_checked" not in main(
        ["--pool", str(tmp_path / "d.json"), str(tmp_path / "f.json")]
    )
    _saved_result(tmp_path / "g.json", [6], ada=[[1.0]], uni=[[0.0]], eval_seed=8)
    _saved_result(tmp_path / "h.json", [7], ada=[[1.0]], uni=[[0.0]], uniform_overrides=["lam=1"])
    for other, needle in (
        ("g.json", "'eval_seed': 8 vs 7"),
        ("h.json", "uniform --set values: ['lam=1'] vs []"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["--pool", str(tmp_path / "a.json"), str(tmp_path / other), "--pool-any-config"])
        assert exc.value.code == 2 and needle in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--pool-any-config"])
    assert "--pool-any-config needs --pool" in capsys.readouterr().err


def test_committed_real_results_pool_to_the_documented_figures(tmp_path):
    """docs/results/curriculum-real holds the five paired seeds behind docs/curriculum.md section 2; pooling
    them must give the figures printed there (the bootstrap is seeded, so exactly those)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "docs" / "results" / "curriculum-real"
    pooled = {}
    for setting, (adaptive_all, delta, lo, hi) in {
        "groups_split": (0.403, +0.002, -0.020, +0.023),
        "cost_aware": (0.372, -0.029, -0.054, -0.005),
    }.items():
        out = main(["--pool", *(str(root / setting / f"seed{s}.json") for s in range(5))])
        assert out["seeds"] == [0, 1, 2, 3, 4]
        assert round(out["per_domain"]["uniform_by_domain"]["all"]["accuracy"], 3) == 0.401
        assert round(out["per_domain"]["adaptive"]["all"]["accuracy"], 3) == adaptive_all
        d = out["delta_adaptive_minus_uniform"]["pooled"]
        assert (round(d["delta"], 3), round(d["ci_low"], 3), round(d["ci_high"], 3)) == (delta, lo, hi)
        pooled[setting] = tmp_path / f"{setting}.json"
        pooled[setting].write_text(json.dumps(out))
    cmp = main(["--compare", str(pooled["groups_split"]), str(pooled["cost_aware"])])
    d = cmp["delta_a_minus_b"]["pooled"]
    assert (round(d["delta"], 3), round(d["ci_low"], 3), round(d["ci_high"], 3)) == (0.031, 0.009, 0.052)
    # seeds 5-6 (stop 16) record their resolved config, seeds 0-4 do not: pooled only on the caller's word
    seven = [
        *(str(root / "groups_split" / f"seed{s}.json") for s in range(5)),
        *(str(root / "default_stop16" / f"seed{s}.json") for s in (5, 6)),
    ]
    with pytest.raises(SystemExit):
        main(["--pool", *seven])
    d = main(["--pool", *seven, "--pool-any-config"])["delta_adaptive_minus_uniform"]
    assert (round(d["5"]["delta"], 3), round(d["6"]["delta"], 3)) == (-0.045, 0.039)
    assert (
        round(d["pooled"]["delta"], 3),
        round(d["pooled"]["ci_low"], 3),
        round(d["pooled"]["ci_high"], 3),
    ) == (0.0, -0.017, 0.017)
    # the stop 17 default (the same uniform runs): seeds 3-6 as reported at stop 17, then all seven seeds;
    # against uniform, and against the stops 15-16 rule
    for seeds, vs_uniform, vs_old in (
        ((3, 4, 5, 6), (0.014, -0.011, 0.038), (0.016, -0.006, 0.037)),
        (range(7), (0.004, -0.015, 0.023), (0.003, -0.013, 0.018)),
    ):
        new = main(["--pool", *(str(root / "default_stop17" / f"seed{s}.json") for s in seeds)])
        d = new["delta_adaptive_minus_uniform"]["pooled"]
        assert (round(d["delta"], 3), round(d["ci_low"], 3), round(d["ci_high"], 3)) == vs_uniform
        old = main(
            [
                "--pool",
                *(str(root / "groups_split" / f"seed{s}.json") for s in seeds if s < 5),
                *(str(root / "default_stop16" / f"seed{s}.json") for s in seeds if s >= 5),
                "--pool-any-config",
            ]
        )
        (tmp_path / "new.json").write_text(json.dumps(new))
        (tmp_path / "old.json").write_text(json.dumps(old))
        d = main(["--compare", str(tmp_path / "new.json"), str(tmp_path / "old.json")])["delta_a_minus_b"][
            "pooled"
        ]
        assert (round(d["delta"], 3), round(d["ci_low"], 3), round(d["ci_high"], 3)) == vs_old


def test_compare_pairs_the_adaptive_runs_of_two_results(tmp_path, capsys):
    uni = [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
    _saved_result(
        tmp_path / "a.json",
        [0, 1],
        ada=[[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]],
        uni=uni,
        adaptive_curriculum=CurriculumConfig(cost_aware=True).model_dump(mode="json"),
    )
    _saved_result(
        tmp_path / "b.json",
        [0, 1],
        ada=[[0.0, 0.0, None], [1.0, 1.0, 1.0]],
        uni=uni,
        adaptive_overrides=["cost_aware=false"],
        adaptive_curriculum=CurriculumConfig(cost_aware=False).model_dump(mode="json"),
    )
    out = main(["--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    d = out["delta_a_minus_b"]
    # seed 0: +1, 0 (the None drops its pair); seed 1: 0, 0, -1; pooled over the 5 pairs: 0
    assert d["0"]["delta"] == pytest.approx(0.5) and d["0"]["n_tasks"] == 2
    assert d["1"]["delta"] == pytest.approx(-1 / 3) and d["pooled"]["n_tasks"] == 5
    assert d["pooled"]["delta"] == pytest.approx(0.0)
    assert out["settings"]["b"]["adaptive_overrides"] == ["cost_aware=false"]
    assert out["config_differences"] == "cost_aware True vs False"
    assert out["accuracy"]["a"]["all"]["accuracy"] == pytest.approx(4 / 6)
    assert "seeds pooled: A - B: all +0.000" in capsys.readouterr().out

    _saved_result(tmp_path / "c.json", [0, 2], ada=[[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]], uni=uni)
    d = _saved_result(tmp_path / "d.json", [0, 1], ada=[[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]], uni=uni)
    d["token_budget_per_seed"] = [10, 11]
    (tmp_path / "d.json").write_text(json.dumps(d))
    for other, needle in (
        ("c.json", "differ in 'seeds': [0, 1] vs [0, 2]"),
        ("d.json", "differ in 'token_budget_per_seed': [10, 10] vs [10, 11]"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["--compare", str(tmp_path / "a.json"), str(tmp_path / other)])
        assert exc.value.code == 2 and needle in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "--compare",
                str(tmp_path / "a.json"),
                str(tmp_path / "b.json"),
                "--pool",
                str(tmp_path / "a.json"),
            ]
        )
    assert exc.value.code == 2 and "give one of them" in capsys.readouterr().err


def test_bench_real_stops_when_a_run_is_interrupted(tmp_path, monkeypatch):
    from posttrain.bench import curriculum_real as real
    from posttrain.orchestrator.rl import RLRun

    monkeypatch.setattr(RLRun, "train", lambda self: {"step": 1, "interrupted": True, "signal": 15})
    overrides = [
        "model.spec=tiny:llama",
        "envs.domains=[{name: math, difficulties: [0]}]",
        "telemetry.progress=false",
    ]
    with pytest.raises(SystemExit, match="interrupted by signal 15 during adaptive seed 3"):
        real.train_and_eval(overrides, "adaptive", 3, tmp_path, 2, 0)


def test_tune_returns_the_best_settings_it_scored_and_their_figures(capsys):
    from posttrain.bench.curriculum import TUNE_PENALTY, TUNED, _ratio, tune_search
    from posttrain.bench.sim import SimSettings, budget_tokens, make_learner, run

    cfg, s = CurriculumConfig(), SimSettings(groups_per_step=8, budget_uniform_steps=12)
    res = tune_search([0, 1], cfg, s, rounds=1, population=3, elite=1)
    assert list(res["settings"]) == list(TUNED)
    assert res["start"]["settings"] == {
        "tau": 0.5,
        "eps": 0.2,
        "eps_end": 0.3,
        "domain_mix": 0.3,
        "c": 0.4,
        "lam": 10.0,
        "weakness": 0.4,
    }  # the defaults it starts from
    assert res["objective"] <= res["start"]["objective"]
    for name, (lo, hi) in TUNED.items():
        assert lo <= res["settings"][name] <= hi
    # the reported figures are those of a plain run with the reported settings, and the objective is as stated
    tuned = cfg.model_copy(update=res["settings"])
    rows = []
    for seed in (0, 1):
        budget = budget_tokens(make_learner(seed), s)
        base = run("uniform_by_domain", seed, cfg, s)
        thr = float(base.p[-1].mean())
        base_m, m = run_metrics(base, budget, thr), run_metrics(run("adaptive", seed, tuned, s), budget, thr)
        sec_m = run_metrics(run("sec", seed, cfg, s), budget, thr)
        rows.append(
            (
                _ratio(m, budget, base_m),
                m["forgetting"],
                m["worst_arm_accuracy"],
                base_m["forgetting"],
                sec_m["forgetting"],
                base_m["worst_arm_accuracy"],
            )
        )
    r, f, w, fu, fs, wu = np.mean(rows, axis=0)
    assert res["in_sample"]["tokens_to_threshold_ratio"] == pytest.approx(r)
    assert res["in_sample"]["forgetting"] == pytest.approx(f)
    want = r + TUNE_PENALTY * (max(0.0, f - fu) + max(0.0, f - fs)) + max(0.0, wu - w)
    assert res["objective"] == pytest.approx(want)
    assert tune_search([0, 1], cfg, s, rounds=1, population=3, elite=1) == res  # deterministic
    # the CLI prints the settings as --set values; bad combinations exit 2 with a message
    out = main(["--tune", "1", "--seeds", "1", "--budget-steps", "8", "--groups-per-step", "8"])
    assert set(out["tune"]["settings"]) == set(TUNED) and "--set tau=" in capsys.readouterr().out
    for bad, msg in (
        (["--tune", "-1"], "--tune must be >= 0"),
        (["--tune", "1", "--hindsight", "1"], "leave out --hindsight"),
    ):
        with pytest.raises(SystemExit) as e:
            main(bad)
        assert e.value.code == 2 and msg in capsys.readouterr().err
