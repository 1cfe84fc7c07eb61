"""CLI: every subcommand has --help; bad config paths and overrides exit 2 with a clear message."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from posttrain import __version__
from posttrain.cli import app

runner = CliRunner()

SUBCOMMANDS = ["train", "eval", "export", "serve", "sandbox", "tasks", "bench", "report", "config", "models"]


def test_top_level_help_lists_every_subcommand():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in SUBCOMMANDS:
        assert name in result.output


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_subcommand_help(name):
    result = runner.invoke(app, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"posttrain {__version__}"


def test_bad_config_path_exits_2():
    result = runner.invoke(app, ["config", "show", "/nonexistent/run.yaml"])
    assert result.exit_code == 2
    assert "config file not found: /nonexistent/run.yaml" in result.output


def test_bad_override_exits_2_with_suggestion():
    result = runner.invoke(app, ["config", "show", "--set", "algorithm.clip_hgh=0.3"])
    assert result.exit_code == 2
    assert "did you mean 'algorithm.clip_high'" in result.output


def test_train_bad_override_fails_before_work():
    result = runner.invoke(app, ["train", "--set", "orchestrator.steps=-1"])
    assert result.exit_code == 2
    assert "orchestrator.steps" in result.output


def test_unknown_benchmark_exits_2():
    result = runner.invoke(app, ["bench", "nope"])
    assert result.exit_code == 2 and "unknown benchmark 'nope'" in result.output


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "posttrain", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"posttrain {__version__}"
