"""`posttrain bench curriculum --real` (benchmark 2): the adaptive sampler against uniform_by_domain on a
real model through the RL loop, same token budget, then held-out accuracy per domain with intervals.

Owns the run matrix (samplers x seeds), the shared configuration and the report. Training is
`posttrain.orchestrator.rl.RLRun`, scoring is `posttrain.orchestrator.eval.evaluate.evaluate_local`;
nothing here touches tensors. The budget is tokens, as in the simulation: per seed, uniform_by_domain runs
`steps` steps, and the adaptive run gets `orchestrator.token_budget` = the tokens uniform generated, with
its own retention probes charged against it (steps capped at MAX_STEPS_FACTOR x steps). `--budget rollouts`
gives both samplers the same steps instead (then the adaptive probes are extra).
`--reuse-uniform RESULT` runs only the adaptive sampler, against the uniform runs of a saved result (same
seeds, budgets, sizes and held-out tasks): the way to compare a second adaptive setting (`--set KEY=VALUE`)
without training uniform again.
`--layout many` trains 25 arms instead of the 3-domain default: reasoning-gym families at several levels
(one `math` entry with its `levels` option: arms the model is meant to solve often, sometimes, never),
code.unit_tests 0-2 and tools.apis 0-3, scored per arm, with the tokens of zero-advantage groups and the
retention figures (when `--run-set curriculum.retention=...` sets suites) per run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

SAMPLERS = ["uniform_by_domain", "adaptive"]  # uniform first: its tokens set the adaptive run's budget
MAX_STEPS_FACTOR = 3  # an adaptive run under a token budget may take up to this many times uniform's steps
DEFAULT_DOMAINS = "math:0,1;code.unit_tests:1;tools.apis:0"
LAYOUTS = ("default", "many")
MANY_DOMAINS = (
    "layout many"  # the `domains` a --layout many result records (its arms are MANY_MATH_LEVELS + MANY_OTHER)
)
_ARITH = {"allow_parentheses": False, "allow_negation": False}
# --layout many: the math domain's levels, in order (arm math:i = entry i), each with the share of its tasks
# the embedded 135M model is expected to solve ("often", "sometimes", "never"): a guess from the task's size,
# not a measurement; the benchmark's base-model row measures it. Ranges within a family do not overlap, so
# two arms never hold the same question; within an arm a small space repeats (math:0 has 200 questions, about
# 40 of them held out).
MANY_MATH_LEVELS: list[tuple[str, dict[str, dict[str, Any]]]] = [
    (
        "often",
        {
            "basic_arithmetic": {
                "min_terms": 2,
                "max_terms": 2,
                "min_digits": 1,
                "max_digits": 1,
                "operators": ["+", "-"],
                **_ARITH,
            }
        },
    ),
    (
        "sometimes",
        {
            "basic_arithmetic": {
                "min_terms": 2,
                "max_terms": 2,
                "min_digits": 2,
                "max_digits": 2,
                "operators": ["+", "-"],
                **_ARITH,
            }
        },
    ),
    (
        "never",
        {
            "basic_arithmetic": {
                "min_terms": 3,
                "max_terms": 3,
                "min_digits": 3,
                "max_digits": 3,
                "operators": ["+", "-", "*"],
                **_ARITH,
            }
        },
    ),
    ("sometimes", {"chain_sum": {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1}}),
    ("never", {"chain_sum": {"min_terms": 5, "max_terms": 5, "min_digits": 2, "max_digits": 2}}),
    ("often", {"letter_counting": {"min_words": 1, "max_words": 2}}),
    ("sometimes", {"letter_counting": {"min_words": 6, "max_words": 10}}),
    ("sometimes", {"spell_backward": {"min_word_len": 3, "max_word_len": 3}}),
    ("never", {"spell_backward": {"min_word_len": 8, "max_word_len": 10}}),
    ("often", {"gcd": {"min_value": 1, "max_value": 20}}),
    ("never", {"gcd": {"min_value": 100, "max_value": 1000}}),
    (
        "often",
        {
            "number_sorting": {
                "min_numbers": 3,
                "max_numbers": 3,
                "min_decimals": 0,
                "max_decimals": 0,
                "min_value": 0,
                "max_value": 9,
            }
        },
    ),
    ("never", {"number_sorting": {"min_numbers": 8, "max_numbers": 8}}),
    ("sometimes", {"leg_counting": {"min_animals": 1, "max_animals": 1, "max_instances": 2}}),
    ("never", {"count_bits": {}}),
    ("never", {"arc_1d": {}}),
    ("never", {"knights_knaves": {}}),
    ("never", {"mini_sudoku": {}}),
]
MANY_OTHER = "code.unit_tests:0,1,2;tools.apis:0,1,2,3"
# Sizes of the full run and of --quick (a few minutes). Explicit flags override either preset. Measured on
# 2 bf16-capable CPU cores with the default domains: 24 steps at 96 new tokens took 18 min per uniform run
# (code and tool prompts are long), so the full preset takes about 40 min per run.
PRESETS: dict[str, dict[str, int]] = {
    "full": {
        "steps": 40,
        "prompts_per_step": 4,
        "samples_per_prompt": 8,
        "n_eval": 32,
        "max_new_tokens": 128,
        "probe_every": 5,
        "probe_size": 16,
    },
    "quick": {
        "steps": 4,
        "prompts_per_step": 4,
        "samples_per_prompt": 4,
        "n_eval": 8,
        "max_new_tokens": 64,
        "probe_every": 2,
        "probe_size": 2,
    },
}
# --quick also keeps memory small (the machine it targets is shared): a smaller K/V pool, shorter
# micro-batches. Explicit --run-set values come later and win.
QUICK_RUN_OVERRIDES = ["engine.num_kv_blocks=512", "batch.micro_batch_tokens=1024"]
RESULT_FILE = "result.json"  # the JSON object, also written into the run root (what --pool reads)
# The flags a run takes from a --reuse-uniform result (their argparse default is None so that a flag given
# on the command line can be told from a default), with the defaults of a run that reuses nothing.
REUSED_FLAGS: dict[str, Any] = {
    "model": "smollm2-135m",
    "domains": DEFAULT_DOMAINS,
    "eval_seed": 1000,
    "budget": "tokens",
}
# the sizes' names in results saved before the run config's batch section existed
OLD_SIZE_NAMES = {"tasks_per_step": "prompts_per_step", "group_size": "samples_per_prompt"}


def parse_domains(text: str) -> list[tuple[str, list[int]]]:
    """`"math:0,1;tools.apis:0"` -> [("math", [0, 1]), ("tools.apis", [0])]; ValueError names a bad part."""
    out: list[tuple[str, list[int]]] = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        name, sep, levels = part.partition(":")
        if not sep or not name.strip() or not levels.strip():
            raise ValueError(f"--domains part '{part}' is not of the form name:level[,level...]")
        try:
            lv = [int(x) for x in levels.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--domains part '{part}': levels must be integers") from None
        out.append((name.strip(), lv))
    if not out:
        raise ValueError("--domains names no domain")
    return out


def domain_entries(layout: str, domains: str) -> list[dict[str, Any]]:
    """The `envs.domains` entries of a layout: "default" -> the `--domains` spec, "many" -> one math entry
    whose `levels` are MANY_MATH_LEVELS, then MANY_OTHER. ValueError names an unknown layout."""
    if layout not in LAYOUTS:
        raise ValueError(f"--real --layout: unknown layout '{layout}' (valid: {', '.join(LAYOUTS)})")
    spec = MANY_OTHER if layout == "many" else domains
    entries = [{"name": n, "difficulties": lv} for n, lv in parse_domains(spec)]
    if layout == "many":
        math = {
            "name": "math",
            "difficulties": list(range(len(MANY_MATH_LEVELS))),
            "options": {"levels": [entry for _, entry in MANY_MATH_LEVELS]},
        }
        entries.insert(0, math)
    return entries


def layout_arms(layout: str) -> dict[str, str]:
    """Arm key -> what the arm is, for the report: a math level's family, config and expected mastery."""
    if layout != "many":
        return {}
    out = {}
    for i, (role, entry) in enumerate(MANY_MATH_LEVELS):
        ((name, cfg),) = entry.items()
        out[f"math:{i}"] = f"{name} {json.dumps(cfg, sort_keys=True)} (expected: {role})"
    for n, levels in parse_domains(MANY_OTHER):
        out.update({f"{n}:{lv}": f"{n} level {lv}" for lv in levels})
    return out


