"""`posttrain sandbox run|doctor|serve` (filled by the sandbox issue)."""

from __future__ import annotations

import typer

from posttrain.cli.common import not_yet_available

app = typer.Typer(help="Run untrusted code in the isolated sandbox.", no_args_is_help=True)


@app.command("doctor")
def doctor() -> None:
    """Report which isolation layers are active."""
    not_yet_available("`posttrain sandbox doctor`", "the sandbox issue")
