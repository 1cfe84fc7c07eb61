"""Shared CLI helpers: exit codes, error printing, config loading from CONFIG + --set."""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from posttrain.config import ConfigError, RunConfig, load_config

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2

# soft_wrap: long lines (code, tokens, URLs) are never broken; piped output is not cut to 80 columns
PIPED_WIDTH = 200
console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else PIPED_WIDTH)
err_console = Console(stderr=True, soft_wrap=True, width=None if sys.stderr.isatty() else PIPED_WIDTH)


def fail(message: str, code: int = EXIT_RUNTIME) -> NoReturn:
    """Print `error: MESSAGE` (as written: square brackets are not markup) and exit with `code`."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    raise typer.Exit(code)


def not_yet_available(what: str, issue: str) -> NoReturn:
    fail(f"{what} is not yet available in this version of posttrain ({issue})", EXIT_RUNTIME)


def load_config_or_exit(path: str | None, overrides: list[str] | None) -> RunConfig:
    try:
        return load_config(path, overrides or [])
    except ConfigError as err:
        fail(str(err), EXIT_USAGE)


def print_json_last(obj: Any) -> None:
    """The benchmark/eval contract: one JSON object on the last line of stdout."""
    print(json.dumps(obj, default=lambda v: v.item() if hasattr(v, "item") else str(v)), flush=True)