def run_overrides(ns: argparse.Namespace, sizes: dict[str, int]) -> list[str]:
    """Config overrides shared by every run of the matrix (the sampler and seed are added per run)."""
    doms = json.dumps(domain_entries(getattr(ns, "layout", "default"), ns.domains))
    return [
        f"model.spec={ns.model}",
        f"envs.domains={doms}",
        f"orchestrator.steps={sizes['steps']}",
        f"batch.prompts_per_step={sizes['prompts_per_step']}",
        f"batch.samples_per_prompt={sizes['samples_per_prompt']}",
        f"engine.max_new_tokens={sizes['max_new_tokens']}",
        f"curriculum.probe_every={sizes['probe_every']}",
        f"curriculum.probe_size={sizes['probe_size']}",
        "orchestrator.checkpoint_every=0",
        "telemetry.progress=false",
        "telemetry.tensorboard=false",
        *(QUICK_RUN_OVERRIDES if ns.quick else []),
        *[f"curriculum.{o}" for o in ns.overrides],
        *ns.run_overrides,
    ]


def macro_accuracy(
    per_task: dict[str, list[float | None]], seed: int, n_boot: int = 1000
) -> dict[str, float]:
    """The mean over arms of each arm's held-out accuracy, with a 95% interval from a bootstrap that
    resamples tasks within each arm (every arm weighs the same, however many tasks it scored)."""
    arms = [np.array([s for s in v if s is not None], dtype=np.float64) for v in per_task.values()]
    arms = [a for a in arms if len(a)]
    if not arms:
        return {"accuracy": float("nan"), "ci_low": float("nan"), "ci_high": float("nan"), "arms": 0}
    rng = np.random.default_rng(seed)
    boots = np.mean([a[rng.integers(0, len(a), size=(n_boot, len(a)))].mean(axis=1) for a in arms], axis=0)
    return {
        "accuracy": float(np.mean([a.mean() for a in arms])),
        "ci_low": float(np.percentile(boots, 2.5)),
        "ci_high": float(np.percentile(boots, 97.5)),
        "arms": len(arms),
    }


