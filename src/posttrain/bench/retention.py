"""`posttrain bench retention`: the default recipe (`make demo`'s: 135M, math 0-1 + code.unit_tests 0,
GRPO, adaptive) trained without and with retention control, same seed and token budget, then scored
against the base model on held-out tasks of three kinds: the trained arms (greedy, and sampled pass@1
and pass@k), the retention suites the control watches, and families in neither the training mix nor
the suites (the test of generalisation).

Per seed the run without control goes first; the run with control gets `orchestrator.token_budget` =
the tokens it generated, its own retention probes charged against it (steps capped at twice as many).
The control is the config overrides of `--control` (default `CONTROL`: the suites, replay of general
data raised by falling suites, the entropy floor, KL steered by the drift probe). Every figure is a
paired difference from the base model over the same tasks, pooled over seeds, with its 95% bootstrap
interval; `targets` checks the issue's three: no outside family falls beyond its interval, the trained
gain keeps >= 80% of its size without control (greedy and sampled pass@1 both), pass@k on the trained
arms does not fall.

`--out DIR --reuse` scores the runs already saved under DIR (each `NAME/policy` with the `bench_run.json`
its training wrote) instead of training them again, so seeds trained by separate invocations are pooled
by one more invocation over a folder holding all of them. `--reuse-off DIR` takes the runs without
control from DIR and trains only the control setting: the way to compare another `--control` against
the same runs without it.
"""

from __future__ import annotations

import asyncio
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from posttrain.bench import BenchUsageError
from posttrain.bench.curriculum_real import parse_domains

TRAINED = "math:0,1;code.unit_tests:0"
RETENTION = "math:2;code.unit_tests:1"
# outside both: the default domains' next levels, instruction following, and reasoning-gym families the
# embedded model sometimes solves (character-level: letter counting, spelling backward; word problems)
OUTSIDE = (
    "math:3;code.unit_tests:2;instruct.constraints:0,1"
    ";letters=math{datasets: {letter_counting: {min_words: 6, max_words: 10}}}:0"
    ";spell=math{datasets: {spell_backward: {min_word_len: 3, max_word_len: 3}}}:0"
    ";legs=math{datasets: {leg_counting: {min_animals: 1, max_animals: 1, max_instances: 2}}}:0"
)
CONTROL = [
    "curriculum.retention_every=10",
    "curriculum.retention_size=16",
    "curriculum.retention_replay_gain=0.5",
    "curriculum.drift_every=5",
    "algorithm.replay_fraction=0.125",
    "algorithm.entropy_floor=0.5",
    "algorithm.kl_control=drift",
    "algorithm.kl_coef=0.05",
    "algorithm.kl_target=0.05",
]
PRESETS: dict[str, dict[str, int]] = {
    "full": {"steps": 40, "n_eval": 32, "samples": 16, "max_new_tokens": 64},
    "quick": {"steps": 3, "n_eval": 4, "samples": 4, "max_new_tokens": 48},
}
# --quick keeps memory and time small (the machine it targets is shared); explicit --run-set values win
QUICK_RUN = [
    "engine.num_kv_blocks=512",
    "batch.micro_batch_tokens=1024",
    "batch.prompts_per_step=2",
    "batch.samples_per_prompt=4",
]
QUICK_CONTROL = ["curriculum.retention_every=1", "curriculum.retention_size=4", "curriculum.drift_every=1"]
GAIN_KEPT_TARGET = 0.8


def parse_suites(text: str) -> list[dict[str, Any]]:
    """`--retention` / `--outside` specs, `;`-separated `[label=]name[{options}]:levels`, e.g.
    `math:2;letters=math{datasets: [letter_counting]}:0` -> curriculum.retention entries (name,
    difficulties, options, label). An entry with options needs a label: its figures must not read as
    the domain's own. BenchUsageError names a bad part."""
    import yaml

    out = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        head, sep, levels = part.rpartition(":")
        label, eq, rest = head.partition("=") if "=" in head.split("{", 1)[0] else (None, "", head)
        name, brace, opts = rest.partition("{")
        if not sep or not name.strip() or not levels.strip() or (eq and not label.strip()):
            raise BenchUsageError(
                f"suite '{part}' is not of the form [label=]name[{{options}}]:level[,level...]"
            )
        try:
            lv = [int(x) for x in levels.split(",") if x.strip()]
        except ValueError:
            raise BenchUsageError(f"suite '{part}': levels must be integers") from None
        options: Any = {}
        if brace:
            try:
                options = yaml.safe_load("{" + opts)
            except yaml.YAMLError:
                options = None
            if not isinstance(options, dict):
                raise BenchUsageError(f"suite '{part}': the options must be a YAML mapping in braces")
            if not eq:
                raise BenchUsageError(
                    f"suite '{part}' has options: give it a label (label=name{{...}}:levels)"
                )
        entry: dict[str, Any] = {"name": name.strip(), "difficulties": lv, "options": options}
        if eq:
            entry["label"] = label.strip()
        out.append(entry)
    if not out:
        raise BenchUsageError("no suite given")
    return out


