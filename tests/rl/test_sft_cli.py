"""`posttrain sft` end to end: bad data exits 2 naming the file and line; --from-env builds the
references as assistant turns, with the tool observations the environment answers them with, token
for token what the RL agent loop produces for the same texts; an SFT run's policy is the model an RL
run starts from."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

from posttrain.cli import app
from posttrain.config import load_config
from posttrain.envs import get_domain
from posttrain.orchestrator.offline.sft import examples_from_env, load_jsonl, replay_reference
from posttrain.orchestrator.rl import RLRun
from posttrain.rollout import EpisodeLimits
from posttrain.rollout.agent import run_episode
from posttrain.telemetry import RunDir, read_metrics
from posttrain.train import encode_chat

from .conftest import ScriptedEngine

runner = CliRunner()
TINY_SFT = [
    "--set=model.spec=tiny:llama",
    "--set=telemetry.progress=false",
    "--set=telemetry.tensorboard=false",
]
GOOD = {
    "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<answer>4</answer>"}]
}


def _write(path: Path, rows: list[str]) -> Path:
    path.write_text("".join(r + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ('{"prompt": "2+2?", "completion": "4"', "not valid JSON"),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}]}), "has no assistant turn"),
        (
            json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]}),
            "message 1: unknown role 'bot' (valid roles: system, user, assistant, tool)",
        ),
    ],
)
def test_bad_jsonl_line_exits_2_naming_file_and_line(tmp_path, bad, message):
    data = _write(tmp_path / "data.jsonl", [json.dumps(GOOD), "", bad, json.dumps(GOOD)])
    result = runner.invoke(
        app, ["sft", "--data", str(data), *TINY_SFT, f"--set=telemetry.run_dir={tmp_path / 'runs'}"]
    )
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"{data}:3: " in text and message in text
    assert not (tmp_path / "runs").exists()  # nothing was started


def test_no_data_and_both_sources_are_usage_errors(tmp_path):
    result = runner.invoke(app, ["sft", *TINY_SFT])
    assert result.exit_code == 2 and "no SFT data" in result.output
    result = runner.invoke(app, ["sft", "--data", "x.jsonl", "--from-env", "math", *TINY_SFT])
    assert result.exit_code == 2 and "not both" in result.output


def test_jsonl_formats_openai_tool_calls_and_prompt_completion(tmp_path):
    rows = [
        {
            "messages": [
                {"role": "system", "content": "Shop."},
                {"role": "user", "content": "Price of A1?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_product", "arguments": '{"sku": "A1"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": '{"price": 12}'},
                {"role": "assistant", "content": [{"type": "text", "text": "12"}]},
            ],
            "tools": [
                {"type": "function", "function": {"name": "get_product", "parameters": {"type": "object"}}}
            ],
        },
        {"prompt": "2+2?", "completion": "4", "system": "Be brief."},
    ]
    examples = load_jsonl(_write(tmp_path / "d.jsonl", [json.dumps(r) for r in rows]))
    tool_ex, pc_ex = examples
    assert [(m.role, m.content) for m in tool_ex.messages] == [
        ("system", "Shop."),
        ("user", "Price of A1?"),
        ("assistant", '<tool_call>[{"name": "get_product", "arguments": {"sku": "A1"}}]</tool_call>'),
        ("tool", '{"price": 12}'),
        ("assistant", "12"),
    ]
    assert [t.name for t in tool_ex.tools] == ["get_product"]
    assert tool_ex.source == f"{tmp_path / 'd.jsonl'}:1"
    assert [(m.role, m.content) for m in pc_ex.messages] == [
        ("system", "Be brief."),
        ("user", "2+2?"),
        ("assistant", "4"),
    ]


def test_from_env_math_assistant_texts_are_the_references():
    domain = get_domain("math")
    examples = examples_from_env("math", [0], 8)
    assert len(examples) == 8
    for i, ex in enumerate(examples):
        task = domain.task("train", 0, i, 0)
        assert ex.source == task.id
        assert [m.content for m in ex.messages if m.role == "assistant"] == domain.reference(task)
        assert ex.messages[: len(task.prompt)] == task.prompt


def test_tools_reference_replay_is_token_for_token_the_rl_rollout(tokenizer):
    """A level-1 tools.apis task (tool calls, then an answer): the SFT sample of its replayed reference
    equals the trajectory the agent loop builds when the engine generates those same texts."""
    from posttrain.engine import SamplingParams

    domain = get_domain("tools.apis")
    task = domain.task("train", 1, 0, 0)
    texts = domain.reference(task)
    assert len(texts) >= 2
    example = asyncio.run(replay_reference(domain, task))
    assert [m.role for m in example.messages].count("tool") >= 1
    ids, mask = encode_chat(tokenizer, example.messages, example.tools)

    engine = ScriptedEngine(tokenizer, texts)
    sampling = SamplingParams(temperature=0.0, max_tokens=512, stop_token_ids=[tokenizer.eos_token_id])
    traj = asyncio.run(
        run_episode(engine, tokenizer, domain, task, None, sampling, EpisodeLimits(8, 8192, 512))
    )
    assert traj.rewards["success"] == 1.0
    assert traj.token_ids == ids
    assert traj.loss_mask == mask


def test_sft_run_policy_is_the_model_of_an_rl_run(tmp_path):
    runs = tmp_path / "runs"
    result = runner.invoke(
        app,
        [
            "sft",
            "--from-env",
            "math",
            "--n",
            "8",
            "--name",
            "s1",
            *TINY_SFT,
            f"--set=telemetry.run_dir={runs}",
            "--set=sft.batch_size=4",
            "--set=sft.epochs=2",
            "--set=sft.eval_every=2",
            "--set=trainer.lr=1e-3",
        ],
    )
    assert result.exit_code == 0, result.output
    run = runs / "s1"
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # 2 epochs x 8 examples / 4 per step
    assert all(r["train/tokens"] > 0 and "train/loss" in r for r in rows)
    assert [r["step"] for r in rows if "heldout/loss" in r] == [2, 4]
    assert (run / "checkpoints" / "latest").read_text() == "step-000004"
    saved = load_config(run / "config.yaml")
    assert saved.sft.from_env == "math" and saved.sft.n == 8
    policy = load_file(str(run / "policy" / "model.safetensors"))

    # `posttrain eval RUN` exports the latest checkpoint when policy/ is missing: the same weights
    from posttrain.orchestrator.eval.export import export_run

    exported = load_file(str(export_run(run, tmp_path / "exported") / "model.safetensors"))
    assert exported.keys() == policy.keys()
    assert all(exported[k].equal(policy[k]) for k in policy)

    cfg = load_config(
        None,
        [
            f"model.spec={run / 'policy'}",
            "engine.num_kv_blocks=256",
            "engine.max_new_tokens=8",
            "envs.domains=[{name: math, difficulties: [0]}]",
            "batch.prompts_per_step=1",
            "batch.samples_per_prompt=2",
            "orchestrator.steps=1",
            "curriculum.probe_every=0",
            "telemetry.progress=false",
            "telemetry.tensorboard=false",
            f"telemetry.run_dir={runs}",
        ],
    )
    rl = RLRun(cfg, RunDir.create(runs, "rl"))
    try:
        rl.build()
        start = rl.learner.weights()
        assert all(start[k].equal(policy[k]) for k in policy)  # the RL run starts from the SFT policy
        summary = rl.train()
    finally:
        rl.close()
    assert summary["step"] == 1
    assert [r["step"] for r in read_metrics(runs / "rl" / "metrics.jsonl")] == [1]