def _pooled(scores: list[float | None], seed: int) -> dict[str, float]:
    from posttrain.orchestrator.eval.evaluate import bootstrap_ci

    vals = np.array([s for s in scores if s is not None], dtype=np.float64)
    lo, hi = bootstrap_ci(vals, seed)
    return {
        "accuracy": float(vals.mean()) if len(vals) else float("nan"),
        "ci_low": lo,
        "ci_high": hi,
        "n": len(vals),
    }


def train_and_eval(
    overrides: list[str],
    sampler: str,
    seed: int,
    root: Path,
    n_eval: int,
    eval_seed: int,
    keep_checkpoints: bool = False,
    by_arm: bool = False,
) -> dict[str, Any]:
    """One RL run with `sampler`, its policy exported and scored on the held-out tasks of `eval_seed`
    (per domain, or per arm with `by_arm`). The run's checkpoints (learner and optimizer, ~2 GB for 135M)
    are deleted unless keep_checkpoints; the exported `policy/` folder, config and metrics stay. Also
    returns the rollout tokens of zero-advantage groups and the last scored retention figures (if any)."""
    from posttrain.config import load_config, save_config
    from posttrain.orchestrator.eval.evaluate import evaluate_local
    from posttrain.orchestrator.eval.export import save_hf_folder
    from posttrain.orchestrator.rl import RLRun
    from posttrain.sandbox import make_sandbox
    from posttrain.telemetry import RunDir, read_metrics

    cfg = load_config(
        None, [*overrides, f"curriculum.sampler={sampler}", f"seed={seed}", f"telemetry.run_dir={root}"]
    )
    run_dir = RunDir.create(root, f"{sampler}-seed{seed}")
    save_config(cfg, run_dir.config)
    t0 = time.perf_counter()
    rl = RLRun(cfg, run_dir, show_progress=False)
    try:
        summary = rl.train()
        if summary["interrupted"]:  # the run checkpointed on SIGINT/SIGTERM; the matrix stops with it
            raise SystemExit(
                f"bench curriculum --real: interrupted by signal {summary['signal']} during {sampler} "
                f"seed {seed}; its checkpoint is under {run_dir.path}"
            )
        policy = save_hf_folder(rl.learner.weights(), cfg.model.spec, run_dir.path / "policy")
        domains, arms = rl.domains, rl.arms
        shares = {k: v for k, v in rl.sampler.signals().items() if k.startswith("curriculum/groups/")}
    finally:
        rl.close()
    del rl
    gc.collect()
    if not keep_checkpoints:
        shutil.rmtree(
            run_dir.checkpoints, ignore_errors=True
        )  # the learner, engine and K/V pool of this run before the evaluation engine loads
    train_s = time.perf_counter() - t0
    rows = read_metrics(run_dir.metrics)
    sandbox = make_sandbox(cfg.sandbox)
    try:
        report = evaluate_local(str(policy), cfg, domains, arms, n_eval, eval_seed, sandbox, by_arm=by_arm)
    finally:
        asyncio.run(sandbox.close())
        gc.collect()
    scored = [r for r in rows if any(str(k).startswith("retention") for k in r)]
    return {
        "zero_advantage_tokens": sum(float(r.get("rollout/zero_advantage_tokens", 0.0)) for r in rows),
        "retention": {k: v for k, v in scored[-1].items() if str(k).startswith("retention")}
        if scored
        else {},
        "report": report,
        "train_s": train_s,
        "steps": len(rows),
        "generated_tokens": sum(float(r.get("rollout/generated_tokens", 0.0)) for r in rows),
        "probe_tokens": sum(float(r.get("heldout/generated_tokens", 0.0)) for r in rows),
        "probes": sum(1 for r in rows if any(str(k).startswith("heldout/") for k in r)),
        "groups_by_arm": {k.rpartition("/")[2]: v for k, v in shares.items()},
    }


def base_eval(overrides: list[str], n_eval: int, eval_seed: int, by_arm: bool = False) -> Any:
    """The untrained model on the same held-out tasks (the reference both samplers start from)."""
    from posttrain.config import load_config
    from posttrain.curriculum.arms import Arm
    from posttrain.envs import get_domain
    from posttrain.orchestrator.eval.evaluate import evaluate_local
    from posttrain.sandbox import make_sandbox

    cfg = load_config(None, overrides)
    domains = {d.name: get_domain(d.name, **d.options) for d in cfg.envs.domains}
    arms = [Arm(d.name, lvl) for d in cfg.envs.domains for lvl in d.difficulties]
    sandbox = make_sandbox(cfg.sandbox)
    try:
        return evaluate_local(cfg.model.spec, cfg, domains, arms, n_eval, eval_seed, sandbox, by_arm=by_arm)
    finally:
        asyncio.run(sandbox.close())
        gc.collect()


