"""The docs site's generated reference pages: the CLI reference from the typer app (every command's
`--help`) and the config reference from the pydantic fields (posttrain.config_reference). The mkdocs hook
(scripts/mkdocs_hooks.py) builds them at every `mkdocs build`, so they cannot drift from the code;
`python scripts/docs_reference.py OUT_DIR` writes them as files to read or diff."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

HELP_WIDTH = 100


def _commands(cmd: Any, ctx: Any) -> list[tuple[Any, Any]]:
    """(context, command) of `cmd` and every subcommand, depth first, in the order `--help` lists them.
    Typed loosely: typer builds on its own copy of click's classes."""
    out = [(ctx, cmd)]
    if hasattr(cmd, "list_commands"):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is None or sub.hidden:
                continue
            sub_ctx = sub.context_class(sub, info_name=name, parent=ctx, max_content_width=HELP_WIDTH)
            out.extend(_commands(sub, sub_ctx))
    return out


def cli_reference_md() -> str:
    """Markdown: one section per command path (`posttrain train`, `posttrain bench rl`, ...) holding its
    `--help` text."""
    from posttrain.cli import app

    root = typer.main.get_command(app)
    root_ctx = root.context_class(
        root, info_name="posttrain", max_content_width=HELP_WIDTH, terminal_width=HELP_WIDTH
    )
    parts = [
        "# CLI reference\n",
        "Generated from the typer app at every docs build (`scripts/docs_reference.py`): each section is the "
        "command's `--help`. Exit codes everywhere: 0 ok, 2 usage or config error, 1 runtime failure "
        "(`agent ci-fix`: 3 not fixed).\n",
    ]
    for ctx, cmd in _commands(root, root_ctx):
        path = ctx.command_path
        level = min(2 + path.count(" "), 4)
        parts.append(f"{'#' * level} `{path}`\n")
        with ctx:
            help_text = cmd.get_help(ctx)
        parts.append(f"```text\n{help_text.rstrip()}\n```\n")
    return "\n".join(parts)


def _escape_html(text: str) -> str:
    """`<` and `>` outside code spans as entities: `retention/<label>` must not read as an HTML tag."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # even parts lie outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def _cell(text: str) -> str:
    return _escape_html(text).replace("|", "\\|").replace("\n", " ")


def config_reference_md() -> str:
    """Markdown: one table per top-level section: key, type (with bounds), default, description."""
    from posttrain.config_reference import describe

    parts = [
        "# Config reference\n",
        "Generated from the pydantic fields of `posttrain/config.py` at every docs build "
        "(`scripts/docs_reference.py`); `posttrain config show --describe` prints the same listing, with "
        "the values a file and `--set` give. Set a key in YAML or with `--set section.key=value`; "
        "`[]` marks the keys of each item of a list (`envs.domains[].name`).\n",
    ]
    rows: list[str] = []

    def flush() -> None:
        if rows:
            parts.append(
                "| key | type | default | description |\n|---|---|---|---|\n" + "\n".join(rows) + "\n"
            )
            rows.clear()

    for doc in describe():
        if "." not in doc.key and doc.section:
            flush()
            parts.append(f"## `{doc.key}`\n")
            if doc.description:
                parts.append(_escape_html(doc.description) + "\n")
            continue
        default = "`" + doc.default.replace("|", "\\|") + "`" if doc.default else ""
        description = " ".join(doc.description.split()) if doc.section else doc.description
        rows.append(f"| `{doc.key}` | {_cell(doc.type)} | {default} | {_cell(description)} |")
    flush()
    return "\n".join(parts)


PAGES = {"reference/cli.md": cli_reference_md, "reference/config.md": config_reference_md}


def main(out_dir: str) -> None:
    for rel, make in PAGES.items():
        path = Path(out_dir) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(make(), encoding="utf-8")
        print(path)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "site-reference")
