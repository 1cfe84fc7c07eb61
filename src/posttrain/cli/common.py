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
console = Console(soft_wrap=True, emoji=False, width=None if sys.stdout.isatty() else PIPED_WIDTH)
err_console = Console(
    stderr=True, soft_wrap=True, emoji=False, width=None if sys.stderr.isatty() else PIPED_WIDTH
)


def fail(message: str, code: int = EXIT_RUNTIME) -> NoReturn:
    """Print `error: MESSAGE` (as written: square brackets are not markup) and exit with `code`."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    raise typer.Exit(code)


def load_config_or_exit(path: str | None, overrides: list[str] | None) -> RunConfig:
    try:
        return load_config(path, overrides or [])
    except ConfigError as err:
        fail(str(err), EXIT_USAGE)


def warn_failures(failures: list[str], where: str) -> None:
    """Say on stderr how many episodes failed at `where` and why the first did (they are left out of the
    figures, so a table alone would hide them)."""
    if failures:
        err_console.print(
            f"[yellow]{len(failures)} episode(s) failed at {escape(where)}, e.g. {escape(failures[0])}[/yellow]"
        )


def print_json_last(obj: Any) -> None:
    """The benchmark/eval contract: one JSON object on the last line of stdout."""
    print(json.dumps(obj, default=lambda v: v.item() if hasattr(v, "item") else str(v)), flush=True)


def source_sets(
    section: str, data: str | None, from_env: str | None, levels: str | None, n: int | None
) -> list[str]:
    """The `section.*` overrides of the --data / --from-env / --levels / --n options that `sft`, `rm train`
    and `dpo` share (exits 2 on bad ones)."""
    if data is not None and from_env is not None:
        fail("give --data FILE.jsonl or --from-env DOMAIN, not both", EXIT_USAGE)
    sets = []
    if data is not None:
        sets += [f"{section}.data={data}", f"{section}.from_env=null"]
    if from_env is not None:
        sets += [f"{section}.from_env={from_env}", f"{section}.data=null"]
    if levels is not None:
        try:
            parsed = [int(x) for x in levels.split(",") if x.strip()]
        except ValueError:
            fail(f"--levels must be comma-separated integers, e.g. 0,1; got {levels!r}", EXIT_USAGE)
        sets.append(f"{section}.levels={parsed}")
    if n is not None:
        sets.append(f"{section}.n={n}")
    return sets