def _domains_yaml(text: str) -> str:
    return ", ".join(
        f"{{name: {n}, difficulties: [{', '.join(map(str, lv))}]}}" for n, lv in parse_domains(text)
    )


def suites_yaml(text: str) -> str:
    return ", ".join(json.dumps(entry) for entry in parse_suites(text))


def spec_arms(text: str, suites: bool = True) -> tuple[dict[str, Any], list[Any]]:
    """The domains (by suite name: the label, else the domain's name) and arms of a spec; `suites=False`
    reads a training mix (`name:levels` parts only)."""
    from posttrain.curriculum import Arm
    from posttrain.envs import get_domain

    entries = (
        parse_suites(text)
        if suites
        else [{"name": n, "difficulties": lv, "options": {}} for n, lv in parse_domains(text)]
    )
    domains: dict[str, Any] = {}
    arms = []
    for e in entries:
        key = e.get("label") or e["name"]
        if key in domains and e.get("options"):
            raise BenchUsageError(f"'{key}' is given twice")
        domain = domains.setdefault(key, get_domain(e["name"], **e["options"]))
        for lvl in e["difficulties"]:
            if lvl not in domain.difficulties:
                raise BenchUsageError(
                    f"'{key}' has no difficulty {lvl}; valid levels are {domain.difficulties}"
                )
            arms.append(Arm(key, lvl))
    return domains, arms


def check_sets(trained: str, retention: str, outside: str) -> None:
    """The three arm sets must be disjoint (a suite measures what the run does not train)."""
    sets = {}
    for flag, text, suites in (
        ("--trained", trained, False),
        ("--retention", retention, True),
        ("--outside", outside, True),
    ):
        try:
            sets[flag] = {a.key for a in spec_arms(text, suites)[1]}
        except ValueError as err:
            raise BenchUsageError(f"{flag}: {err}") from None
    names = list(sets)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            both = sorted(sets[a] & sets[b])
            if both:
                raise BenchUsageError(f"{a} and {b} share {both}: the three sets must be disjoint")


def _evaluate(spec: str, cfg: Any, text: str, n: int, seed: int, suites: bool = True, **kw: Any) -> Any:
    from posttrain.orchestrator.eval.evaluate import evaluate_local
    from posttrain.sandbox import make_sandbox

    domains, arms = spec_arms(text, suites)
    sandbox = make_sandbox(cfg.sandbox)
    try:
        return evaluate_local(spec, cfg, domains, arms, n, seed, sandbox, by_arm=True, **kw)
    finally:
        asyncio.run(sandbox.close())
        gc.collect()


def _stage(text: str) -> None:
    print(f"bench retention: {text}", file=sys.stderr, flush=True)


def score_policy(spec: str, cfg: Any, ns: Any, sizes: dict[str, int]) -> dict[str, Any]:
    """The policy's reports: trained arms greedy and sampled (pass@1, pass@samples), suites, outside."""
    n, s = sizes["n_eval"], sizes["samples"]
    _stage(f"scoring {spec}")
    return {
        "greedy": _evaluate(spec, cfg, ns.trained, n, ns.eval_seed, suites=False),
        "sampled": _evaluate(
            spec,
            cfg,
            ns.trained,
            n,
            ns.eval_seed,
            suites=False,
            temperature=1.0,
            samples=s,
            pass_at=sorted({1, s}),
        ),
        "retention": _evaluate(spec, cfg, ns.retention, n, ns.eval_seed),
        "outside": _evaluate(spec, cfg, ns.outside, n, ns.eval_seed),
    }


RUN_RECORD = "bench_run.json"  # what train() returns besides the config and the rows, for --reuse


