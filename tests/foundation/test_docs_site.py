"""The docs site: it builds with `mkdocs build --strict` (broken links, anchors and pages left out of the
nav fail), its generated references hold what the code says, and every `posttrain ...` command in a
docs page names real subcommands and real options."""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer

from posttrain.cli import app

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SHELL_FENCES = {"", "bash", "sh", "shell", "console", "text"}
STOP_TOKENS = {"&&", "||", "|", ";", "&", ">", ">>", "2>&1"}


def test_docs_build_strictly_with_generated_references(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert "posttrain config show" in cli and "--describe" in cli
    config = (site / "reference" / "config" / "index.html").read_text()
    assert "envs.max_turns" in config and "assistant turns per episode" in config


def shell_lines(text: str) -> list[str]:
    """The lines of the page's shell-like fenced blocks, backslash continuations joined."""
    lines, fence, pending = [], None, ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip().lower()
            continue
        if fence is None or fence not in SHELL_FENCES:
            continue
        line = pending + stripped
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        lines.append(line.removeprefix("$ "))
    return lines


def posttrain_commands(text: str) -> list[list[str]]:
    """Each `posttrain ...` invocation of a page's shell blocks and inline code spans as tokens, up to a
    pipe, `&&`, `;` or a comment; `[--opt ...]` brackets of usage lines dropped."""
    out = []
    inline = re.findall(r"(?<!`)`(posttrain [^`\n]+)`(?!`)", text)
    for line in shell_lines(text) + inline:
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            tokens = line.split()
        for start, tok in enumerate(tokens):
            if tok != "posttrain" and not tok.endswith("/posttrain"):
                continue
            cmd = ["posttrain"]
            for tok in tokens[start + 1 :]:
                if tok in STOP_TOKENS or tok.startswith(("|", ">")):
                    break
                cmd.append(tok.strip("[]"))
            out.append(cmd)
    return out


@functools.cache
def root_command() -> Any:
    return typer.main.get_command(app)


def check_command(tokens: list[str]) -> str | None:
    """None when `tokens` (`posttrain ...`) names real subcommands and options, else what is wrong."""
    cmd = root_command()
    path = ["posttrain"]
    i = 1
    while i < len(tokens):
        tok = tokens[i]
        options = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")}
        if tok.startswith("--"):
            name = tok.split("=", 1)[0]
            if name != "--help" and name not in options:
                return f"`{' '.join(path)}` has no option {name}"
            takes_value = any(name in p.opts and not getattr(p, "is_flag", False) for p in cmd.params)
            i += 1 if "=" in tok or not takes_value else 2
            continue
        commands = getattr(cmd, "commands", None)
        if commands is not None:
            alternatives = tok.split("|")  # usage lines: `posttrain tasks list|sample|check`
            missing = [a for a in alternatives if a not in commands]
            if missing:
                return f"`{' '.join(path)}` has no subcommand {missing[0]!r}"
            cmd = commands[alternatives[0]]
            path.append(alternatives[0])
        i += 1
    return None


PAGES = sorted(DOCS.rglob("*.md"))


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_every_posttrain_command_in_the_docs_is_real(page):
    problems = [
        f"{' '.join(tokens)}: {why}"
        for tokens in posttrain_commands(page.read_text())
        if (why := check_command(tokens)) is not None
    ]
    assert problems == []


def test_the_command_checker_catches_a_wrong_subcommand_and_option():
    assert check_command(["posttrain", "train", "--set", "a=1", "--name", "x"]) is None
    assert check_command(["posttrain", "--plugin", "p.py", "tasks", "check", "d"]) is None
    assert check_command(["posttrain", "config", "show", "--describe"]) is None
    assert check_command(["posttrain", "trian"]) == "`posttrain` has no subcommand 'trian'"
    assert (
        check_command(["posttrain", "eval", "runs/x", "--samplez", "4"])
        == "`posttrain eval` has no option --samplez"
    )
    assert check_command(["posttrain", "bench", "rl", "--steps", "2", "--no-trl"]) is None
    assert check_command(["posttrain", "tasks", "list|sample"]) is None
    assert (
        check_command(["posttrain", "tasks", "list|smaple"]) == "`posttrain tasks` has no subcommand 'smaple'"
    )
    assert check_command(["posttrain", "serve", "--model", "m"]) == "`posttrain serve` has no option --model"
    assert posttrain_commands("```bash\nposttrain serve m \\\n  --port 1 | grep x  # posttrain c\n```") == [
        ["posttrain", "serve", "m", "--port", "1"]
    ]