def _take_saved(ns: argparse.Namespace, saved: dict[str, Any]) -> dict[str, int]:
    """--reuse-uniform: the model, arms, sizes, held-out tasks, budget rule, preset and --run-set values of
    the saved result become this run's, so the adaptive runs match the uniform runs they are paired with.
    A flag given with another value is a ValueError that names it. Returns the sizes."""

    def clash(flag: str, given: Any, kept: Any) -> ValueError:
        return ValueError(
            f"--reuse-uniform: {flag} {given!r} differs from the saved result's {kept!r}; the "
            "uniform runs must match the adaptive ones (leave the flag out to take the saved value)"
        )

    kept_layout = saved.get("layout", "default")
    if getattr(ns, "layout", "default") not in ("default", kept_layout):
        raise clash("--layout", ns.layout, kept_layout)
    ns.layout = kept_layout
    for key in REUSED_FLAGS:
        given = getattr(ns, key)
        if given is not None and given != saved[key]:
            raise clash("--" + key.replace("_", "-"), given, saved[key])
        setattr(ns, key, saved[key])
    sizes = {k: int(v) for k, v in saved["sizes"].items()}
    for key, v in sizes.items():
        given = getattr(ns, key, None)
        if given is not None and int(given) != v:
            raise clash("--" + key.replace("_", "-"), int(given), v)
    quick = _settings(saved)["--quick"]
    if ns.quick and not quick:
        raise clash("--quick", True, False)
    ns.quick = quick
    if ns.seeds is not None or ns.seed_start != 0:
        raise ValueError(
            f"--reuse-uniform runs the saved result's seeds {saved['seeds']}; leave out --seeds and --seed-start"
        )
    kept = saved.get("run_overrides")  # absent from results saved before it was recorded: taken as given
    if kept is not None and ns.run_overrides and list(ns.run_overrides) != kept:
        raise clash("--run-set", list(ns.run_overrides), kept)
    ns.run_overrides = list(ns.run_overrides) or list(kept or [])
    return sizes


def main_real(ns: argparse.Namespace) -> dict[str, Any]:
    from posttrain.orchestrator.rl import RLRun

    saved = load_result(ns.reuse_uniform, "--reuse-uniform") if getattr(ns, "reuse_uniform", None) else None
    if saved is not None:
        sizes = _take_saved(ns, saved)
        seeds = [int(row["seed"]) for row in saved["per_seed"][SAMPLERS[0]]]
    else:
        ns.layout = getattr(ns, "layout", "default")
        domain_entries(ns.layout, DEFAULT_DOMAINS)  # an unknown layout fails here
        if ns.layout == "many":
            if ns.domains is not None:
                raise ValueError("--domains and --layout many both choose the arms; give one of them")
            ns.domains = MANY_DOMAINS
        for key, default in REUSED_FLAGS.items():
            if getattr(ns, key, None) is None:
                setattr(ns, key, default)
        sizes = dict(PRESETS["quick" if ns.quick else "full"])
        for key in sizes:
            if getattr(ns, key, None) is not None:
                sizes[key] = int(getattr(ns, key))
        n_seeds = ns.seeds if ns.seeds is not None else 1 if ns.quick else 2
        seeds = list(range(ns.seed_start, ns.seed_start + n_seeds))
    for key, v in sizes.items():
        least = 0 if key == "probe_every" else 1
        if v < least:
            raise ValueError(f"--real: --{key.replace('_', '-')} must be >= {least}, got {v}")
    overrides = run_overrides(ns, sizes)
    from posttrain.config import load_config

    cfg = load_config(None, overrides)
    RLRun.check(cfg)  # unknown domain / level fails before any model loads
    # what the adaptive runs resolve to (defaults included), so results stay comparable across default changes
    adaptive_cfg = {**cfg.curriculum.model_dump(mode="json"), "sampler": "adaptive"}
    root = Path(ns.out) if ns.out else Path(tempfile.mkdtemp(prefix="bench-curriculum-real-"))
    t0 = time.perf_counter()
    by_arm = ns.layout == "many"
    if saved is None:
        b = base_eval(overrides, sizes["n_eval"], ns.eval_seed, by_arm)
        base = {**b.per_domain, "all": _pooled([x for v in b.per_task.values() for x in v], ns.eval_seed)}
        if by_arm:
            base["macro"] = macro_accuracy(b.per_task, ns.eval_seed)
    else:  # the same model on the same held-out tasks, greedy: the saved scores are what a rerun would give
        base = saved["base"]
    per_seed: dict[str, list[dict[str, Any]]] = {s: [] for s in SAMPLERS}
    budgets: list[int | None] = []
    for i, seed in enumerate(seeds):
        budget: int | None = None
        if saved is not None:
            per_seed[SAMPLERS[0]].append(saved["per_seed"][SAMPLERS[0]][i])
            budget = saved["token_budget_per_seed"][i]
        for sampler in SAMPLERS[1:] if saved is not None else SAMPLERS:
            extra = []
            if budget is not None:
                extra = [
                    f"orchestrator.token_budget={budget}",
                    f"orchestrator.steps={MAX_STEPS_FACTOR * sizes['steps']}",
                ]
            r = train_and_eval(
                [*overrides, *extra],
                sampler,
                seed,
                root,
                sizes["n_eval"],
                ns.eval_seed,
                ns.keep_checkpoints,
                by_arm,
            )
            per_seed[sampler].append(
                {
                    "seed": seed,
                    "per_domain": r["report"].per_domain,
                    "train_s": round(r["train_s"], 1),
                    "steps": r["steps"],
                    "generated_tokens": r["generated_tokens"],
                    "probe_tokens": r["probe_tokens"],
                    "probes": r["probes"],
                    "groups_by_arm": r["groups_by_arm"],
                    "zero_advantage_tokens": r["zero_advantage_tokens"],
                    "retention": r["retention"],
                    "per_task": r["report"].per_task,
                }  # held-out scores in task order, for pooling across invocations
            )
            if sampler == SAMPLERS[0] and ns.budget == "tokens":
                budget = max(1, int(r["generated_tokens"] + r["probe_tokens"]))
        budgets.append(budget)
    meta: dict[str, Any] = {
        "mode": "real",
        "model": ns.model,
        "domains": ns.domains,
        "sizes": sizes,
        "eval_seed": ns.eval_seed,
        "budget": ns.budget,
        "quick": bool(ns.quick),
        **({"layout": ns.layout, "arms": layout_arms(ns.layout)} if ns.layout != "default" else {}),
        "run_overrides": list(ns.run_overrides),
        # --set values: the adaptive runs', and the uniform runs' (the same unless they come from --reuse-uniform)
        "adaptive_overrides": list(ns.overrides),
        "adaptive_curriculum": adaptive_cfg,
        "uniform_overrides": list(ns.overrides)
        if saved is None
        else _settings(saved)["uniform --set values"],
        "rollouts_per_uniform_run": sizes["steps"] * sizes["prompts_per_step"] * sizes["samples_per_prompt"],
        "run_root": str(root),
    }
    if saved is not None:
        meta["uniform_from"] = str(ns.reuse_uniform)
    out = summarise(meta, base, per_seed, budgets)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    (root / RESULT_FILE).write_text(json.dumps(out))
    _print_real(out)
    return out


