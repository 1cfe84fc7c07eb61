"""`posttrain config show FILE [--set k=v] [--describe]`: print the resolved, validated config, or every
key with its type, default and description."""

from __future__ import annotations

import typer

from posttrain.cli.common import console, load_config_or_exit
from posttrain.config import config_to_yaml

app = typer.Typer(help="Inspect run configs.", no_args_is_help=True, rich_markup_mode=None)


@app.command("show")
def show(
    config: str = typer.Argument(None, help="YAML config file; omit for the defaults"),
    set_: list[str] = typer.Option(None, "--set", help="override, e.g. --set trainer.lr=1e-5"),
    describe: bool = typer.Option(
        False,
        "--describe",
        help="every key with its type, bounds, default and description (and the resolved value where "
        "the file or --set changed it)",
    ),
) -> None:
    """Print the resolved config (defaults + file + overrides) as YAML, or with --describe each key."""
    cfg = load_config_or_exit(config, set_)
    if describe:
        from posttrain.config_reference import describe_text

        text = describe_text(cfg)
    else:
        text = config_to_yaml(cfg)
    console.print(text, end="", highlight=False, markup=False)
