"""`posttrain dpo`: at the start the policy is its reference (DPO loss log 2, margin 0); training on
planted pairs raises the held-out chosen-vs-rejected margin and accuracy, full and LoRA (whose
reference is the base with adapters off); SimPO keeps no reference copy."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from posttrain.cli import app
from posttrain.config import load_config
from posttrain.models import load_tokenizer
from posttrain.orchestrator.offline.dpo import PreferenceTrainer, loss_params, pair_samples
from posttrain.orchestrator.offline.pairs import load_pairs_jsonl
from posttrain.telemetry import read_metrics

from .planted import planted_pairs

runner = CliRunner()
TINY = ["--set=model.spec=tiny:llama", "--set=telemetry.progress=false", "--set=telemetry.tensorboard=false"]


def test_the_initial_policy_is_its_reference(tmp_path):
    cfg = load_config(None, ["model.spec=tiny:llama", "trainer.bf16_autocast=false"])
    pairs = load_pairs_jsonl(planted_pairs(tmp_path / "p.jsonl", 4), load_tokenizer("tiny:llama"))
    trainer = PreferenceTrainer(cfg)
    assert trainer.learner.reference is not None  # full fine-tuning: a frozen copy
    out = trainer.evaluate(pairs)
    assert out["loss"] == pytest.approx(math.log(2), abs=1e-6)  # -log sigmoid(0)
    assert out["margin"] == pytest.approx(0.0, abs=1e-6) and out["accuracy"] == 0.0
    assert loss_params(cfg.dpo) == {"beta": 0.1, "label_smoothing": 0.0}
    chosen, rejected = pair_samples(pairs)
    assert [s.group_id for s in chosen] == [s.group_id for s in rejected] == [0, 1, 2, 3]

    simpo = PreferenceTrainer(load_config(None, ["model.spec=tiny:llama", "dpo.loss=simpo"]))
    assert simpo.learner.reference is None  # SimPO has no reference model
    assert loss_params(simpo.cfg.dpo) == {"beta": 2.0, "gamma": 1.0}
    assert simpo.step(pairs)["pairs"] == 4.0


@pytest.mark.parametrize("lora", [0, 8])
def test_dpo_on_planted_pairs_raises_the_held_out_margin(tmp_path, lora):
    data = planted_pairs(tmp_path / "pairs.jsonl", 40)
    runs = tmp_path / "runs"
    lr = "1e-3" if lora == 0 else "1e-2"
    result = runner.invoke(
        app,
        [
            "dpo",
            "--data",
            str(data),
            "--name",
            "d",
            *TINY,
            f"--set=telemetry.run_dir={runs}",
            f"--set=model.lora_rank={lora}",
            f"--set=trainer.lr={lr}",
            "--set=pairs.epochs=2",
            "--set=pairs.eval_every=4",
        ],
    )
    assert result.exit_code == 0, result.output
    rows = read_metrics(runs / "d" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9))  # 2 epochs x 32 pairs / 8
    start = rows[0]
    assert abs(start["heldout_start/margin"]) < 1e-4  # (its accuracy is float noise around a tie)
    assert abs(start["train/margin"]) < 1e-4  # step 1's figures are of the reference itself
    end = rows[-1]
    assert end["heldout/margin"] > 0.1 and end["heldout/accuracy"] == 1.0
    assert end["heldout/chosen_reward"] > 0 > end["heldout/rejected_reward"]
    assert end["train/loss"] < math.log(2)
    assert (runs / "d" / "policy" / "model.safetensors").is_file()
    assert (runs / "d" / "checkpoints" / "latest").read_text() == "step-000008"