def summarise(
    meta: dict[str, Any],
    base: dict[str, Any],
    per_seed: dict[str, list[dict[str, Any]]],
    budgets: list[int | None],
) -> dict[str, Any]:
    """The report of a run matrix from its per-seed rows (each with the held-out `per_task` scores): accuracy
    per domain (per arm for --layout many) with every seed's tasks pooled, the macro accuracy over them,
    the rollout tokens spent on zero-advantage groups, adaptive - uniform paired per seed and, over several
    seeds, pooled over (task, seed) pairs. `main_real` and `pool_results` both build their output here."""
    from posttrain.orchestrator.eval.evaluate import EvalReport, paired_delta

    seeds = [row["seed"] for row in per_seed[SAMPLERS[0]]]
    eval_seed = int(meta["eval_seed"])
    out: dict[str, Any] = {
        **meta,
        "seeds": seeds,
        "token_budget_per_seed": budgets,
        "base": base,
        "per_domain": {},
        "per_seed": per_seed,
        "delta_adaptive_minus_uniform": {},
        "macro": {},
        "zero_advantage_tokens": {},
    }
    reports = {
        s: [EvalReport(f"{s}-seed{row['seed']}", row["per_task"]) for row in per_seed[s]] for s in SAMPLERS
    }
    for sampler in SAMPLERS:
        pooled = _pool(reports[sampler]).per_task
        out["per_domain"][sampler] = {d: _pooled(s, eval_seed) for d, s in pooled.items()}
        out["per_domain"][sampler]["all"] = _pooled([x for s in pooled.values() for x in s], eval_seed)
        out["macro"][sampler] = macro_accuracy(pooled, eval_seed)
        rows = per_seed[sampler]
        if all("zero_advantage_tokens" in r for r in rows):  # absent from results saved before it was counted
            zero = sum(float(r["zero_advantage_tokens"]) for r in rows)
            spent = sum(float(r["generated_tokens"]) for r in rows)
            out["zero_advantage_tokens"][sampler] = {"tokens": zero, "share": zero / spent if spent else 0.0}
    for seed, a, u in zip(seeds, reports["adaptive"], reports["uniform_by_domain"], strict=True):
        out["delta_adaptive_minus_uniform"][str(seed)] = paired_delta(a, u, eval_seed)
    if len(seeds) > 1:  # every run is scored on the same held-out tasks: pair (task, seed) across the seeds
        out["delta_adaptive_minus_uniform"]["pooled"] = paired_delta(
            _pool(reports["adaptive"]), _pool(reports["uniform_by_domain"]), eval_seed
        )
    return out


