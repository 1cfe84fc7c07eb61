"""`posttrain train | eval | export | report` — the RL loop's commands."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from posttrain.cli.common import (
    EXIT_RUNTIME,
    EXIT_USAGE,
    console,
    err_console,
    fail,
    load_config_or_exit,
    print_json_last,
)
from posttrain.config import (
    ConfigError,
    RunConfig,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    load_config,
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
    from posttrain.orchestrator import CheckpointError, RLRun
    from posttrain.orchestrator.export import save_hf_folder
    from posttrain.telemetry import RunDir

    if resume:
        try:
            run = RunDir.open(resume)
            saved = load_config(run.config)
            cfg = config_from_dict(apply_overrides(config_to_dict(saved), set_ or [])) if set_ else saved
        except (FileNotFoundError, ConfigError) as err:
            fail(str(err), EXIT_USAGE)
    else:
        cfg = load_config_or_exit(config, set_)
        try:
            RLRun.check(cfg)
        except (ValueError, KeyError, ModelNotFoundError) as err:
            fail(f"cannot start the run: {err}", EXIT_USAGE)
        try:
            run = RunDir.create(cfg.telemetry.run_dir, name or cfg.telemetry.name, overwrite=overwrite)
        except FileExistsError as err:
            fail(str(err), EXIT_USAGE)
        from posttrain.config import save_config

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
                    err_console.print(f"[yellow]warning:[/] {warning}")
            except CheckpointError as err:
                fail(str(err), EXIT_RUNTIME)
            console.print(f"resumed {run.path} at step {rl.step}")
        summary = rl.train()
    finally:
        rl.close()
    if summary["interrupted"]:
        sig = summary["signal"]
        console.print(f"stopped by signal {sig} at step {summary['step']}; checkpoint saved; resume with --resume {run.path}")
        raise typer.Exit(128 + int(sig))
    save_hf_folder(rl.learner.weights(), cfg.model.spec, run.path / "policy")
    budget = f" (token budget of {cfg.orchestrator.token_budget} reached)" if summary["budget_spent"] else ""
    console.print(
        f"done: {summary['step']} steps, {summary['generated_tokens']:.0f} generated tokens{budget}; "
        f"policy at {run.path / 'policy'}; metrics in {run.metrics}"
    )


def _arms_for(cfg: RunConfig, suite: str | None) -> tuple[dict[str, Any], list[Any]]:
    from posttrain.curriculum import Arm
    from posttrain.envs import get_domain

    wanted = [s.strip() for s in suite.split(",")] if suite else None
    domains: dict[str, Any] = {}
    arms: list[Any] = []
    configured = {d.name: d for d in cfg.envs.domains}
    for name in wanted or list(configured):
        d = configured.get(name)
        domain = get_domain(name, **(d.options if d else {}))
        domains[name] = domain
        for lvl in d.difficulties if d else domain.difficulties[:1]:
            arms.append(Arm(name, lvl))
    return domains, arms


def eval_(
    model: str = typer.Argument(None, help="model spec, HF folder or run directory (omit with --api-base)"),
    baseline: str = typer.Option(None, "--baseline", help="compare against this model on the same tasks"),
    suite: str = typer.Option(None, "--suite", help="comma-separated domains (default: the run's domains)"),
    n: int = typer.Option(None, "--n", help="held-out tasks per domain and difficulty"),
    config: str = typer.Option(None, "--config", help="config for domains/engine when MODEL is not a run"),
    set_: list[str] = typer.Option(None, "--set", help="config override"),
    api_base: str = typer.Option(None, "--api-base", help="score an OpenAI-compatible server instead"),
    api_model: str = typer.Option(None, "--model", help="model name at --api-base"),
    api_key: str = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY"),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy; > 0 = sampled pass@1"),
    samples: int = typer.Option(4, "--samples", min=1, help="samples per task when --temperature > 0"),
    json_out: bool = typer.Option(False, "--json", help="print a JSON object last"),
) -> None:
    """Held-out accuracy per domain with 95% bootstrap intervals; paired delta against --baseline."""
    from posttrain.models import ModelNotFoundError
    from posttrain.orchestrator.evaluate import evaluate_api, evaluate_local, paired_delta
    from posttrain.rollout import EpisodeLimits
    from posttrain.sandbox import make_sandbox

    run_dir: Path | None = None
    if model and (Path(model) / "config.yaml").is_file():
        run_dir = Path(model)
        try:
            cfg = load_config(run_dir / "config.yaml", set_ or [])
        except ConfigError as err:
            fail(str(err), EXIT_USAGE)
        policy = run_dir / "policy"
        if not (policy / "config.json").is_file():
            from posttrain.orchestrator.export import export_run

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
        domains, arms = _arms_for(cfg, suite)
    except (KeyError, ValueError) as err:
        fail(str(err), EXIT_USAGE)
    sandbox = make_sandbox(cfg.sandbox)
    try:
        reports = []
        if api_base:
            limits = EpisodeLimits(cfg.envs.max_turns, cfg.envs.max_episode_tokens, cfg.engine.max_new_tokens)
            reports.append(
                evaluate_api(api_base, api_model, domains, arms, n, limits, cfg.seed, api_key, temperature=temperature, samples=samples)
            )
            if reports[-1].failures:
                err_console.print(
                    f"[yellow]{len(reports[-1].failures)} episode(s) failed at {api_base}, e.g. {reports[-1].failures[0]}[/yellow]"
                )
        else:
            reports.append(evaluate_local(model_spec, cfg, domains, arms, n, cfg.seed, sandbox, temperature, samples))
        if baseline:
            reports.append(evaluate_local(baseline, cfg, domains, arms, n, cfg.seed, sandbox, temperature, samples))
    except ModelNotFoundError as err:
        fail(str(err), EXIT_USAGE)
    finally:
        asyncio.run(sandbox.close())
    table = Table("domain", *[f"{r.model[-40:]}" for r in reports], *(["delta [95% CI]"] if baseline else []))
    delta = paired_delta(reports[0], reports[1], cfg.seed) if baseline else None
    for dom in reports[0].per_domain:
        cells = []
        for r in reports:
            d = r.per_domain[dom]
            cells.append(f"{d['accuracy']:.3f} [{d['ci_low']:.3f}, {d['ci_high']:.3f}] n={d['n']}")
        if delta:
            dd = delta["per_domain"][dom]
            cells.append(f"{dd['delta']:+.3f} [{dd['ci_low']:+.3f}, {dd['ci_high']:+.3f}]")
        table.add_row(dom, *cells)
    if delta:
        table.add_row("all", *[""] * len(reports), f"{delta['delta']:+.3f} [{delta['ci_low']:+.3f}, {delta['ci_high']:+.3f}]")
    console.print(table)
    result: dict[str, Any] = {
        "model": reports[0].model,
        "per_domain": reports[0].per_domain,
        "n_per_arm": n,
        "temperature": temperature,
        "samples_per_task": 1 if temperature == 0.0 else samples,
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
    if run_dir is not None:
        (run_dir / "eval.json").write_text(json.dumps(result, indent=1))
    if json_out:
        print_json_last(result)


def export(
    run_dir: str = typer.Argument(..., help="a run directory"),
    out: str = typer.Option(..., "--out", help="destination folder"),
) -> None:
    """Export the trained policy as a Hugging Face folder (LoRA merged, tokenizer and chat template included)."""
    from posttrain.orchestrator import CheckpointError
    from posttrain.orchestrator.export import export_run

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



