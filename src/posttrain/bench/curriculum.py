"""`posttrain bench curriculum`: every sampler against the simulated learner of `sim.py`, same token
budget (adaptive's probe tokens included), several seeds, bootstrap 95% intervals over seeds.

Owns the metrics and the table: final macro accuracy, AUC of macro accuracy vs tokens, tokens to reach
uniform_by_domain's final macro accuracy (per seed, as a ratio; a sampler that never gets there is
censored at the budget), worst-arm accuracy, forgetting (max over time minus final, per arm, averaged).
The `oracle` row reads the simulator's hidden p and eta (see `sim.OracleSampler`): how far an
allocation that knew the truth gets, so a missed target can be told apart from an unreachable one.
It allocates greedily; `oracle_plan` (`planning.PlanningOracle`, only when `--samplers` names it, ~2.5 s
a seed) reads the same state and plans to the end of the budget on the learner's expected dynamics.
The targets are printed twice: on the means over seeds (`targets`) and on
95% intervals (`targets_ci95`, `target_intervals`: met, missed, or a tie that these seeds cannot tell).
`--hindsight N` adds `hindsight_static`: per seed, the fixed mix of arms (`--hindsight-phases P`: a plan
of P mixes over the budget) that a cross-entropy search of N rounds finds best for that seed (fewest
tokens to the threshold, penalised for forgetting more or leaving the worst arm lower than uniform
does). The row scores the chosen mix on a fresh run of the same learner (other reward noise), so it
does not profit from the noise the search picked; the in-sample figures are in the JSON. It says
whether the targets are reachable by a mix or plan that knew the learner, not how a sampler would do.
`--tune N` runs no table: it searches the adaptive sampler's settings (`TUNED`) on the invocation's seeds
for the fewest tokens to threshold within the forgetting and worst-arm targets (`tune_search`), and prints
them as `--set` values to check on other seeds. The defaults came from such a search.
`--layout` picks the simulated arms (`sim.LAYOUTS` or a spec): a check of how the figures move with
what there is to gain, not a replacement for the default layout's.
`--real` (benchmark 2: a real model through the RL loop, adaptive vs uniform_by_domain, held-out
accuracy per domain) lives in `real.py`; its flags are listed under "--real" in `--help`. `--pool` reports
over the seeds of several saved `--real` results (separate invocations) without running anything.
"""

from __future__ import annotations

import time
from typing import Any, NoReturn

import numpy as np

from posttrain.bench import BenchUsageError
from posttrain.bench.curriculum_real import compare_results, main_real, pool_results
from posttrain.bench.planning import cross_entropy_min
from posttrain.bench.sim import (
    HINDSIGHT,
    ORACLE,
    ORACLE_PLAN,
    SimRun,
    SimSettings,
    budget_tokens,
    make_learner,
    parse_layout,
    run,
)
from posttrain.config import ConfigError, load_config
from posttrain.curriculum.arms import Arm

BASELINE = "uniform_by_domain"
ALL = ["uniform_by_domain", "uniform_by_data", "dapo_filter_only", "sec", "dump", "adaptive"]
REFERENCE = [ORACLE]  # reads the simulator's hidden state (greedy); a reference, not a competitor
ON_REQUEST = [ORACLE_PLAN]  # references that --samplers must name: oracle_plan adds ~80 s per 32 seeds


def first_crossing(tokens: np.ndarray, macro: np.ndarray, threshold: float) -> float:
    """Tokens spent when macro accuracy first reaches threshold; inf if it never does."""
    hit = np.flatnonzero(macro >= threshold - 1e-12)
    return float(tokens[hit[0]]) if len(hit) else float("inf")


def auc_vs_tokens(tokens: np.ndarray, macro: np.ndarray, budget: float) -> float:
    """Mean macro accuracy over [0, budget] of tokens (trapezoid; the curve is cut at the budget)."""
    grid_t = np.append(tokens[tokens < budget], budget)
    grid_m = np.interp(grid_t, tokens, macro)
    return float(np.sum((grid_t[1:] - grid_t[:-1]) * (grid_m[1:] + grid_m[:-1]) / 2.0) / budget)