# What must agree for runs of separate invocations to be pooled: the same model, arms, sizes, held-out tasks,
# budget rule, preset, run overrides and sampler settings (`_settings`). The base model's scores must agree
# too (same model, same tasks: greedy, so equal).
POOL_KEYS = ("model", "domains", "sizes", "eval_seed", "budget", "base")


def _settings(result: dict[str, Any]) -> dict[str, Any]:
    """The --set values of a saved result's adaptive and uniform runs, its --quick and its --run-set values;
    results saved before these were recorded ran with no --set (the --real runs so far), and their --run-set
    is unknown (None)."""
    return {
        "adaptive --set values": list(result.get("adaptive_overrides", [])),
        "uniform --set values": list(result.get("uniform_overrides", [])),
        "--quick": bool(result.get("quick", False)),
        "--run-set values": result.get("run_overrides"),
    }


def _mismatch(a: dict[str, Any], b: dict[str, Any], keys: tuple[str, ...]) -> str | None:
    """What two saved results differ in among `keys` (the first key that differs, in words), or None."""
    for key in keys:
        if a.get(key) != b.get(key):
            if key == "base":
                return "the base model's held-out scores (another model build or machine?)"
            return f"'{key}': {a.get(key)!r} vs {b.get(key)!r}"
    return None


def load_result(path: str | Path, flag: str = "--pool") -> dict[str, Any]:
    """A saved `--real` result: the run root's result.json (or the folder holding it), or a capture of
    `posttrain bench curriculum --json --real ...` whose last line is the JSON object. ValueError names
    the file and, as `flag`, the option that read it."""
    p = Path(path)
    if p.is_dir():
        p = p / RESULT_FILE
    try:
        text = p.read_text()
    except OSError as err:
        raise ValueError(f"{flag}: cannot read {p}: {err.strerror or err}") from None
    lines = text.strip().splitlines()
    try:
        obj = json.loads(lines[-1] if lines else "")
    except json.JSONDecodeError:
        raise ValueError(
            f"{flag}: {p} does not end with a JSON object (a result.json or a --json capture)"
        ) from None
    if not isinstance(obj, dict) or obj.get("mode") != "real" or "per_seed" not in obj:
        raise ValueError(f"{flag}: {p} is not the result of `bench curriculum --real`")
    rows = [row for s in SAMPLERS for row in obj["per_seed"].get(s, [])]
    if any(s not in obj["per_seed"] for s in SAMPLERS) or any("per_task" not in row for row in rows):
        raise ValueError(
            f"{flag}: {p} lacks a sampler's runs or their per-task held-out scores (saved before "
            "they were kept); it cannot be used"
        )
    return renamed_sizes(obj)


def renamed_sizes(result: dict[str, Any]) -> dict[str, Any]:
    """`result` with the names of today: a result saved before the run config's batch section existed
    records the sizes as tasks_per_step / group_size and may replay --run-set values with the old config
    keys (config.MOVED_KEYS); both are renamed, values unchanged, so old and new results pool and compare."""
    from posttrain.config import MOVED_KEYS

    def key_renamed(override: str) -> str:
        key, sep, value = override.partition("=")
        return f"{MOVED_KEYS.get(key.strip(), key)}{sep}{value}"

    out = dict(result)
    out["sizes"] = {OLD_SIZE_NAMES.get(k, k): v for k, v in result["sizes"].items()}
    if result.get("run_overrides") is not None:
        out["run_overrides"] = [key_renamed(o) for o in result["run_overrides"]]
    return out


