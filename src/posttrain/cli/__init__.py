"""The `posttrain` command line: train | eval | export | serve | sft | rm | dpo | sandbox | tasks | bench |
report | config | models | agent | docs. Each group lives in its own module and imports heavy packages only when run."""

from __future__ import annotations

import importlib
import sys

import typer

from posttrain import __version__

app = typer.Typer(
    name="posttrain",
    help="Post-training language models with RL in executable environments.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help text is plain: square brackets in examples stay as written
)


def _version(value: bool) -> None:
    if value:
        print(f"posttrain {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="print the version"
    ),
    plugin: list[str] = typer.Option(
        [],
        "--plugin",
        metavar="FILE.py|MODULE",
        help="import a Python file or module that registers task domains (repeatable), before the command runs",
    ),
) -> None:
    if plugin:
        from posttrain.envs import load_plugin

        for target in plugin:
            try:
                load_plugin(target)
            except ValueError as err:
                typer.echo(f"error: {err}", err=True)
                raise typer.Exit(2) from None


def _add_group(module: str, name: str) -> None:
    mod = importlib.import_module(f"posttrain.cli.{module}")
    app.add_typer(mod.app, name=name)


def _add_commands(module: str) -> None:
    mod = importlib.import_module(f"posttrain.cli.{module}")
    mod.register(app)


_add_commands("run_cmds")  # train, eval, export, report
_add_commands("serve_cmd")
_add_commands("sft_cmd")  # sft
_add_commands("rm_cmd")  # rm train | rm serve
_add_commands("dpo_cmd")  # dpo
_add_group("sandbox_cmd", "sandbox")
_add_group("tasks_cmd", "tasks")
_add_group("config_cmd", "config")
_add_group("models_cmd", "models")
_add_group("bench", "bench")
_add_group("agent_cmd", "agent")  # agent ci-fix
_add_group("docs_cmd", "docs")  # docs ingest | worker | status | query | export | report | demo


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