def run_metrics(r: SimRun, budget: float, threshold: float, probes_charged: bool = True) -> dict[str, float]:
    macro = r.p.mean(axis=1)
    all_tokens = r.tokens[-1] + (0.0 if probes_charged else r.probe_tokens)
    return {
        "final_macro_accuracy": float(macro[-1]),
        "auc": auc_vs_tokens(r.tokens, macro, budget),
        "worst_arm_accuracy": float(r.p[-1].min()),
        "forgetting": float((r.p.max(axis=0) - r.p[-1]).mean()),
        "tokens_to_threshold": first_crossing(r.tokens, macro, threshold),
        "probe_token_share": float(r.probe_tokens / all_tokens),
    }


HINDSIGHT_PENALTY = 100.0  # budgets per unit of forgetting above, or worst-arm accuracy below, the limits


def baseline(seed: int, cfg: Any, settings: SimSettings) -> tuple[float, float, dict[str, float], SimRun]:
    """The seed's token budget, uniform_by_domain's run, its final macro accuracy (every sampler's
    threshold) and its metrics: (budget, threshold, metrics, run)."""
    budget = budget_tokens(make_learner(seed, settings.layout), settings)
    base = run(BASELINE, seed, cfg, settings)
    threshold = float(base.p[-1].mean())
    return budget, threshold, run_metrics(base, budget, threshold, settings.charge_probes), base


