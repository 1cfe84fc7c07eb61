"""Shared CLI helpers: exit codes, error printing, config loading from CONFIG + --set."""

from __future__ import annotations

import json
from typing import Any, NoReturn

import typer
from rich.console import Console

from posttrain.config import ConfigError, RunConfig, load_config

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2

console = Console()
err_console = Console(stderr=True)


def fail(message: str, code: int = EXIT_RUNTIME) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
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
