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
    assert result.exit_code == 2 and "No such command 'nope'" in result.output


def test_each_benchmark_is_a_command_with_its_own_documented_options():
    for name, option in [
        ("sandbox", "--skip-numpy"),
        ("engine", "--no-hf"),
        ("learner", "--grpo"),
        ("rl", "--async-lag"),
        ("curriculum", "--reuse-uniform"),
    ]:
        result = runner.invoke(app, ["bench", name, "--help"])
        assert result.exit_code == 0 and option in result.output and "--json" in result.output, name
    bad = runner.invoke(app, ["bench", "rl", "--mode", "later"])
    assert bad.exit_code == 2 and "'later' is not one of" in bad.output


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "posttrain", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"posttrain {__version__}"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("algorithm.advantage=grp", "did you mean 'grpo'?"),
        ("algorithm.policy_loss=gsop", "did you mean 'gspo'?"),
        ("curriculum.sampler=dumpp", "did you mean 'dump'?"),
        ("envs.domains=[{name: mathh}]", "did you mean 'math'?"),
    ],
)
def test_train_checks_registered_names_before_a_run_directory_exists(tmp_path, override, expected):
    root = tmp_path / "runs"
    result = runner.invoke(
        app,
        [
            "train",
            "--set",
            override,
            "--set",
            f"telemetry.run_dir={root}",
            "--set",
            "model.spec=tiny:llama",
            "--set",
            "orchestrator.steps=0",
            "--no-progress",
        ],
    )
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.split())
    assert not root.exists() or not any(root.iterdir())


@pytest.mark.parametrize("name", ["..", ".", "../victim", "a/b", ".hidden"])
def test_train_rejects_run_names_that_are_not_one_safe_component(tmp_path, name):
    root = tmp_path / "work" / "runs"
    root.mkdir(parents=True)
    keep = tmp_path / "work" / "precious.txt"
    keep.write_text("do not delete")
    (tmp_path / "victim").mkdir()
    result = runner.invoke(
        app,
        [
            "train",
            "--name",
            name,
            "--overwrite",
            "--set",
            f"telemetry.run_dir={root}",
            "--set",
            "model.spec=tiny:llama",
            "--set",
            "orchestrator.steps=0",
            "--no-progress",
        ],
    )
    assert result.exit_code == 2, result.output
    assert "is not allowed" in result.output and "--name" in result.output
    assert keep.read_text() == "do not delete" and (tmp_path / "victim").is_dir() and not any(root.iterdir())


def test_config_show_prints_the_batch_section():
    result = runner.invoke(app, ["config", "show", "--set", "batch.samples_per_prompt=2"])
    assert result.exit_code == 0, result.output
    block = result.output.split("\nbatch:\n", 1)[1].split("\n")[:5]
    assert block == [
        "  prompts_per_step: 4",
        "  samples_per_prompt: 2",
        "  mini_batches: 1",
        "  ppo_epochs: 1",
        "  micro_batch_tokens: 4096",
    ]


def test_resuming_a_run_saved_with_the_old_batch_keys_says_which_to_rename(tmp_path):
    import yaml

    from posttrain.config import config_to_dict, load_config

    run = tmp_path / "old-run"
    run.mkdir()
    data = config_to_dict(load_config(None, [f"telemetry.run_dir={tmp_path}"]))
    batch = data.pop("batch")
    data["algorithm"]["group_size"] = batch["samples_per_prompt"]
    data["orchestrator"]["tasks_per_step"] = batch["prompts_per_step"]
    (run / "config.yaml").write_text(yaml.safe_dump(data))
    result = runner.invoke(app, ["train", "--resume", str(run)])
    assert result.exit_code == 2, result.output
    out = " ".join(result.output.split())
    assert "cannot resume the run" in out and "rename them there (values unchanged)" in out
    assert "algorithm.group_size -> batch.samples_per_prompt" in out
    assert "orchestrator.tasks_per_step -> batch.prompts_per_step" in out
