"""Online DPO (dpo.rounds > 1): after each round's steps the sampler loads the policy as trained so far
and samples the next round's tasks; each round trains the same number of steps on its own pairs and
logs its sampling stats; a round without pairs trains nothing; the config is refused without an
environment, and an online run does not resume."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from posttrain.cli import app
from posttrain.config import load_config
from posttrain.models import load_tokenizer
from posttrain.orchestrator.offline.dpo import dpo_run
from posttrain.orchestrator.offline.pairs import PairDataError, load_pairs_jsonl
from posttrain.telemetry import RunDir, read_metrics

from .planted import planted_pairs

runner = CliRunner()


def _pairs(tmp_path, n: int, seed: int):
    return load_pairs_jsonl(planted_pairs(tmp_path / f"p{seed}.jsonl", n, seed), load_tokenizer("tiny:llama"))


class RecordingSampler:
    """Stands in for PairSampler: records the weights it is given and the tasks asked for; answers with
    planted pairs (none for round 2)."""

    def __init__(self, tmp_path) -> None:
        self.tmp_path = tmp_path
        self.loaded: list[dict[str, torch.Tensor]] = []
        self.calls: list[tuple[str, int, int, int | None]] = []

    def load_weights(self, weights) -> None:
        self.loaded.append({k: v.clone() for k, v in weights.items()})

    def sample(self, split, start, n, step=None):
        self.calls.append((split, start, n, step))
        if start == 2 * n:
            return [], {"tasks": float(n), "success_rate": 0.0, "pairs": 0.0}
        pairs = _pairs(self.tmp_path, 8, seed=start)
        return pairs, {"tasks": float(n), "success_rate": 0.5, "pairs": float(len(pairs))}


def _cfg(tmp_path, *sets):
    return load_config(
        None,
        [
            "model.spec=tiny:llama",
            "pairs.from_env=math",
            "pairs.n=4",
            "pairs.batch_size=4",
            "pairs.steps=1",
            "pairs.eval_every=0",
            "trainer.lr=1e-3",
            "telemetry.progress=false",
            "telemetry.tensorboard=false",
            f"telemetry.run_dir={tmp_path / 'runs'}",
            *sets,
        ],
    )


def test_each_round_samples_from_the_policy_trained_so_far(tmp_path):
    cfg = _cfg(tmp_path, "dpo.rounds=4")
    sampler = RecordingSampler(tmp_path)
    job = dpo_run(cfg, RunDir.create(cfg.telemetry.run_dir, "online"), sampler=sampler)
    weights_after: list[dict[str, torch.Tensor]] = []
    step = job.trainer.step

    def step_and_keep(pairs):
        out = step(pairs)
        weights_after.append({k: v.clone() for k, v in job.trainer.learner.weights().items()})
        return out

    job.trainer.step = step_and_keep
    summary = job.train(_pairs(tmp_path, 8, seed=100), _pairs(tmp_path, 4, seed=200))
    # round r samples training tasks r*4..r*4+3, seeded by step 2 + r
    assert sampler.calls == [("train", 4, 4, 3), ("train", 8, 4, 4), ("train", 12, 4, 5)]
    # ... from the policy after the previous rounds' steps (1 per round; round 2 had no pairs)
    assert len(weights_after) == 3 and summary["step"] == 3
    for loaded, after in zip(
        sampler.loaded, [weights_after[0], weights_after[1], weights_after[1]], strict=True
    ):
        assert all(torch.equal(loaded[k], after[k]) for k in after)
    assert not all(torch.equal(sampler.loaded[0][k], sampler.loaded[1][k]) for k in after)
    rows = read_metrics(tmp_path / "runs" / "online" / "metrics.jsonl")
    trained = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in trained] == [1, 2, 3]
    assert [r["online/round"] for r in trained] == [0, 1, 3]
    assert [r["step"] for r in rows if "online/success_rate" in r] == [2, 2, 3]
    empty = next(r for r in rows if r.get("online/pairs") == 0.0)
    assert empty["online/round"] == 2 and "train/loss" not in empty
    assert (tmp_path / "runs" / "online" / "policy" / "model.safetensors").is_file()

    with pytest.raises(PairDataError, match="an online run does not resume"):
        dpo_run(cfg, RunDir.open(tmp_path / "runs" / "online"), sampler=sampler).load()


def test_online_dpo_needs_an_environment(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    out = runner.invoke(
        app,
        [
            "dpo",
            "--data",
            str(data),
            "--set=model.spec=tiny:llama",
            "--set=dpo.rounds=3",
            f"--set=telemetry.run_dir={tmp_path}",
        ],
    )
    assert out.exit_code == 2
    assert "dpo.rounds=3 samples pairs from an environment each round" in " ".join(out.output.split())
    with pytest.raises(ValueError, match="unset pairs.sampler_spec"):
        cfg = _cfg(tmp_path, "dpo.rounds=2", "pairs.sampler_spec=tiny:llama")
        dpo_run(cfg, RunDir.create(cfg.telemetry.run_dir, "x"))