def saved_run(
    root: Path, name: str, overrides: list[str], seed: int, flag: str = "--reuse"
) -> dict[str, Any]:
    """A run `train` saved under root/name (its policy, config, metrics and RUN_RECORD), for --reuse (or
    `flag`); its config must be the one these overrides and seed would train (telemetry aside)."""
    from posttrain.config import load_config
    from posttrain.telemetry import read_metrics

    folder = root / name
    record = folder / RUN_RECORD
    if not (folder / "policy").is_dir() or not record.is_file():
        raise BenchUsageError(
            f"bench retention {flag}: {folder} holds no finished run (needs policy/ and {RUN_RECORD}); "
            f"train it without {flag}"
        )
    run = json.loads(record.read_text())
    cfg = load_config(str(folder / "config.yaml"))
    want = load_config(None, [*overrides, f"seed={seed}"])
    have_d, want_d = (c.model_dump(exclude={"telemetry"}) for c in (cfg, want))
    if have_d != want_d:
        differ = sorted(
            f"{sec}.{k}"
            for sec in want_d
            if isinstance(want_d[sec], dict)
            for k in set(want_d[sec]) | set(have_d.get(sec, {}))
            if want_d[sec].get(k) != have_d.get(sec, {}).get(k)
        ) or sorted(k for k in want_d if want_d[k] != have_d.get(k))
        raise BenchUsageError(
            f"bench retention {flag}: {folder}'s config is not this invocation's (differs in {', '.join(differ)})"
        )
    _stage(f"reusing {name}")
    return {
        **run,
        "cfg": cfg,
        "policy": str(folder / "policy"),
        "rows": read_metrics(folder / "metrics.jsonl"),
    }


def train(overrides: list[str], seed: int, root: Path, name: str) -> dict[str, Any]:
    """One RL run, its policy exported; checkpoints deleted. Returns the policy path, rows and tokens
    (and writes the tokens, steps, stop reason and time to RUN_RECORD beside the policy)."""
    from posttrain.config import load_config, save_config
    from posttrain.orchestrator.eval.export import save_hf_folder
    from posttrain.orchestrator.rl import RLRun
    from posttrain.telemetry import RunDir, read_metrics

    cfg = load_config(None, [*overrides, f"seed={seed}", f"telemetry.run_dir={root}"])
    _stage(f"training {name}")
    run_dir = RunDir.create(root, name)
    save_config(cfg, run_dir.config)
    t0 = time.perf_counter()
    rl = RLRun(cfg, run_dir, show_progress=False)
    try:
        summary = rl.train()
        if summary["interrupted"]:
            raise SystemExit(f"bench retention: interrupted by signal {summary['signal']} during {name}")
        policy = save_hf_folder(rl.learner.weights(), cfg.model.spec, run_dir.path / "policy")
    finally:
        rl.close()
    del rl
    gc.collect()
    shutil.rmtree(run_dir.checkpoints, ignore_errors=True)
    rows = read_metrics(run_dir.metrics)
    record = {
        "tokens": float(summary["generated_tokens"]),
        "steps": int(summary["step"]),
        "stopped": summary["stopped"],
        "train_s": time.perf_counter() - t0,
    }
    (run_dir.path / RUN_RECORD).write_text(json.dumps(record) + "\n")
    return {"cfg": cfg, "policy": str(policy), "rows": rows, **record}


def _pool(reports: list[Any]) -> Any:
    """One report whose tasks are the reports' in turn (seed after seed), episodes kept for pass@k."""
    from posttrain.orchestrator.eval.evaluate import EvalReport

    out = EvalReport("pooled", {})
    for rep in reports:
        for key, eps in rep.episodes.items():
            for e in eps:
                out.add(key, e)
    return out


def _interval(d: dict[str, Any]) -> dict[str, float]:
    return {"delta": d["delta"], "ci_low": d["ci_low"], "ci_high": d["ci_high"], "n_tasks": d["n_tasks"]}


def figures(model: dict[str, Any], base: dict[str, Any], k: int, seed: int) -> dict[str, Any]:
    """Paired differences from the base of one setting's pooled reports."""
    from posttrain.orchestrator.eval.evaluate import paired_delta

    greedy = paired_delta(model["greedy"], base["greedy"], seed)
    sampled = paired_delta(model["sampled"], base["sampled"], seed, pass_at=sorted({1, k}))
    return {
        "trained_gain": _interval(greedy),
        "trained_gain_per_arm": {a: _interval(d) for a, d in greedy["per_domain"].items()},
        "trained_gain_sampled_pass1": _interval(sampled["pass_at"]["1"]),
        f"trained_pass{k}_delta": _interval(sampled["pass_at"][str(k)]),
        "retention_delta": {
            a: _interval(d)
            for a, d in paired_delta(model["retention"], base["retention"], seed)["per_domain"].items()
        },
        "outside_delta": {
            a: _interval(d)
            for a, d in paired_delta(model["outside"], base["outside"], seed)["per_domain"].items()
        },
    }


