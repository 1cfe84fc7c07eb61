"""`posttrain train | eval | export | report` — the RL loop's commands (filled by the RL-loop issue)."""

from __future__ import annotations

import typer

from posttrain.cli.common import load_config_or_exit, not_yet_available


def train(
    config: str = typer.Argument(None, help="YAML config; omit for the embedded default"),
    set_: list[str] = typer.Option(None, "--set", help="override, e.g. --set trainer.lr=1e-5"),
    name: str = typer.Option(None, "--name", help="run name (directory under telemetry.run_dir)"),
    resume: str = typer.Option(None, "--resume", help="continue the run in this directory"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing run directory"),
) -> None:
    """Run RL post-training."""
    load_config_or_exit(config, set_)
    not_yet_available("`posttrain train`", "the RL-loop issue")


def eval_(model: str = typer.Argument(..., help="model spec or run directory")) -> None:
    """Held-out accuracy per domain with bootstrap intervals."""
    not_yet_available("`posttrain eval`", "the RL-loop issue")


def export(run_dir: str = typer.Argument(...), out: str = typer.Option(..., "--out")) -> None:
    """Export the trained policy as a Hugging Face folder."""
    not_yet_available("`posttrain export`", "the RL-loop issue")


def report(run_dir: str = typer.Argument(...)) -> None:
    """Write an HTML report with plots for a run."""
    not_yet_available("`posttrain report`", "the RL-loop issue")


def register(app: typer.Typer) -> None:
    app.command("train")(train)
    app.command("eval")(eval_)
    app.command("export")(export)
    app.command("report")(report)