def hindsight_search(
    seed: int,
    cfg: Any,
    settings: SimSettings,
    budget: float,
    threshold: float,
    rounds: int,
    population: int = 24,
    elite: int = 6,
    limits: tuple[float, float] | None = None,
    phases: int = 1,
) -> tuple[np.ndarray, SimRun]:
    """Cross-entropy search over fixed arm weights (softmax of Gaussian logits) for the seed's learner;
    with phases = P > 1, over plans of P weight rows, one per P-th of the token budget.
    Objective: tokens to the threshold; a run that misses it scores budget * (1 + the macro gap), so
    nearer misses rank higher. With limits = (forgetting, worst-arm accuracy) (the bench passes
    uniform's), a run is also charged HINDSIGHT_PENALTY budgets per unit it forgets more or leaves its
    worst arm lower: the search then looks for the whole target, not speed alone.
    Returns the best weights (shape (arms,), or (phases, arms) when phases > 1) and their run.
    Deterministic per seed."""
    k = len(settings.layout)

    def weights(logits: np.ndarray) -> np.ndarray:
        w = np.exp(logits - logits.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        return w[0] if phases == 1 else w

    def score(logits: np.ndarray) -> float:
        m = run_metrics(
            run(HINDSIGHT, seed, cfg, settings, static_weights=weights(logits)),
            budget,
            threshold,
            settings.charge_probes,
        )
        t = m["tokens_to_threshold"]
        sc = t if np.isfinite(t) else budget * (1.0 + max(0.0, threshold - m["final_macro_accuracy"]))
        if limits is not None:
            excess = max(0.0, m["forgetting"] - limits[0]) + max(0.0, limits[1] - m["worst_arm_accuracy"])
            sc += HINDSIGHT_PENALTY * budget * excess
        return float(sc)

    rng = np.random.default_rng(30_000 + seed)
    _, x = cross_entropy_min(
        score, np.zeros((phases, k)), np.ones((phases, k)), rounds, population, elite, rng
    )
    w = weights(x)
    return w, run(HINDSIGHT, seed, cfg, settings, static_weights=w)  # runs are deterministic: the run scored


# --tune: the adaptive settings searched, with their bounds; tau is searched on a log scale
TUNED: dict[str, tuple[float, float]] = {
    "tau": (0.05, 3.0),
    "eps": (0.0, 0.6),
    "eps_end": (0.0, 0.6),
    "domain_mix": (0.0, 1.0),
    "c": (0.0, 3.0),
    "lam": (0.0, 15.0),
    "weakness": (0.0, 1.5),
}
TUNE_PENALTY = 40.0  # tokens-to-threshold ratio per unit of forgetting above uniform's or sec's


def tune_search(
    seeds: list[int],
    cfg: Any,
    settings: SimSettings,
    rounds: int,
    population: int = 20,
    elite: int = 5,
) -> dict[str, Any]:
    """Cross-entropy search over the adaptive sampler's TUNED settings (the others as in cfg) on these
    seeds. Objective, from the seeds' means: adaptive's tokens-to-threshold ratio, plus TUNE_PENALTY per
    unit of forgetting above uniform_by_domain's and above sec's, plus the worst-arm accuracy it leaves
    below uniform's: the benchmark's targets, with the ratio minimised and the rest as limits. Starts from
    cfg's values. Returns the best settings (rounded to 3 digits, as scored) and their in-sample
    figures; an out-of-sample check is a plain bench run with them (`--set`) on other seeds."""
    names = list(TUNED)
    ref = {}
    for seed in seeds:
        budget, threshold, base_m, _ = baseline(seed, cfg, settings)
        sec_m = run_metrics(run("sec", seed, cfg, settings), budget, threshold, settings.charge_probes)
        ref[seed] = (budget, threshold, base_m, sec_m)

    def settings_of(x: np.ndarray) -> dict[str, float]:
        return {n: round(float(np.exp(v) if n == "tau" else v), 3) for n, v in zip(names, x, strict=True)}

    def figures(st: dict[str, float]) -> dict[str, float]:
        c = cfg.model_copy(update={**st, "sampler": "adaptive"})
        rows = []
        for seed in seeds:
            budget, threshold, base_m, sec_m = ref[seed]
            m = run_metrics(run("adaptive", seed, c, settings), budget, threshold, settings.charge_probes)
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
        keys = [
            "tokens_to_threshold_ratio",
            "forgetting",
            "worst_arm_accuracy",
            "uniform_forgetting",
            "sec_forgetting",
            "uniform_worst_arm_accuracy",
        ]
        return dict(zip(keys, map(float, np.mean(rows, axis=0)), strict=True))

    def objective(f: dict[str, float]) -> float:
        return (
            f["tokens_to_threshold_ratio"]
            + TUNE_PENALTY * max(0.0, f["forgetting"] - f["uniform_forgetting"])
            + TUNE_PENALTY * max(0.0, f["forgetting"] - f["sec_forgetting"])
            + max(0.0, f["uniform_worst_arm_accuracy"] - f["worst_arm_accuracy"])
        )

    lo = np.array([np.log(TUNED[n][0]) if n == "tau" else TUNED[n][0] for n in names])
    hi = np.array([np.log(TUNED[n][1]) if n == "tau" else TUNED[n][1] for n in names])
    start_x = np.clip(
        [
            np.log(cfg.tau) if n == "tau" else (cfg.eps if getattr(cfg, n) is None else getattr(cfg, n))
            for n in names
        ],
        lo,
        hi,
    )
    start = settings_of(start_x)
    start_f = figures(start)
    found, x = cross_entropy_min(
        lambda x: objective(figures(settings_of(x))),
        start_x,
        (hi - lo) / 4,
        rounds,
        population,
        elite,
        np.random.default_rng(40_000 + seeds[0]),
        sd_floor=(hi - lo) / 100,
        bounds=(lo, hi),
    )
    best = start if objective(start_f) <= found else settings_of(x)  # nothing better than the start: keep it
    best_f = (
        start_f if best is start else figures(best)
    )  # runs are deterministic: the figures it was scored on
    return {
        "settings": best,
        "objective": objective(best_f),
        "in_sample": best_f,
        "start": {"settings": start, "objective": objective(start_f), "in_sample": start_f},
        "seeds": seeds,
        "rounds": rounds,
        "population": population,
    }


def _ratio(m: dict[str, float], budget: float, base_m: dict[str, float]) -> float:
    """Tokens to the threshold as a multiple of uniform's; a run that never got there is censored at the
    budget (a lower bound on its ratio)."""
    t = m["tokens_to_threshold"]
    return (t if np.isfinite(t) else budget) / base_m["tokens_to_threshold"]


def bootstrap_ci(values: np.ndarray, n_boot: int, seed: int = 0) -> tuple[float, float]:
    """Percentile 95% interval of the mean over seeds."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) < 2:
        return float(values.mean()), float(values.mean())
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(n_boot, len(values)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def _usage(message: str) -> NoReturn:
    raise BenchUsageError(message)


def main(ns: Any) -> dict[str, Any]:
    """Run the benchmark with the options of `posttrain bench curriculum` (see its --help); a bad
    combination raises BenchUsageError."""
    if ns.samplers is None:
        ns.samplers = ",".join(ALL + REFERENCE)
    if ns.groups_per_step is None:
        ns.groups_per_step = SimSettings.groups_per_step
    if ns.budget_steps is None:
        ns.budget_steps = SimSettings.budget_uniform_steps
    if ns.seed_start < 0:
        _usage(f"--seed-start must be >= 0, got {ns.seed_start}")
    if ns.pool and ns.compare:
        _usage("--pool and --compare each report on saved results; give one of them")
    if ns.pool_any_config and not ns.pool:
        _usage("--pool-any-config needs --pool")
    if ns.pool or ns.compare:
        try:
            return pool_results(ns.pool, not ns.pool_any_config) if ns.pool else compare_results(*ns.compare)
        except ValueError as err:
            raise BenchUsageError(str(err)) from None
    if ns.reuse_uniform and not ns.real:
        _usage("--reuse-uniform needs --real")
    if ns.real:
        if ns.seeds is not None and ns.seeds < 1:
            _usage("--seeds must be >= 1")
        try:
            return main_real(ns)
        except (ConfigError, ValueError) as err:
            raise BenchUsageError(str(err)) from None
    ns.seeds = 32 if ns.seeds is None else ns.seeds
    names = [n.strip() for n in ns.samplers.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL + REFERENCE + ON_REQUEST]
    if unknown or BASELINE not in names:
        _usage(f"--samplers: unknown {unknown}" if unknown else f"--samplers must include {BASELINE}")
    if ns.seeds < 1 or ns.groups_per_step < 1 or ns.budget_steps < 1:
        _usage("--seeds, --groups-per-step and --budget-steps must be >= 1")
    if ns.hindsight < 0:
        _usage(f"--hindsight must be >= 0 rounds, got {ns.hindsight}")
    if ns.hindsight_phases < 1:
        _usage(f"--hindsight-phases must be >= 1, got {ns.hindsight_phases}")
    if ns.tune < 0:
        _usage(f"--tune must be >= 0 rounds, got {ns.tune}")
    if ns.tune and ns.hindsight:
        _usage("--tune runs no table; leave out --hindsight")
    if ns.hindsight:
        names.append(HINDSIGHT)
    names = [BASELINE] + [n for n in names if n != BASELINE]

    try:
        cfg = load_config(None, [f"curriculum.{o}" for o in ns.overrides]).curriculum
    except ConfigError as err:
        _usage(str(err))
    try:
        layout = parse_layout(ns.layout)
    except ValueError as err:
        _usage(f"--layout: {err}")
    settings = SimSettings(
        groups_per_step=ns.groups_per_step,
        budget_uniform_steps=ns.budget_steps,
        charge_probes=not ns.free_probes,
        layout=layout,
    )
    t0 = time.perf_counter()
    if ns.tune:
        return _report_tune(
            tune_search(list(range(ns.seed_start, ns.seed_start + ns.seeds)), cfg, settings, ns.tune),
            ns,
            time.perf_counter() - t0,
        )
    per: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    arm_final: dict[str, list[np.ndarray]] = {n: [] for n in names}  # per seed, each arm's final p
    arm_forget: dict[str, list[np.ndarray]] = {n: [] for n in names}
    hindsight_w: list[np.ndarray] = []
    hindsight_in: dict[str, list[float]] = {
        "tokens_to_threshold_ratio": [],
        "forgetting": [],
        "worst_arm_accuracy": [],
    }
    for seed in range(ns.seed_start, ns.seed_start + ns.seeds):
        budget, threshold, base_m, base = baseline(seed, cfg, settings)
        for name in names:
            if name == BASELINE:
                m, r = base_m, base
            elif name == HINDSIGHT:
                limits = (base_m["forgetting"], base_m["worst_arm_accuracy"])
                weights, r = hindsight_search(
                    seed,
                    cfg,
                    settings,
                    budget,
                    threshold,
                    ns.hindsight,
                    limits=limits,
                    phases=ns.hindsight_phases,
                )
                hindsight_w.append(weights)
                in_sample = run_metrics(r, budget, threshold, settings.charge_probes)
                for k in ("forgetting", "worst_arm_accuracy"):
                    hindsight_in[k].append(in_sample[k])
                hindsight_in["tokens_to_threshold_ratio"].append(_ratio(in_sample, budget, base_m))
                r = run(HINDSIGHT, seed, cfg, settings, static_weights=weights, noise=1)  # a fresh run
                m = run_metrics(r, budget, threshold, settings.charge_probes)
            else:
                plot_this = ns.plot is not None and seed == ns.seed_start and name == "adaptive"
                r = run(name, seed, cfg, settings, log_weights=plot_this)
                m = run_metrics(r, budget, threshold, settings.charge_probes)
                if plot_this:
                    from posttrain.bench.plot import plot_domain_shares

                    plot_domain_shares(r.weight_rows, ns.plot)
            m["tokens_to_threshold_ratio"] = _ratio(m, budget, base_m)
            m["reached_threshold"] = float(np.isfinite(m["tokens_to_threshold"]))
            for k, v in m.items():
                per[name].setdefault(k, []).append(v)
            arm_final[name].append(r.p[-1])
            arm_forget[name].append(r.p.max(axis=0) - r.p[-1])
    wall_s = time.perf_counter() - t0

    metrics = [
        "tokens_to_threshold_ratio",
        "final_macro_accuracy",
        "auc",
        "worst_arm_accuracy",
        "forgetting",
        "reached_threshold",
        "probe_token_share",
    ]
    out: dict[str, Any] = {
        "seeds": ns.seeds,
        "seed_start": ns.seed_start,
        "baseline": BASELINE,
        "wall_s": round(wall_s, 2),
        "overrides": ns.overrides,
        "probe_tokens_charged": not ns.free_probes,
        "layout": ns.layout.strip(),
    }
    for k in metrics:
        out[k] = {n: float(np.mean(per[n][k])) for n in names}
        if k not in ("reached_threshold", "probe_token_share"):
            out[k + "_ci95"] = {n: bootstrap_ci(np.array(per[n][k]), ns.boot) for n in names}
    # paired differences against uniform (same learner per seed), for the no-worse-than claims
    for k in ("worst_arm_accuracy", "forgetting"):
        out[k + "_diff_vs_uniform_ci95"] = {
            n: bootstrap_ci(np.array(per[n][k]) - np.array(per[BASELINE][k]), ns.boot)
            for n in names
            if n != BASELINE
        }
    arm_keys = [Arm(domain, level).key for domain, level, _ in layout]
    out.update(per_arm_figures(arm_final, arm_forget, arm_keys, ns.boot))
    if hindsight_w:  # mean over seeds; one mapping per phase when the plan has phases
        mean_w = np.mean([np.atleast_2d(w) for w in hindsight_w], axis=0)
        rows = [dict(zip(arm_keys, map(float, row), strict=True)) for row in mean_w]
        out["hindsight_phases"] = ns.hindsight_phases
        out["hindsight_in_sample"] = {k: float(np.mean(v)) for k, v in hindsight_in.items()}
        out["hindsight_weights"] = rows[0] if ns.hindsight_phases == 1 else rows
    if "adaptive" in names:
        a = "adaptive"
        # paired over seeds (same learner): is adaptive's forgetting below sec's and dump's beyond noise?
        out["adaptive_forgetting_minus_ci95"] = {
            b: bootstrap_ci(np.array(per[a]["forgetting"]) - np.array(per[b]["forgetting"]), ns.boot)
            for b in ("sec", "dump")
            if b in names
        }
        out["targets"] = {
            "tokens_to_threshold_ratio<=0.75": out["tokens_to_threshold_ratio"][a] <= 0.75,
            "worst_arm_not_worse_than_uniform": out["worst_arm_accuracy"][a]
            >= out["worst_arm_accuracy"][BASELINE],
            "forgetting_not_worse_than_uniform": out["forgetting"][a] <= out["forgetting"][BASELINE],
            **{
                f"forgetting_better_than_{b}": out["forgetting"][a] < out["forgetting"][b]
                for b in ("sec", "dump")
                if b in names
            },
        }
        out["targets_ci95"] = target_intervals(out)
    _print_table(out, names)
    return out


TARGET_LIMIT = 0.75  # the tokens-to-threshold target, as a ratio to uniform_by_domain


def target_intervals(out: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each target of `out["targets"]` read from a 95% bootstrap interval instead of the point estimate:
    the interval of adaptive's ratio against 0.75, and the paired intervals (same learner per seed) of
    adaptive minus uniform for the worst arm and forgetting, and of adaptive's forgetting minus sec's
    and dump's against 0. `verdict`: "met" when the whole interval is on the target's side, "missed" when
    the whole interval is on the other, "tie" when it holds the limit (the seeds cannot tell)."""

    def verdict(lo: float, hi: float, limit: float, good_below: bool) -> str:
        if (hi < limit) if good_below else (lo > limit):
            return "met"
        if (lo > limit) if good_below else (hi < limit):
            return "missed"
        return "tie"

    a = "adaptive"
    rows: dict[str, tuple[str, list[float], float, bool]] = {
        "tokens_to_threshold_ratio<=0.75": (
            "adaptive's ratio",
            out["tokens_to_threshold_ratio_ci95"][a],
            TARGET_LIMIT,
            True,
        ),
        "worst_arm_not_worse_than_uniform": (
            "adaptive - uniform",
            out["worst_arm_accuracy_diff_vs_uniform_ci95"][a],
            0.0,
            False,
        ),
        "forgetting_not_worse_than_uniform": (
            "adaptive - uniform",
            out["forgetting_diff_vs_uniform_ci95"][a],
            0.0,
            True,
        ),
        **{
            f"forgetting_better_than_{b}": (f"adaptive - {b}", ci, 0.0, True)
            for b, ci in out["adaptive_forgetting_minus_ci95"].items()
        },
    }
    return {
        k: {
            "of": of,
            "interval": [float(lo), float(hi)],
            "limit": limit,
            "verdict": verdict(lo, hi, limit, below),
        }
        for k, (of, (lo, hi), limit, below) in rows.items()
    }


def _report_tune(res: dict[str, Any], ns: Any, wall_s: float) -> dict[str, Any]:
    from rich.console import Console

    console = Console()
    seeds = res["seeds"]
    console.print(
        f"curriculum --tune: {res['rounds']} rounds x {res['population']} candidates on seeds "
        f"{seeds[0]}-{seeds[-1]} (layout {ns.layout.strip()}); objective = ratio + {TUNE_PENALTY:g} x forgetting "
        "above uniform's and above sec's + worst-arm shortfall below uniform's"
    )
    for label, st, f, obj in (
        ("start", res["start"]["settings"], res["start"]["in_sample"], res["start"]["objective"]),
        ("best", res["settings"], res["in_sample"], res["objective"]),
    ):
        console.print(
            f"  {label}: objective {obj:.4f}, tokens to threshold {f['tokens_to_threshold_ratio']:.3f}x, "
            f"forgetting {f['forgetting']:.4f} (uniform {f['uniform_forgetting']:.4f}, sec {f['sec_forgetting']:.4f}), "
            f"worst arm {f['worst_arm_accuracy']:.3f} (uniform {f['uniform_worst_arm_accuracy']:.3f})"
        )
        console.print("    " + " ".join(f"--set {k}={v:g}" for k, v in st.items()))
    console.print(
        f"  in-sample figures: check them on other seeds, e.g. --seed-start 400 --seeds 64 (wall {wall_s:.0f} s)"
    )
    return {"tune": res, "layout": ns.layout.strip(), "overrides": ns.overrides, "wall_s": round(wall_s, 2)}


def per_arm_figures(
    final: dict[str, list[np.ndarray]], forget: dict[str, list[np.ndarray]], arm_keys: list[str], n_boot: int
) -> dict[str, Any]:
    """Where each sampler ends and forgets, arm by arm (means over seeds), and `largest_shortfall_vs_uniform`:
    per seed, the most any arm's final accuracy falls below uniform's on the same learner (0 when none
    does), averaged over seeds with a bootstrap interval. Forgetting (peak minus final) charges an arm a
    sampler raised above uniform's level and then practised less, even when it ends higher than uniform's;
    the shortfall reads only where arms end."""
    base = np.array(final[BASELINE])
    out: dict[str, Any] = {
        "per_arm": {},
        "largest_shortfall_vs_uniform": {},
        "largest_shortfall_vs_uniform_ci95": {},
    }
    for n in final:
        fin = np.array(final[n])
        columns = zip(fin.mean(axis=0), np.mean(forget[n], axis=0), (fin - base).mean(axis=0), strict=True)
        out["per_arm"][n] = {
            k: {"final": float(f), "forgetting": float(g), "final_minus_uniform": float(d)}
            for k, (f, g, d) in zip(arm_keys, columns, strict=True)
        }
        if n != BASELINE:
            shortfall = np.maximum(0.0, (base - fin).max(axis=1))
            out["largest_shortfall_vs_uniform"][n] = float(shortfall.mean())
            out["largest_shortfall_vs_uniform_ci95"][n] = bootstrap_ci(shortfall, n_boot)
    return out


def _print_table(out: dict[str, Any], names: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"curriculum simulation ({out['layout']} layout): {out['seeds']} seeds from {out['seed_start']}, "
        "same token budget, mean [95% bootstrap CI]"
    )
    cols = [
        ("tokens_to_threshold_ratio", "tokens to uniform's final (x uniform)"),
        ("final_macro_accuracy", "final macro"),
        ("auc", "AUC vs tokens"),
        ("worst_arm_accuracy", "worst arm"),
        ("forgetting", "forgetting"),
    ]
    t.add_column("sampler")
    for _, title in cols:
        t.add_column(title, justify="right")
    t.add_column("reached", justify="right")
    t.add_column("probe tokens", justify="right")
    for n in names:
        cells = []
        for k, _ in cols:
            lo, hi = out[k + "_ci95"][n]
            cells.append(f"{out[k][n]:.3f} [{lo:.3f}, {hi:.3f}]")
        t.add_row(n, *cells, f"{out['reached_threshold'][n]:.0%}", f"{out['probe_token_share'][n]:.1%}")
    console = Console(width=170)
    console.print(t)
    shown = [n for n in names if n in (BASELINE, "adaptive", "sec", "dump")]
    arms = Table(title="per arm, mean over seeds: final accuracy / forgetting (peak - final)")
    arms.add_column("arm")
    for n in shown:
        arms.add_column(n, justify="right")
    for k in out["per_arm"][BASELINE]:
        arms.add_row(
            k,
            *[
                f"{out['per_arm'][n][k]['final']:.3f} / {out['per_arm'][n][k]['forgetting']:.4f}"
                for n in shown
            ],
        )
    arms.add_row(
        "largest shortfall vs uniform",
        "",
        *[f"{out['largest_shortfall_vs_uniform'][n]:.3f}" for n in shown[1:]],
    )
    console.print(arms)
    if "targets" in out:
        console.print("  targets: on the means over seeds; on the 95% intervals")
        for k, v in out["targets"].items():
            t = out["targets_ci95"][k]
            lo, hi = t["interval"]
            sign = "+" if t["limit"] == 0 else ""
            console.print(
                f"  {'met' if v else 'NOT met':>7}: {k}; interval of {t['of']} [{lo:{sign}.4f}, {hi:{sign}.4f}] "
                f"against {t['limit']:g}: {t['verdict']}"
            )
    console.print(f"  wall {out['wall_s']} s (shared 2-core machine)")