def pool_results(paths: list[str], check_adaptive_config: bool = True) -> dict[str, Any]:
    """`--pool A B ...`: one report over the seeds of several saved `--real` results (e.g. one invocation per
    seed with --seed-start), as if one invocation had run them all. ValueError names a file that does not
    match the first one, or a seed two files both ran. check_adaptive_config=False (`--pool-any-config`)
    skips only the comparison of the adaptive runs' settings, for results the caller vouches for (one saved
    before the resolved config was recorded cannot be matched with one after); the report says so."""
    results = [load_result(p) for p in paths]
    first = results[0]
    for path, r in zip(paths[1:], results[1:], strict=True):
        if what := _mismatch(r, first, POOL_KEYS):
            raise ValueError(f"--pool: {path} differs from {paths[0]} in {what}")
        # the resolved config decides once a result records it (the same settings may be spelt differently, or
        # be another version's defaults; one without it cannot be matched); before that, the --set values do
        recorded = "adaptive_curriculum" in r or "adaptive_curriculum" in first
        if (
            check_adaptive_config
            and recorded
            and r.get("adaptive_curriculum") != first.get("adaptive_curriculum")
        ):
            raise ValueError(
                f"--pool: {path} differs from {paths[0]} in its adaptive runs' curriculum config: "
                f"{_config_diff(r.get('adaptive_curriculum'), first.get('adaptive_curriculum'), path, paths[0])}"
            )
        mine, theirs = _settings(r), _settings(first)
        if recorded or not check_adaptive_config:
            del mine["adaptive --set values"], theirs["adaptive --set values"]
        for name in mine:
            if mine[name] != theirs[name] and not (
                name == "--run-set values" and None in (mine[name], theirs[name])
            ):
                raise ValueError(
                    f"--pool: {path} differs from {paths[0]} in its {name}: {mine[name]!r} vs {theirs[name]!r}"
                )
    per_seed: dict[str, list[dict[str, Any]]] = {s: [] for s in SAMPLERS}
    budgets: list[int | None] = []
    seen: dict[int, str] = {}
    for path, r in zip(paths, results, strict=True):
        for row in r["per_seed"][SAMPLERS[0]]:
            if row["seed"] in seen:
                raise ValueError(f"--pool: seed {row['seed']} is in both {seen[row['seed']]} and {path}")
            seen[row["seed"]] = path
        for s in SAMPLERS:
            per_seed[s].extend(r["per_seed"][s])
        budgets.extend(r["token_budget_per_seed"])
    meta = {
        k: first[k]
        for k in ("mode", "model", "domains", "sizes", "eval_seed", "budget", "rollouts_per_uniform_run")
    }
    meta.update({k: first[k] for k in ("layout", "arms") if k in first})
    settings = _settings(first)
    known = [s for s in (_settings(r)["--run-set values"] for r in results) if s is not None]
    meta.update(
        quick=settings["--quick"],
        adaptive_overrides=settings["adaptive --set values"],
        uniform_overrides=settings["uniform --set values"],
    )
    if "adaptive_curriculum" in first:
        meta["adaptive_curriculum"] = first["adaptive_curriculum"]
    if not check_adaptive_config:
        meta["adaptive_config_checked"] = False
    if known:
        meta["run_overrides"] = known[0]
    meta["run_root"] = [r["run_root"] for r in results]
    out = summarise(meta, first["base"], per_seed, budgets)
    out["pooled_from"] = [str(p) for p in paths]
    out["wall_s"] = round(sum(float(r.get("wall_s", 0.0)) for r in results), 1)
    _print_real(out)
    return out


def _config_diff(
    a: dict[str, Any] | None, b: dict[str, Any] | None, name_a: str = "A", name_b: str = "B"
) -> str:
    """The keys two resolved curriculum configs differ in, as 'key a vs b'; a result saved before the
    config was recorded has none to compare."""
    if a is None or b is None:
        return (
            f"{name_a if a is None else name_b} does not record it (saved before results kept it), so the two "
            "cannot be told to match"
        )
    keys = sorted(k for k in {*a, *b} if a.get(k) != b.get(k))
    return ", ".join(f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in keys) or "none"


def compare_results(path_a: str, path_b: str) -> dict[str, Any]:
    """`--compare A B`: the adaptive runs of two saved `--real` results (e.g. two sampler settings, the second
    from `--reuse-uniform`) paired on the same held-out tasks and seeds: A - B per seed and pooled over
    (task, seed) pairs. ValueError when the two were not run on the same model, arms, sizes, held-out tasks,
    seeds and token budgets, so that the pairs are not like for like."""
    from posttrain.orchestrator.eval.evaluate import EvalReport, paired_delta

    a, b = load_result(path_a, "--compare"), load_result(path_b, "--compare")
    if what := _mismatch(a, b, (*POOL_KEYS, "seeds", "token_budget_per_seed")):
        raise ValueError(
            f"--compare: {path_a} and {path_b} differ in {what}; their adaptive runs cannot be paired"
        )
    eval_seed = int(a["eval_seed"])
    reps = {
        n: [EvalReport(f"{n}-seed{row['seed']}", row["per_task"]) for row in r["per_seed"]["adaptive"]]
        for n, r in (("a", a), ("b", b))
    }
    out: dict[str, Any] = {
        "mode": "compare",
        "a": str(path_a),
        "b": str(path_b),
        "seeds": a["seeds"],
        "eval_seed": eval_seed,
        "settings": {
            n: {
                "adaptive_overrides": _settings(r)["adaptive --set values"],
                "steps": [row["steps"] for row in r["per_seed"]["adaptive"]],
            }
            for n, r in (("a", a), ("b", b))
        },
        "accuracy": {n: r["per_domain"]["adaptive"] for n, r in (("a", a), ("b", b))},
        "uniform_accuracy": {
            n: r["per_domain"][SAMPLERS[0]]["all"]["accuracy"] for n, r in (("a", a), ("b", b))
        },
        "delta_a_minus_b": {
            str(seed): paired_delta(x, y, eval_seed)
            for seed, x, y in zip(a["seeds"], reps["a"], reps["b"], strict=True)
        },
    }
    if len(a["seeds"]) > 1:
        out["delta_a_minus_b"]["pooled"] = paired_delta(_pool(reps["a"]), _pool(reps["b"]), eval_seed)
    if "adaptive_curriculum" in a and "adaptive_curriculum" in b:
        out["config_differences"] = _config_diff(a["adaptive_curriculum"], b["adaptive_curriculum"])
    _print_compare(out)
    return out