def _last(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return float(vals[-1]) if vals else None


def targets(off: dict[str, Any], on: dict[str, Any], k: int) -> dict[str, Any]:
    """The issue's targets for the control setting, each with the figure it reads."""
    fell = sorted(a for a, d in on["outside_delta"].items() if d["ci_high"] < 0)

    def kept(key: str) -> float | None:
        g_off, g_on = off[key]["delta"], on[key]["delta"]
        return g_on / g_off if g_off > 0 else None

    greedy, sampled = kept("trained_gain"), kept("trained_gain_sampled_pass1")
    pass_k = on[f"trained_pass{k}_delta"]
    return {
        "outside_fell": fell,
        "no_outside_fell": not fell,
        "gain_kept": greedy,
        "gain_kept_sampled_pass1": sampled,
        "gain_kept_ok": all(r is not None and r >= GAIN_KEPT_TARGET for r in (greedy, sampled)),
        f"pass{k}_not_fallen": pass_k["ci_high"] >= 0,
    }


def main(ns: Any) -> dict[str, Any]:
    from posttrain.config import load_config

    preset = PRESETS["quick" if ns.quick else "full"]
    sizes = {k: getattr(ns, k) if getattr(ns, k) is not None else v for k, v in preset.items()}
    for key, default in (("trained", TRAINED), ("retention", RETENTION), ("outside", OUTSIDE)):
        if getattr(ns, key) is None:
            setattr(ns, key, default)
    check_sets(ns.trained, ns.retention, ns.outside)
    control = list(ns.control) if ns.control else list(CONTROL)
    retention_yaml = f"curriculum.retention=[{suites_yaml(ns.retention)}]"
    common = [
        f"model.spec={ns.model}",
        f"envs.domains=[{_domains_yaml(ns.trained)}]",
        f"orchestrator.steps={sizes['steps']}",
        f"engine.max_new_tokens={sizes['max_new_tokens']}",
        "orchestrator.checkpoint_every=0",
        "telemetry.progress=false",
        "telemetry.tensorboard=false",
        *(QUICK_RUN if ns.quick else []),
        *ns.run_overrides,
    ]
    with_control = [
        *common,
        retention_yaml,
        *control,
        *(QUICK_CONTROL if ns.quick and not ns.control else []),
    ]
    from posttrain.orchestrator.rl import RLRun

    for overrides in (common, with_control):  # config errors before any work
        try:
            RLRun.check(load_config(None, overrides))
        except ValueError as err:
            raise BenchUsageError(f"bench retention: {err}") from None

    def on_overrides(budget: int) -> list[str]:
        return [
            *with_control,
            f"orchestrator.token_budget={budget}",
            f"orchestrator.steps={2 * sizes['steps']}",
        ]

    k = sizes["samples"]
    if ns.reuse and not ns.out:
        raise BenchUsageError("bench retention: --reuse scores the runs under --out DIR; give --out")
    reuse_off = Path(ns.reuse_off) if getattr(ns, "reuse_off", None) else None
    if reuse_off is not None and not reuse_off.is_dir():
        raise BenchUsageError(f"bench retention --reuse-off: {reuse_off} is not a folder")
    t0 = time.perf_counter()
    root = Path(ns.out) if ns.out else Path(tempfile.mkdtemp(prefix="posttrain-bench-retention-"))
    root.mkdir(parents=True, exist_ok=True)
    seeds = range(ns.seed_start, ns.seed_start + ns.seeds)
    try:
        # saved runs are read (and their configs checked) before any scoring
        saved_off = {
            seed: saved_run(reuse_off, f"off-seed{seed}", common, seed, "--reuse-off")
            if reuse_off is not None
            else saved_run(root, f"off-seed{seed}", common, seed)
            for seed in (seeds if reuse_off is not None or ns.reuse else ())
        }
        base_cfg = load_config(None, common)
        base = score_policy(ns.model, base_cfg, ns, sizes)
        per_setting: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        for seed in seeds:
            off = saved_off[seed] if seed in saved_off else train(common, seed, root, f"off-seed{seed}")
            if ns.reuse:
                on = saved_run(root, f"on-seed{seed}", on_overrides(int(off["tokens"])), seed)
            else:
                on = train(on_overrides(int(off["tokens"])), seed, root, f"on-seed{seed}")
            for name, run in (("off", off), ("on", on)):
                per_setting[name].append(score_policy(run["policy"], run["cfg"], ns, sizes))
                runs[name].append(
                    {
                        "seed": seed,
                        "steps": run["steps"],
                        "generated_tokens": run["tokens"],
                        "stopped": run["stopped"],
                        "train_s": round(run["train_s"], 1),
                        "entropy_end": _last(run["rows"], "train/entropy"),
                        "drift_kl_end": _last(run["rows"], "drift/kl_k3"),
                        "replay_fraction_end": _last(run["rows"], "train/replay_fraction"),
                    }
                )
    finally:
        if not ns.out:
            shutil.rmtree(root, ignore_errors=True)
    out: dict[str, Any] = {"settings": {}}
    for name in ("off", "on"):
        pooled = {kind: _pool([r[kind] for r in per_setting[name]]) for kind in base}
        # the base's tasks repeat for every seed: pool them as often
        base_pooled = {kind: _pool([base[kind]] * ns.seeds) for kind in base}
        out["settings"][name] = {**figures(pooled, base_pooled, k, ns.eval_seed), "runs": runs[name]}
    off_s, on_s = out["settings"]["off"], out["settings"]["on"]
    out["trained_gain"] = {"off": off_s["trained_gain"], "on": on_s["trained_gain"]}
    out["outside_delta"] = {"off": off_s["outside_delta"], "on": on_s["outside_delta"]}
    out["ratio_gain_on_vs_off"] = (
        on_s["trained_gain"]["delta"] / off_s["trained_gain"]["delta"]
        if off_s["trained_gain"]["delta"]
        else None
    )
    out["targets"] = targets(off_s, on_s, k)
    out["config"] = {
        "model": ns.model,
        "trained": ns.trained,
        "retention": ns.retention,
        "outside": ns.outside,
        "control": control,
        "seeds": list(range(ns.seed_start, ns.seed_start + ns.seeds)),
        "eval_seed": ns.eval_seed,
        "quick": bool(ns.quick),
        **({"off_from": str(reuse_off)} if reuse_off is not None else {}),
        **sizes,
    }
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    _print(out, k)
    return out


def _print(out: dict[str, Any], k: int) -> None:
    from rich.console import Console
    from rich.table import Table

    def cell(d: dict[str, Any]) -> str:
        return f"{d['delta']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}] n={d['n_tasks']}"

    t = Table(title="retention control: paired change from the base model (95% CI)")
    t.add_column("figure")
    t.add_column("without control")
    t.add_column("with control")
    off, on = out["settings"]["off"], out["settings"]["on"]
    t.add_row("trained, greedy", cell(off["trained_gain"]), cell(on["trained_gain"]))
    t.add_row(
        "trained, sampled pass@1",
        cell(off["trained_gain_sampled_pass1"]),
        cell(on["trained_gain_sampled_pass1"]),
    )
    t.add_row(f"trained, pass@{k}", cell(off[f"trained_pass{k}_delta"]), cell(on[f"trained_pass{k}_delta"]))
    for kind in ("retention_delta", "outside_delta"):
        for arm in off[kind]:
            t.add_row(f"{kind.split('_')[0]} {arm}", cell(off[kind][arm]), cell(on[kind][arm]))
    ent = [
        ", ".join(f"{r['entropy_end']:.2f}" if r["entropy_end"] is not None else "-" for r in s["runs"])
        for s in (off, on)
    ]
    t.add_row("entropy at the end (per seed)", *ent)
    Console().print(t)
    tg = out["targets"]

    def show(r: float | None) -> str:
        return "n/a" if r is None else f"{r:.2f}"

    print(
        f"gain kept with control: greedy {show(tg['gain_kept'])}, sampled pass@1 "
        f"{show(tg['gain_kept_sampled_pass1'])} (target >= {GAIN_KEPT_TARGET} both); "
        f"outside families that fell: {tg['outside_fell'] or 'none'}; pass@{k} not fallen: {tg[f'pass{k}_not_fallen']}"
    )
