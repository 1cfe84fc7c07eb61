"""`posttrain config show FILE [--set k=v]`: print the resolved, validated config."""

from __future__ import annotations

import typer

from posttrain.cli.common import console, load_config_or_exit
from posttrain.config import config_to_yaml

app = typer.Typer(help="Inspect run configs.", no_args_is_help=True, rich_markup_mode=None)


@app.command("show")
def show(
    config: str = typer.Argument(None, help="YAML config file; omit for the defaults"),
    set_: list[str] = typer.Option(None, "--set", help="override, e.g. --set trainer.lr=1e-5"),
) -> None:
    """Print the resolved config (defaults + file + overrides) as YAML."""
    cfg = load_config_or_exit(config, set_)
    console.print(config_to_yaml(cfg), end="", highlight=False, markup=False)
