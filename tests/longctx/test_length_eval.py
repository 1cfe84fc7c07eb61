"""`eval --lengths`: the table per task and length, the task average (RULER's mean over tasks) with a
stratified interval, and the effective length, checked against hand-computed figures; the arms a domain
splits into at each length; the CLI on a tiny model, and its refusals."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from posttrain.cli import app
from posttrain.envs import get_domain
from posttrain.envs.domains.longctx_common import length_levels
from posttrain.orchestrator.eval.evaluate import EvalReport
from posttrain.orchestrator.eval.length_eval import (
    effective_length,
    engine_for_length,
    evaluate_lengths,
    length_table,
    task_average_ci,
)

# task a: 4/4, 3/4, 1/4; task b: 3/4, 2/3 (plus one infrastructure failure), 0/2
SCORES = {
    "d": {
        "a": {1024: [1, 1, 1, 1], 2048: [1, 1, 1, 0], 4096: [1, 0, 0, 0]},
        "b": {1024: [1, 1, 1, 0], 2048: [1, 1, 0, None], 4096: [0, 0]},
    }
}


def test_length_table_averages_tasks_and_finds_the_effective_length():
    table = length_table(SCORES, thresholds=[85.6, 70.0, 10.0, 90.0])
    b = table["tasks"]["d"]["b"]
    assert b["2048"]["accuracy"] == pytest.approx(2 / 3)
    assert (b["2048"]["n"], b["2048"]["infra_failures"]) == (3, 1)
    assert table["tasks"]["d"]["a"]["4096"]["accuracy"] == 0.25
    avg = {n: c["value"] for n, c in table["task_average"]["d"].items()}
    assert avg == pytest.approx({"1024": 0.875, "2048": (0.75 + 2 / 3) / 2, "4096": 0.125})
    # 87.5 > 85.6 at 1k, 70.8 < 85.6 at 2k; 70.8 > 70 at 2k; every length > 10; none > 90
    assert table["effective_length"]["d"] == {"85.6": 1024, "70": 2048, "10": 4096, "90": None}


def test_cells_with_nothing_scored_are_none_not_nan():
    table = length_table({"d": {"a": {1024: [None, None], 2048: [1.0]}}}, thresholds=[50.0])
    cell = table["tasks"]["d"]["a"]["1024"]
    assert cell == {"accuracy": None, "ci_low": None, "ci_high": None, "n": 0, "infra_failures": 2}
    assert table["task_average"]["d"]["1024"] == {"value": None, "ci_low": None, "ci_high": None}
    assert table["effective_length"]["d"] == {"50": None}  # nothing known at the shortest length
    json.dumps(table, allow_nan=False)


def test_eval_lengths_at_an_endpoint_that_does_not_answer_counts_infrastructure_failures():
    hard0 = "envs.domains=[{name: longctx.hard, options: {hardness: [0]}}]"
    args = ["eval", "--api-base", "http://127.0.0.1:9/v1", "--model", "m", "--suite", "longctx.hard"]
    result = CliRunner().invoke(app, [*args, "--lengths", "1k", "--n", "1", "--set", hard0, "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output.strip().splitlines()[-1])
    assert out["tasks"]["longctx.hard"]["hardness_0"]["1024"]["infra_failures"] == 1
    assert out["tasks"]["longctx.hard"]["hardness_0"]["1024"]["n"] == 0
    assert "1 episode(s) failed at http://127.0.0.1:9/v1 at 1024 tokens" in result.output


def test_effective_length_stops_at_the_first_length_below_the_threshold():
    assert effective_length({1024: 0.9, 2048: 0.5, 4096: 0.95}, 85.6) == 1024
    assert effective_length({1024: 0.856, 2048: 0.99}, 85.6) is None  # above means strictly above


def test_task_average_interval_resamples_within_each_task():
    # a task always right and one always wrong: every stratified resample averages exactly 0.5
    # (pooling the 8 scores would resample the mix and spread the interval)
    assert task_average_ci([[1, 1, 1, 1], [0, 0, 0, 0]]) == (0.5, 0.5, 0.5)
    value, lo, hi = task_average_ci([[1, 0, 1, 0], [1, 1]], seed=3)
    assert value == 0.75 and 0.25 <= lo < 0.75 < hi <= 1.0


def test_evaluate_lengths_scores_each_task_at_each_level():
    domains = {"longctx.ruler": get_domain("longctx.ruler"), "longctx.hard": get_domain("longctx.hard")}
    calls = []

    def score(sub, arms, tokens):
        calls.append((tokens, sorted(a.key for a in arms)))
        # a planted score per task: 1 for hard's hardness 0, else 0; two tasks each
        per = {key: [1.0, 1.0] if key.endswith("hardness_0") else [0.0, 1.0] for key in sub}
        return EvalReport(model="planted", per_task=per)

    result = evaluate_lengths(domains, [0, 2], score, thresholds=[60.0])
    assert [c[0] for c in calls] == [1024, 4096]
    hard_arms = [k for k in calls[1][1] if k.startswith("longctx.hard")]
    assert hard_arms == [
        "longctx.hard/hardness_0:2",
        "longctx.hard/hardness_1:12",
        "longctx.hard/hardness_2:22",
    ]
    assert len(calls[1][1]) == 13 + 3 and "longctx.ruler/vt:2" in calls[1][1]
    assert result["lengths"] == [1024, 4096]
    assert list(result["tasks"]["longctx.ruler"]) == list(get_domain("longctx.ruler").tasks)
    # hard: (1 + 0.5 + 0.5) / 3 = 0.667 > 60 % at both lengths; ruler: 0.5 < 60 %
    assert result["task_average"]["longctx.hard"]["4096"]["value"] == pytest.approx(2 / 3)
    assert result["effective_length"] == {"longctx.hard": {"60": 4096}, "longctx.ruler": {"60": None}}


def test_length_levels_accept_only_the_domains_levels():
    assert length_levels("8k,1k,2k,1024") == [0, 1, 3]
    with pytest.raises(ValueError, match="3072 tokens is not a long-context level"):
        length_levels("3k")


def test_hard_difficulty_at_a_length_needs_one_hardness():
    with pytest.raises(ValueError, match="only at one hardness"):
        get_domain("longctx.hard").difficulty_at(1)
    assert get_domain("longctx.hard", hardness=[2]).difficulty_at(3) == 23


def test_eval_lengths_on_a_tiny_model_prints_a_table_per_domain():
    args = ["eval", "tiny:llama", "--suite", "longctx.hard", "--lengths", "1k", "--n", "1"]
    result = CliRunner().invoke(
        app, [*args, "--threshold", "85.6", "--threshold", "0", "--set", "engine.max_new_tokens=4", "--json"]
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.output.strip().splitlines()[-1])
    cells = out["tasks"]["longctx.hard"]
    assert list(cells) == ["hardness_0", "hardness_1", "hardness_2"]
    assert all(c["1024"]["n"] == 1 for c in cells.values())
    mean = sum(c["1024"]["accuracy"] for c in cells.values()) / 3
    assert out["task_average"]["longctx.hard"]["1024"]["value"] == pytest.approx(mean)
    assert set(out["effective_length"]["longctx.hard"]) == {"85.6", "0"}
    assert "longctx.hard: strict accuracy" in result.output and "task average" in result.output


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--suite", "longctx.hard", "--lengths", "3k"], "3072 tokens is not a long-context level"),
        (
            ["--suite", "longctx.hard", "--lengths", "1k", "--baseline", "tiny:llama"],
            "does not take --baseline",
        ),
        (["--suite", "math", "--lengths", "1k"], "needs long-context domains"),
        (["--suite", "longctx.hard", "--threshold", "50"], "--threshold goes with --lengths"),
        (["--suite", "longctx.hard", "--lengths", "1k", "--threshold", "100"], "percentage in"),
    ],
)
def test_eval_lengths_refuses_bad_options_with_exit_2(extra, message):
    result = CliRunner().invoke(app, ["eval", "tiny:llama", "--n", "1", *extra])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_an_engine_for_a_length_holds_the_prompt_and_its_reply():
    from posttrain.config import EngineConfig

    base = EngineConfig(max_new_tokens=256, block_size=16, num_kv_blocks=2048, max_model_len=8192)
    # 32768 + 256 + 128 = 33152 tokens = 2072 blocks, +1: the default 2048-block pool is raised
    big = engine_for_length(base, 32768)
    assert (big.max_model_len, big.num_kv_blocks) == (33152, 2073)
    small = engine_for_length(base, 1024)  # what the config gives is kept where it is enough
    assert (small.max_model_len, small.num_kv_blocks) == (8192, 2048)
    assert base.num_kv_blocks == 2048 and base.max_model_len == 8192  # a copy, not the config changed
