"""`posttrain tasks list|sample|check` (filled by the environments issue)."""

from __future__ import annotations

import typer

from posttrain.cli.common import not_yet_available

app = typer.Typer(help="Task domains: list, sample, check reference solutions.", no_args_is_help=True)


@app.command("list")
def list_domains() -> None:
    """Show the domains and their difficulty levels."""
    not_yet_available("`posttrain tasks list`", "the environments issue")
