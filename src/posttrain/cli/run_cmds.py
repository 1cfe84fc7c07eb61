"""`posttrain train | eval | export | report` — the RL loop's commands."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from posttrain.cli.common import (
    EXIT_RUNTIME,
    EXIT_USAGE,
    console,
    err_console,
    fail,
    load_config_or_exit,
    print_json_last,
    warn_failures,
)
from posttrain.config import (
    ConfigError,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    load_config,
    save_config,
)


def train(
    config: str = typer.Argument(None, help="YAML config; omit for the embedded default"),
    set_: list[str] = typer.Option(None, "--set", help="override, e.g. --set trainer.lr=1e-5"),
    name: str = typer.Option(None, "--name", help="run name (directory under telemetry.run_dir)"),
    resume: str = typer.Option(None, "--resume", help="continue the run in this directory"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing run directory"),
    no_progress: bool = typer.Option(False, "--no-progress", help="no live progress display"),
) -> None:
    """Run RL post-training (the default: the 135M model, GRPO, a mix of domains, ~10 CPU minutes)."""
    from posttrain.models import ModelNotFoundError
    from posttrain.orchestrator.checkpoint import CheckpointError
    from posttrain.orchestrator.eval.export import save_hf_folder
    from posttrain.orchestrator.rl import RLRun
    from posttrain.orchestrator.rl.guard import RunFailure
    from posttrain.telemetry.rundir import RunDir, check_run_name

    if name is not None:
        try:
            check_run_name(name)
        except ValueError as err:
            fail(f"--name: {err}", EXIT_USAGE)
    if resume:
        try:
            run = RunDir.open(resume)
            saved = load_config(run.config)
        except ConfigError as err:
            if err.moved:  # a run saved before those keys were renamed
                renames = ", ".join(f"{old} -> {new}" for old, new in err.moved.items())
                fail(
                    f"cannot resume the run: {run.config} was written before these keys were renamed; rename them "
                    f"there (values unchanged) and resume again: {renames}",
                    EXIT_USAGE,
                )
            fail(str(err), EXIT_USAGE)
        except FileNotFoundError as err:
            fail(str(err), EXIT_USAGE)
        try:
            cfg = config_from_dict(apply_overrides(config_to_dict(saved), set_ or [])) if set_ else saved
        except ConfigError as err:
            fail(str(err), EXIT_USAGE)
        try:
            RLRun.check(cfg)
        except (ValueError, KeyError, ModelNotFoundError) as err:
            fail(f"cannot resume the run: {err}", EXIT_USAGE)
    else:
        cfg = load_config_or_exit(config, set_)
        try:
            RLRun.check(cfg)
        except (ValueError, KeyError, ModelNotFoundError) as err:
            fail(f"cannot start the run: {err}", EXIT_USAGE)
        try:
            run = RunDir.create(cfg.telemetry.run_dir, name or cfg.telemetry.name, overwrite=overwrite)
        except (FileExistsError, ValueError) as err:
            fail(str(err), EXIT_USAGE)
        save_config(cfg, run.config)
    rl = RLRun(cfg, run, show_progress=not no_progress and cfg.telemetry.progress)
    try:
        try:
            rl.build()
        except (ValueError, KeyError, ModelNotFoundError) as err:
            fail(f"cannot start the run: {err}", EXIT_USAGE)
        if resume:
            try:
                for warning in rl.load():
                    err_console.print(f"[yellow]warning:[/] {escape(warning)}")
            except CheckpointError as err:
                fail(str(err), EXIT_RUNTIME)
            console.print(f"resumed {run.path} at step {rl.step}")
        try:
            summary = rl.train()
        except RunFailure as err:  # a guard stopped it: a user error (2) or nothing left to train on (1)
            fail(str(err), err.exit_code)
    finally:
        rl.close()
    if summary["interrupted"]:
        sig = summary["signal"]
        console.print(
            f"stopped by signal {sig} at step {summary['step']}; checkpoint saved; resume with --resume {run.path}"
        )
        raise typer.Exit(128 + int(sig))
    if summary["stopped"]:
        best = run.checkpoints / "best"
        kept = (
            f"the checkpoint from before it is {best}" if best.is_dir() else "no earlier checkpoint to keep"
        )
        err_console.print(f"stopped at step {summary['step']}: {escape(summary['stopped'])}; {kept}")
        raise typer.Exit(EXIT_RUNTIME)
    save_hf_folder(rl.learner.weights(), cfg.model.spec, run.path / "policy")
    budget = f" (token budget of {cfg.orchestrator.token_budget} reached)" if summary["budget_spent"] else ""
    console.print(
        f"done: {summary['step']} steps, {summary['generated_tokens']:.0f} generated tokens{budget}; "
        f"policy at {run.path / 'policy'}; metrics in {run.metrics}"
    )


def eval_(
    model: str = typer.Argument(None, help="model spec, HF folder or run directory (omit with --api-base)"),
    baseline: str = typer.Option(None, "--baseline", help="compare against this model on the same tasks"),
    suite: str = typer.Option(None, "--suite", help="comma-separated domains (default: the run's domains)"),
    n: int = typer.Option(
        None,
        "--n",
        help="distinct held-out tasks per domain and difficulty (a small space gives fewer; the table says how many)",
    ),
    config: str = typer.Option(None, "--config", help="config for domains/engine when MODEL is not a run"),
    set_: list[str] = typer.Option(None, "--set", help="config override"),
    api_base: str = typer.Option(None, "--api-base", help="score an OpenAI-compatible server instead"),
    api_model: str = typer.Option(None, "--model", help="model name at --api-base"),
    api_key: str = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY"),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy; > 0 = sampled pass@1"),
    samples: int = typer.Option(4, "--samples", min=1, help="samples per task when --temperature > 0"),
    pass_at_: str = typer.Option(
        None, "--pass-at", help="unbiased pass@k for these k, e.g. 1,4,16 (needs --samples >= max k)"
    ),
    lengths: str = typer.Option(
        None, "--lengths", help="long-context domains: a table per task and length, e.g. 1k,2k,4k,8k"
    ),
    threshold: list[float] = typer.Option(
        None, "--threshold", help="with --lengths: effective-length threshold in percent (repeatable; 85.6)"
    ),
    json_out: bool = typer.Option(False, "--json", help="print a JSON object last"),
) -> None:
    """Held-out strict accuracy per domain with 95% bootstrap intervals, mean shaped reward and its
    components, optional pass@k; paired delta against --baseline. With --lengths: per task and length,
    the task average and the effective length (RULER's definition)."""
    from posttrain.models import ModelNotFoundError
    from posttrain.orchestrator.eval.evaluate import (
        ACCURACY_DEFINITION,
        check_pass_at,
        evaluate_api,
        evaluate_local,
        paired_delta,
        parse_pass_at,
    )
    from posttrain.rollout import EpisodeLimits
    from posttrain.sandbox import SandboxUnavailable, make_sandbox

    per_task_samples = 1 if temperature == 0.0 else samples
    try:
        pass_at = parse_pass_at(pass_at_) if pass_at_ else []
        check_pass_at(pass_at, per_task_samples)
        levels, thresholds = _length_options(lengths, threshold, baseline, pass_at)
    except ValueError as err:
        fail(str(err), EXIT_USAGE)
    run_dir: Path | None = None
    if model and (Path(model) / "config.yaml").is_file():
        run_dir = Path(model)
        try:
            cfg = load_config(run_dir / "config.yaml", set_ or [])
        except ConfigError as err:
            fail(str(err), EXIT_USAGE)
        policy = run_dir / "policy"
        if not (policy / "config.json").is_file():
            from posttrain.orchestrator.eval.export import export_run

            export_run(run_dir, policy)
        model_spec = str(policy)
    else:
        cfg = load_config_or_exit(config, set_)
        model_spec = model
    if not model_spec and not api_base:
        fail("give a MODEL (spec, HF folder or run directory) or --api-base URL --model NAME", EXIT_USAGE)
    if api_base and not api_model:
        fail("--api-base needs --model NAME", EXIT_USAGE)
    n = n or cfg.orchestrator.eval_n
    try:
        from posttrain.orchestrator.eval.evaluate import eval_arms

        domains, arms = eval_arms(cfg, suite)
    except (KeyError, ValueError) as err:
        fail(str(err), EXIT_USAGE)
    sandbox = None
    if any(getattr(d, "requires_sandbox", False) for d in domains.values()):
        try:
            sandbox = make_sandbox(cfg.sandbox)
        except (SandboxUnavailable, ValueError) as err:
            fail(f"cannot start the sandbox for {', '.join(sorted(domains))}: {err}", EXIT_USAGE)
    if levels:
        from posttrain.cli.length_eval_cmd import eval_lengths

        api = (api_base, api_model, api_key) if api_base else None
        try:
            by_length = eval_lengths(
                model_spec, api, cfg, domains, levels, thresholds, n, sandbox, temperature, samples
            )
        except ValueError as err:
            fail(str(err), EXIT_USAGE)
        except ModelNotFoundError as err:
            fail(str(err), EXIT_USAGE)
        finally:
            if sandbox is not None:
                asyncio.run(sandbox.close())
        if run_dir is not None:
            (run_dir / "eval_lengths.json").write_text(json.dumps(by_length, indent=1))
        if json_out:
            print_json_last(by_length)
        return
    try:
        reports = []
        if api_base:
            limits = EpisodeLimits(cfg.envs.max_turns, cfg.envs.max_episode_tokens, cfg.engine.max_new_tokens)
            reports.append(
                evaluate_api(
                    api_base,
                    api_model,
                    domains,
                    arms,
                    n,
                    limits,
                    cfg.seed,
                    api_key,
                    temperature=temperature,
                    samples=samples,
                    sandbox=sandbox,
                    pass_at=pass_at,
                )
            )
        else:
            reports.append(
                evaluate_local(
                    model_spec, cfg, domains, arms, n, cfg.seed, sandbox, temperature, samples, pass_at
                )
            )
        if baseline:
            reports.append(
                evaluate_local(
                    baseline, cfg, domains, arms, n, cfg.seed, sandbox, temperature, samples, pass_at
                )
            )
    except ModelNotFoundError as err:
        fail(str(err), EXIT_USAGE)
    finally:
        if sandbox is not None:
            asyncio.run(sandbox.close())
    for rep in reports:
        where = api_base if rep is reports[0] and api_base else f"our engine on {rep.model}"
        warn_failures(rep.failures, f"the infrastructure level in {where} (not scored)")
    unscored = [r.model for r in reports if not any(d.get("n") for d in r.per_domain.values())]
    delta = paired_delta(reports[0], reports[1], cfg.seed, pass_at) if baseline else None
    if not unscored:
        console.print(_eval_table(reports, delta, pass_at))
    result: dict[str, Any] = {
        "model": reports[0].model,
        "accuracy_definition": ACCURACY_DEFINITION,
        "per_domain": reports[0].per_domain,
        "n_per_arm": n,
        "temperature": temperature,
        "samples_per_task": per_task_samples,
        "pass_at_k": pass_at,
    }
    if delta:
        result.update(
            {
                "baseline": reports[1].model,
                "baseline_per_domain": reports[1].per_domain,
                "delta_per_domain": delta["per_domain"],
                "delta": delta["delta"],
                "ci_low": delta["ci_low"],
                "ci_high": delta["ci_high"],
                "n_tasks": delta["n_tasks"],
            }
        )
        if pass_at:
            result["delta_pass_at"] = delta["pass_at"]
    if run_dir is not None and not unscored:
        from posttrain.orchestrator.rl.retention import last_figures
        from posttrain.telemetry import RunDir, read_metrics

        metrics = RunDir.open(run_dir).metrics
        result.update(last_figures(read_metrics(metrics) if metrics.exists() else []))
        (run_dir / "eval.json").write_text(json.dumps(result, indent=1))
    if json_out:
        print_json_last(result)
    if unscored:  # a CI gate must not pass on an empty table
        first = next((f for r in reports for f in r.failures), "")
        fail(
            f"nothing was scored for {', '.join(unscored)}: every episode failed"
            + (f" (the first: {first})" if first else "")
        )


def _length_options(
    lengths: str | None, threshold: list[float] | None, baseline: str | None, pass_at: list[int]
) -> tuple[list[int], list[float]]:
    """The length levels and thresholds of `eval --lengths` ([] when not given); ValueError naming the
    option for what does not go with it."""
    from posttrain.envs.domains.longctx_common import length_levels
    from posttrain.orchestrator.eval.length_eval import RULER_THRESHOLD

    if not lengths:
        if threshold:
            raise ValueError("--threshold goes with --lengths (the effective length of long-context domains)")
        return [], []
    if baseline or pass_at:
        raise ValueError("--lengths does not take --baseline or --pass-at (one model, strict accuracy)")
    thresholds = list(threshold) if threshold else [RULER_THRESHOLD]
    if any(not 0.0 <= t < 100.0 for t in thresholds):
        raise ValueError(f"--threshold is a percentage in [0, 100), got {thresholds}")
    return length_levels(lengths), thresholds


def _eval_table(reports: list[Any], delta: dict[str, Any] | None, pass_at: list[int]) -> Table:
    """One row per domain and figure: strict accuracy and pass@k with intervals (and the paired delta),
    then the mean shaped reward and its components, which are not accuracy."""

    def ci(v: float, lo: float, hi: float, sign: str = "") -> str:
        return f"{v:{sign}.3f} [{lo:{sign}.3f}, {hi:{sign}.3f}]"

    table = Table(
        "domain", "figure", *[r.model[-40:] for r in reports], *(["delta [95% CI]"] if delta else [])
    )
    for dom in reports[0].per_domain:
        rows: list[tuple[str, list[str], str]] = []
        cells = []
        for r in reports:
            d = r.per_domain.get(dom, {})
            cells.append(f"{ci(d['accuracy'], d['ci_low'], d['ci_high'])} n={d['n']}" if d else "")
        dd = delta["per_domain"][dom] if delta else None
        rows.append(
            ("accuracy (strict)", cells, ci(dd["delta"], dd["ci_low"], dd["ci_high"], "+") if dd else "")
        )
        for k in pass_at:
            cells = []
            for r in reports:
                p = r.per_domain.get(dom, {}).get("pass_at", {}).get(str(k))
                cells.append(f"{ci(p['value'], p['ci_low'], p['ci_high'])} n={p['n']}" if p else "")
            pd = dd["pass_at"][str(k)] if dd else None
            rows.append((f"pass@{k}", cells, ci(pd["delta"], pd["ci_low"], pd["ci_high"], "+") if pd else ""))
        shaped = [r.per_domain.get(dom, {}) for r in reports]
        if any("mean_reward" in d for d in shaped):
            rows.append(
                (
                    "mean reward (shaped)",
                    [f"{d['mean_reward']:.3f}" if "mean_reward" in d else "" for d in shaped],
                    "",
                )
            )
        for name in sorted({c for d in shaped for c in d.get("mean_components", {})}):
            cells = []
            for d in shaped:
                c = d.get("components", {}).get(name)
                cells.append(f"{ci(c['value'], c['ci_low'], c['ci_high'])} n={c['n']}" if c else "")
            cd = dd.get("components", {}).get(name) if dd else None
            rows.append(
                (f"mean {name}", cells, ci(cd["delta"], cd["ci_low"], cd["ci_high"], "+") if cd else "")
            )
        for i, (figure, cells, change) in enumerate(rows):
            table.add_row(dom if i == 0 else "", figure, *cells, *([change] if delta else []))
    if delta:
        blank = [""] * len(reports)
        table.add_row(
            "all", "accuracy (strict)", *blank, ci(delta["delta"], delta["ci_low"], delta["ci_high"], "+")
        )
        for k in pass_at:
            pd = delta["pass_at"][str(k)]
            table.add_row("all", f"pass@{k}", *blank, ci(pd["delta"], pd["ci_low"], pd["ci_high"], "+"))
    return table


def export(
    run_dir: str = typer.Argument(..., help="a run directory"),
    out: str = typer.Option(..., "--out", help="destination folder"),
) -> None:
    """Export the trained policy as a Hugging Face folder (LoRA merged, tokenizer and chat template included)."""
    from posttrain.orchestrator.checkpoint import CheckpointError
    from posttrain.orchestrator.eval.export import export_run

    try:
        path = export_run(run_dir, out)
    except (FileNotFoundError, ConfigError) as err:
        fail(str(err), EXIT_USAGE)
    except CheckpointError as err:
        fail(str(err), EXIT_RUNTIME)
    console.print(f"exported to {path}")


def report(run_dir: str = typer.Argument(..., help="a run directory")) -> None:
    """Write an HTML report with PNG plots for a run (RUN_DIR/report/index.html)."""
    from posttrain.telemetry.report import write_report

    try:
        path = write_report(run_dir)
    except FileNotFoundError as err:
        fail(str(err), EXIT_USAGE)
    console.print(f"report: {path}")


def register(app: typer.Typer) -> None:
    app.command("train")(train)
    app.command("eval")(eval_)
    app.command("export")(export)
    app.command("report")(report)