def _print_compare(out: dict[str, Any]) -> None:
    from rich.console import Console

    console = Console(width=170)
    for n in ("a", "b"):
        acc, st = out["accuracy"][n], out["settings"][n]
        per = ", ".join(f"{d} {v['accuracy']:.3f}" for d, v in acc.items() if d != "all")
        console.print(
            f"  {n.upper()} = {out[n]}: adaptive --set {st['adaptive_overrides']}, steps {st['steps']}; held-out "
            f"all {acc['all']['accuracy']:.3f} ({per}); its uniform runs {out['uniform_accuracy'][n]:.3f}"
        )
    if "config_differences" in out:
        console.print(
            f"  the adaptive runs' curriculum configs differ in: {out['config_differences']} (A vs B)"
        )
    for seed, d in out["delta_a_minus_b"].items():
        per = ", ".join(f"{k} {v['delta']:+.3f}" for k, v in d["per_domain"].items())
        label = "seeds pooled" if seed == "pooled" else f"seed {seed}"
        console.print(
            f"  {label}: A - B: all {d['delta']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}] "
            f"({d['n_tasks']} pairs); {per}"
        )


def _pool(reports: list[Any]) -> Any:
    """One report whose per-task scores are the reports' in turn (seed after seed)."""
    from posttrain.orchestrator.eval.evaluate import EvalReport

    per_task: dict[str, list[float | None]] = {}
    for rep in reports:
        for dom, scores in rep.per_task.items():
            per_task.setdefault(dom, []).extend(scores)
    return EvalReport("pooled", per_task)


def _print_real(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    def cell(d: dict[str, float]) -> str:
        return f"{d['accuracy']:.3f} [{d['ci_low']:.3f}, {d['ci_high']:.3f}] n={d['n']}"

    sz = out["sizes"]
    t = Table(
        title=(
            f"curriculum --real: {out['model']}, seeds {out['seeds']}, {sz['steps']} steps x "
            f"{sz['prompts_per_step']} prompts x {sz['samples_per_prompt']} rollouts per run; held-out greedy "
            f"accuracy, {sz['n_eval']} tasks per arm, 95% bootstrap CI (seeds pooled)"
        )
    )
    t.add_column("domain")
    t.add_column("base model", justify="right")
    for s in SAMPLERS:
        t.add_column(s, justify="right")
    doms = list(out["per_domain"][SAMPLERS[0]])
    for d in doms:
        t.add_row(d, cell(out["base"][d]), *[cell(out["per_domain"][s][d]) for s in SAMPLERS])
    console = Console(width=170)
    console.print(t)
    for key, what in out.get("arms", {}).items():
        console.print(f"  {key}: {what}")
    macro = ", ".join(
        f"{s} {m['accuracy']:.3f} [{m['ci_low']:.3f}, {m['ci_high']:.3f}]" for s, m in out["macro"].items()
    )
    console.print(
        f"  macro accuracy (mean over {'arms' if out.get('layout') == 'many' else 'domains'}): {macro}"
    )
    for s, z in out["zero_advantage_tokens"].items():
        console.print(
            f"  {s}: {z['tokens']:.0f} rollout tokens in zero-advantage groups (all rewards equal), "
            f"{z['share']:.1%} of its rollout tokens"
        )
    for seed, dd in out["delta_adaptive_minus_uniform"].items():
        per = ", ".join(
            f"{d} {v['delta']:+.3f} [{v['ci_low']:+.3f}, {v['ci_high']:+.3f}]"
            for d, v in dd["per_domain"].items()
        )
        console.print(
            f"  {'seeds pooled' if seed == 'pooled' else 'seed ' + seed}: adaptive - uniform: all {dd['delta']:+.3f} [{dd['ci_low']:+.3f}, {dd['ci_high']:+.3f}]; {per}"
        )
    for s in SAMPLERS:
        for r in out["per_seed"][s]:
            console.print(
                f"  {s} seed {r['seed']}: {r['steps']} steps, {r['generated_tokens']:.0f} rollout tokens + "
                f"{r['probe_tokens']:.0f} probe tokens ({r['probes']} probes), train {r['train_s']} s, "
                f"groups {r['groups_by_arm']}"
            )
            if r.get("retention"):
                console.print(f"    retention at its last scoring: {r['retention']}")
    if out.get("adaptive_overrides") or out.get("uniform_overrides"):
        console.print(
            f"  --set values: adaptive {out['adaptive_overrides']}, uniform {out['uniform_overrides']}"
        )
    if out.get("uniform_from"):
        console.print(
            f"  the uniform runs and base scores are those of {out['uniform_from']} (--reuse-uniform)"
        )
    if out["budget"] == "tokens":
        console.print(
            f"  budget: the adaptive run of each seed stops at uniform's tokens {out['token_budget_per_seed']} "
            f"(probes charged; steps capped at {MAX_STEPS_FACTOR}x)"
        )
    if out.get("adaptive_config_checked") is False:
        console.print(
            "  the adaptive runs' settings were not compared across the results (--pool-any-config)"
        )
    console.print(f"  runs under {out['run_root']}; wall {out['wall_s']} s")
