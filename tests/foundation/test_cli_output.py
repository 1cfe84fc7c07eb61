"""The CLI tried as a new user would, with output piped: errors name the problem and keep square brackets,
long lines are never broken at 80 columns, a job's exit code is not confused with a usage error."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

POSTTRAIN = [sys.executable, "-m", "posttrain"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    return subprocess.run([*POSTTRAIN, *args], capture_output=True, text=True, timeout=120, env=env)


def test_errors_keep_square_brackets_and_name_the_option():
    out = _cli("tasks", "sample", "math", "--option", "datasets=nosuch")
    assert out.returncode == 2
    assert "'datasets' must be a list of reasoning-gym dataset names" in out.stderr
    assert "(e.g. datasets=[gcd])" in out.stderr
    helped = _cli("tasks", "sample", "--help")
    assert "datasets=[gcd]" in helped.stdout


def test_piped_output_is_not_wrapped_at_80_columns():
    out = _cli("tasks", "sample", "math", "--n", "1", "--option", "datasets=[letter_counting]")
    assert out.returncode == 0, out.stderr
    long_lines = [line for line in out.stdout.splitlines() if len(line) > 80]
    assert long_lines, "a letter_counting prompt is longer than 80 characters and must stay on one line"
    assert any(
        line.startswith("user: How many times does the letter") and line.endswith('"?') for line in long_lines
    )


@pytest.fixture()
def sandbox_available():
    from posttrain.sandbox import isolation

    if not isolation.detect().isolated:
        pytest.skip("no namespace isolation on this machine")


def test_sandbox_run_bad_inputs_are_usage_errors_without_tracebacks(tmp_path, sandbox_available):
    latin = tmp_path / "latin.py"
    latin.write_bytes(b'print("caf\xe9")\n')
    ok = tmp_path / "ok.py"
    ok.write_text("print('hi')\n")
    cases = [
        ((str(latin),), "is not UTF-8 text (byte 0xe9 at offset 10)"),
        ((str(ok), "--stdin", str(tmp_path / "missing.txt")), "no such --stdin file"),
        ((str(ok), "-l", "rust"), "unknown language 'rust'; --language is one of: python, bash, c, cpp"),
        ((str(ok), "--memory-mb", "1"), "--memory-mb"),
        ((str(tmp_path / "nope.py"),), "no such file"),
    ]
    for args, needle in cases:
        out = _cli("sandbox", "run", *args)
        assert out.returncode == 2, (args, out.stderr)
        assert needle in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)


def test_sandbox_run_exit_status_and_json_text(tmp_path, sandbox_available):
    exits2 = tmp_path / "exit2.py"
    exits2.write_text("import sys\nprint('bye')\nsys.exit(2)\n")
    out = _cli("sandbox", "run", str(exits2))
    assert out.returncode == 1 and out.stdout == "bye\n" and "exit=2" in out.stderr
    binary = tmp_path / "bin.py"
    binary.write_text(
        "import sys\nsys.stdout.buffer.write(b'ok\\n\\xff')\nprint('caf\\u00e9', file=sys.stderr)\n"
    )
    res = json.loads(_cli("sandbox", "run", str(binary), "--json").stdout.strip().splitlines()[-1])
    assert res["stdout"] is None and base64.b64decode(res["stdout_base64"]) == b"ok\n\xff"
    assert res["stderr"] == "caf\u00e9\n" and "stderr_base64" not in res
    text = json.loads(_cli("sandbox", "run", str(exits2), "--json").stdout.strip().splitlines()[-1])
    assert (text["stdout"], text["exit_code"]) == ("bye\n", 2)


def test_no_module_imports_an_upper_layer_and_packages_form_no_cycle():
    """Imports run downward only, in the layer order of shared/DESIGN.md; within a layer they form no cycle."""
    import ast

    order = [
        {"cli", "bench", "apps"},
        {"orchestrator", "serve"},
        {"rollout", "curriculum"},
        {"engine", "train", "envs", "longctx"},
        {"models", "sandbox"},
        {"algos", "config", "telemetry", "types"},
    ]
    rank = {pkg: i for i, layer in enumerate(order) for pkg in layer}
    root = Path(__file__).resolve().parents[2] / "src" / "posttrain"
    upward, edges = [], set()
    for path in root.rglob("*.py"):
        own = path.relative_to(root).parts[0].removesuffix(".py")
        if own not in rank:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module]
                if isinstance(node, ast.ImportFrom) and node.module
                else ([a.name for a in node.names] if isinstance(node, ast.Import) else [])
            )
            for name in names:
                parts = name.split(".")
                if parts[0] != "posttrain" or len(parts) < 2 or parts[1] not in rank or parts[1] == own:
                    continue
                edges.add((own, parts[1]))
                if rank[parts[1]] < rank[own]:
                    upward.append(f"{path.relative_to(root)} imports {name}")
    assert not upward, "\n".join(sorted(upward))
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(
            n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph.get(start, ())
        )

    cycles = sorted(f"{a} <-> {b}" for a, b in edges if reaches(b, a, {b}))
    assert not cycles, cycles
    assert ("bench", "cli") not in edges and not any(b == "bench" for a, b in edges if a != "cli")


def test_error_messages_keep_colon_pairs_as_written(capsys):
    """A model spec such as tiny:llama:x is printed as written, not with :llama: turned into an emoji."""
    import typer

    from posttrain.cli.common import fail

    with pytest.raises(typer.Exit) as exc:
        fail("no model tiny:llama:x (nor :smile:)", 2)
    assert exc.value.exit_code == 2
    assert "error: no model tiny:llama:x (nor :smile:)" in capsys.readouterr().err


def test_tasks_sample_shows_distinct_tasks():
    # math level 0 draws "Calculate 5 + 3." at indices 0 and 1 with seed 0: the repeat is skipped
    out = _cli("tasks", "sample", "math", "--n", "3", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    ids = [r["task"]["id"] for r in rows]
    assert ids == ["math:train:d0:s0:0", "math:train:d0:s0:2", "math:train:d0:s0:3"]
    prompts = [r["task"]["prompt"][0]["content"] for r in rows]
    assert len(set(prompts)) == 3
