"""Reward models: the Bradley-Terry loss and its gradients against hand-computed values; the scalar
head reads the position AutoModelForSequenceClassification reads, and the exported folder gives the
same scores; pairs by verifier outcome; `posttrain rm train` learns a planted preference (held-out
pairwise accuracy 0 -> 1) and refuses bad rows naming the file and line."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch
from typer.testing import CliRunner

from posttrain.algos import bradley_terry, pairwise_accuracy
from posttrain.cli import app
from posttrain.engine import Completion, GenerationOutput, SamplingParams
from posttrain.envs import get_domain
from posttrain.models.chat import render_messages
from posttrain.orchestrator.offline.pairs import asample_pairs, load_pairs_jsonl, pair_by_outcome
from posttrain.rollout import EpisodeLimits
from posttrain.telemetry import read_metrics
from posttrain.train import load_reward_model, new_reward_model
from posttrain.train.reward_model import pad_rows, score_positions
from posttrain.types import Task, Trajectory, TrajectoryStatus

from .planted import planted_pairs

runner = CliRunner()
TINY = ["--set=model.spec=tiny:llama", "--set=telemetry.progress=false", "--set=telemetry.tensorboard=false"]


def test_bradley_terry_loss_and_gradients_match_hand_computed_values():
    chosen = torch.tensor([2.0, 0.0], requires_grad=True)
    rejected = torch.tensor([1.0, 0.5], requires_grad=True)
    loss = bradley_terry(chosen, rejected)
    # -log sigmoid(d) = log(1 + exp(-d)) for d = 1 and d = -0.5
    assert loss.tolist() == pytest.approx([math.log(1 + math.exp(-1)), math.log(1 + math.exp(0.5))])
    assert loss.tolist() == pytest.approx([0.3132616875, 0.9740769842])
    loss.sum().backward()
    # d/d r_chosen = -sigmoid(-d): -0.2689414 (d = 1), -0.6224593 (d = -0.5); r_rejected the opposite
    assert chosen.grad.tolist() == pytest.approx([-0.2689414214, -0.6224593312])
    assert rejected.grad.tolist() == pytest.approx([0.2689414214, 0.6224593312])
    # a margin of 0.5 shifts d to 0.5 and -1
    assert bradley_terry(chosen, rejected, margin=0.5).tolist() == pytest.approx([0.4740769842, 1.3132616875])
    # ties count as wrong
    assert pairwise_accuracy(torch.tensor([1.0, 1.0, 2.0]), torch.tensor([0.0, 1.0, 3.0])) == pytest.approx(
        1 / 3
    )
    with pytest.raises(ValueError, match="same shape"):
        bradley_terry(torch.zeros(2), torch.zeros(3))


def test_score_position_is_the_last_non_pad_token():
    ids = torch.tensor([[5, 6, 2, 0], [5, 2, 2, 0], [2, 2, 0, 0], [7, 8, 9, 4]])
    lengths = torch.tensor([3, 3, 2, 4])
    assert score_positions(ids, lengths, pad_id=2).tolist() == [1, 0, 1, 3]


def test_exported_reward_model_loads_as_a_sequence_classifier_with_the_same_scores(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from posttrain.models import load_tokenizer

    tok = load_tokenizer("tiny:llama")
    rm = new_reward_model("tiny:llama", pad_id=tok.pad_token_id)
    assert rm.score([[1, 5, 6, 2]]) == [0.0]  # the head starts at zero
    torch.manual_seed(0)
    torch.nn.init.normal_(rm.head.weight)
    seqs = [[1, 5, 6, 7, 2], [1, 9, 2], [3, 4, 5, 6, 7, 8, 9]]
    ours = rm.score(seqs)
    rm.save(tmp_path / "rm", tok)
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    assert type(hf).__name__ == "LlamaForSequenceClassification" and hf.config.num_labels == 1
    ids, lengths = pad_rows(seqs)
    ids[torch.arange(ids.shape[1])[None] >= lengths[:, None]] = tok.pad_token_id  # HF pads with the pad id
    mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask).logits.squeeze(-1).tolist()
    assert ours == pytest.approx(theirs, abs=1e-5)
    assert load_reward_model(tmp_path / "rm").score(seqs) == pytest.approx(ours, abs=1e-6)


def _traj(task_id: str, group: int, success: float, ids: list[int], status=TrajectoryStatus.OK) -> Trajectory:
    task = Task(task_id, "math", 0, [])
    return Trajectory(
        task,
        ids,
        [0] + [1] * (len(ids) - 1),
        [0.0] * len(ids),
        1,
        {"success": success},
        success,
        status=status,
        group_id=group,
    )


def test_pairs_by_outcome_pair_a_success_with_a_failure_per_task():
    trajs = [
        _traj("a", 0, 1.0, [1, 10]),
        _traj("a", 0, 0.0, [1, 11]),
        _traj("a", 0, 1.0, [1, 12]),
        _traj("b", 1, 0.0, [1, 20]),
        _traj("b", 1, 0.0, [1, 21]),  # no success: no pair
        _traj("c", 2, 1.0, [1, 30], TrajectoryStatus.SANDBOX_ERROR),  # infra: neither side
        _traj("c", 2, 0.0, [1, 31]),
    ]
    pairs, stats = pair_by_outcome(trajs)
    assert [(p.source, p.chosen_ids, p.rejected_ids) for p in pairs] == [("a", [1, 10], [1, 11])]
    assert stats == {
        "tasks": 3.0,
        "tasks_paired": 1.0,
        "success_rate": 2 / 6,
        "infra_failures": 1.0,
        "pairs": 1.0,
    }
    assert len(pair_by_outcome(trajs, pairs_per_task=2)[0]) == 1  # task a has one failure only


class AnswerEngine:
    """Answers each math prompt with its reference on even requests and with a wrong answer on odd ones."""

    def __init__(self, tokenizer, answers: dict[tuple[int, ...], str]) -> None:
        self.tokenizer, self.answers, self.calls, self.version = tokenizer, answers, 0, 0

    async def agenerate(self, request):
        ref = self.answers[tuple(request.prompt_token_ids)]
        text = ref if self.calls % 2 == 0 else "<answer>-12345</answer>"
        self.calls += 1
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return GenerationOutput(
            "r", list(request.prompt_token_ids), [Completion(ids, [-0.1] * len(ids), text, "stop")], 0.0
        )


def test_environment_pairs_are_the_trajectories_token_ids(tokenizer):
    domain = get_domain("math")
    answers = {}
    for i in range(3):
        task = domain.task("train", 0, i, 0)
        obs = asyncio.run(domain.make_env(None).reset(task))
        prompt = render_messages(tokenizer, obs.messages, None, add_generation_prompt=True)
        answers[tuple(tokenizer.encode(prompt, add_special_tokens=False))] = domain.reference(task)[0]
    engine = AnswerEngine(tokenizer, answers)
    sampling = SamplingParams(temperature=1.0, max_tokens=32, stop_token_ids=[tokenizer.eos_token_id])
    pairs, stats = asyncio.run(
        asample_pairs(
            engine, tokenizer, domain, [0], 3, 4, "train", 0, None, sampling, EpisodeLimits(1, 256, 32)
        )
    )
    assert stats["tasks_paired"] == 3 and stats["success_rate"] == 0.5 and len(pairs) == 3
    for p in pairs:
        prompt_len = p.chosen_mask.index(1)
        assert p.chosen_ids[:prompt_len] == p.rejected_ids[:prompt_len]  # the same rendered prompt
        assert tokenizer.decode(p.rejected_ids[prompt_len:]) == "<answer>-12345</answer><|im_end|>"
        assert p.rejected_mask[prompt_len:] == [1] * (len(p.rejected_ids) - prompt_len)


def test_rm_learns_a_planted_preference(tmp_path):
    data = planted_pairs(tmp_path / "pairs.jsonl", 48, 0)
    runs = tmp_path / "runs"
    args = ["rm", "train", "--data", str(data), "--name", "rm", *TINY, f"--set=telemetry.run_dir={runs}"]
    sets = ["--set=trainer.lr=1e-3", "--set=pairs.epochs=3", "--set=pairs.eval_every=5"]
    result = runner.invoke(app, args + sets)
    assert result.exit_code == 0, result.output
    assert "held-out pairwise accuracy 0.000 -> 1.000 on 10 pairs" in " ".join(result.output.split())
    rows = read_metrics(runs / "rm" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 16))  # 3 epochs x ceil(38 / 8)
    assert rows[0]["heldout_start/accuracy"] == 0.0  # a zero head ties every pair
    assert [r["step"] for r in rows if "heldout/accuracy" in r] == [5, 10, 15]
    assert rows[-1]["heldout/accuracy"] == 1.0 and rows[-1]["heldout/margin"] > 1.0
    rm = load_reward_model(runs / "rm" / "reward_model")
    from posttrain.models import load_tokenizer

    fresh = load_pairs_jsonl(planted_pairs(tmp_path / "new.jsonl", 16, 1), load_tokenizer("tiny:llama"))
    chosen = rm.score([p.chosen_ids for p in fresh])
    rejected = rm.score([p.rejected_ids for p in fresh])
    assert all(c > r for c, r in zip(chosen, rejected, strict=True))


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "hi", "chosen": "a"}, "the row has no 'rejected'"),
        ({"prompt": "hi", "chosen": "a", "rejected": "a"}, "chosen and rejected are the same response"),
        ({"prompt": [{"role": "bot", "content": "x"}], "chosen": "a", "rejected": "b"}, "unknown role 'bot'"),
    ],
)
def test_bad_pair_rows_exit_2_naming_file_and_line(tmp_path, row, message):
    data = tmp_path / "d.jsonl"
    data.write_text(
        json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n" + json.dumps(row) + "\n"
    )
    result = runner.invoke(
        app, ["rm", "train", "--data", str(data), *TINY, f"--set=telemetry.run_dir={tmp_path}/r"]
    )
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"{data}:2: " in text and message in text
    assert not (tmp_path / "r").exists()


def test_env_pairs_without_a_success_are_a_usage_error(tmp_path):
    result = runner.invoke(
        app,
        [
            "rm",
            "train",
            "--from-env",
            "math",
            "--n",
            "2",
            *TINY,
            "--set=pairs.samples_per_task=2",
            "--set=engine.max_new_tokens=4",
            "--set=engine.num_kv_blocks=64",
            f"--set=telemetry.run_dir={tmp_path}/r",
        ],
    )
    assert result.exit_code == 2, result.output
    assert "no task of 2 had both a success and a failure in 2 samples" in " ".join(result.output.split())
