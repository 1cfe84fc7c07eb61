"""`posttrain config show --describe` and the config reference it shares with the docs site: each key's
type, bounds, default and description come from the pydantic fields."""

from __future__ import annotations

from typer.testing import CliRunner

from posttrain.cli import app
from posttrain.config import RunConfig
from posttrain.config_reference import describe, type_name

runner = CliRunner()


def test_describe_names_type_bounds_default_and_description():
    result = runner.invoke(app, ["config", "show", "--describe"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    i = lines.index("envs.max_turns: int (>= 1) = 4")
    assert lines[i + 1] == "    assistant turns per episode"
    assert "model.lora_rank: int (>= 0) = 0" in lines
    assert lines[lines.index("model.lora_rank: int (>= 0) = 0") + 1] == "    0 = full fine-tune"


def test_describe_shows_a_changed_value_beside_its_default():
    result = runner.invoke(app, ["config", "show", "--describe", "--set", "envs.max_turns=2"])
    assert result.exit_code == 0, result.output
    assert "envs.max_turns: int (>= 1) = 2 (default 4)" in result.output.splitlines()


def test_describe_covers_every_leaf_key_and_list_items():
    docs = {d.key: d for d in describe()}
    assert docs["envs.domains"].section and docs["envs.domains[].name"].default == "required"
    assert docs["model.rope_scaling.type"].type == '"linear" | "dynamic" | "yarn" | "llama3"'
    assert docs["model.vision"].description == (
        "What trains in a vision-language policy (LLaVA-style; the language side follows lora_rank)."
    )
    top = [d.key for d in describe() if "." not in d.key]
    assert top == list(RunConfig.model_fields)


def test_type_names():
    assert type_name(int | None) == "int | None"
    assert type_name(list[str]) == "list[str]"
    assert type_name(dict[str, int]) == "dict[str, int]"


def test_orchestrator_steps_says_what_it_counts_not_a_stale_timing():
    docs = {d.key: d for d in describe()}
    assert docs["orchestrator.steps"].description == (
        "RL steps (learner updates) in the run; with orchestrator.token_budget, an upper bound"
    )
