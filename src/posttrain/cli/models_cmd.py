"""`posttrain models list|load`: what models are available locally, and how fast they load."""

from __future__ import annotations

import time

import typer
from rich.table import Table

from posttrain.cli.common import EXIT_USAGE, console, fail

app = typer.Typer(help="Models available on this machine.", no_args_is_help=True, rich_markup_mode=None)


@app.command("list")
def list_models() -> None:
    """Show the embedded default, the tiny test families and cached model folders."""
    from posttrain.models import list_local

    table = Table("spec", "kind", "location", "cached")
    for info in list_local():
        table.add_row(info.spec, info.kind, info.location, "yes" if info.cached else "no")
    console.print(table)


@app.command("load")
def load(spec: str = typer.Argument("smollm2-135m")) -> None:
    """Load a model (converting and caching the embedded default on first use) and report the time."""
    from posttrain.models import ModelNotFoundError, load_policy, load_tokenizer

    try:
        t0 = time.perf_counter()
        model = load_policy(spec)
        load_tokenizer(spec)
    except ModelNotFoundError as err:
        fail(str(err), EXIT_USAGE)
    n = sum(p.numel() for p in model.parameters())
    console.print(f"{spec}: {n / 1e6:.1f}M parameters loaded in {time.perf_counter() - t0:.2f} s")
