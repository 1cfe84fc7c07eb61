"""`posttrain rm train --resume` and `posttrain dpo --resume`: a run stopped by SIGTERM mid-way and
resumed from its checkpoint ends with the same weights, bit for bit, and the same metrics as the run
that was not stopped; --resume refuses options that would change the run, and a directory without a
run or a checkpoint."""

from __future__ import annotations

import os
import shutil
import signal

import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

from posttrain.cli import app
from posttrain.orchestrator.offline.dpo import PreferenceTrainer
from posttrain.orchestrator.offline.rm import RewardTrainer
from posttrain.telemetry import read_metrics

from .planted import planted_pairs

runner = CliRunner()
TINY = ["--set=model.spec=tiny:llama", "--set=telemetry.progress=false", "--set=telemetry.tensorboard=false"]


def _untimed(rows: list[dict]) -> list[dict]:
    return [
        {
            k: v
            for k, v in r.items()
            if k != "time" and not k.startswith("time/") and not k.endswith(("_s", "_per_s"))
        }
        for r in rows
    ]


# (command, trainer class whose step is interrupted, exported folder, its weights file)
KINDS = {
    "rm": (["rm", "train"], RewardTrainer, "reward_model", "model.safetensors"),
    "dpo": (["dpo"], PreferenceTrainer, "policy", "model.safetensors"),
}


@pytest.mark.parametrize("kind", ["rm", "dpo"])
def test_a_stopped_and_resumed_run_equals_the_straight_run(tmp_path, monkeypatch, kind):
    command, trainer_cls, exported, weights = KINDS[kind]
    data = planted_pairs(tmp_path / "pairs.jsonl", 15)
    runs = tmp_path / "runs"
    args = [*command, "--data", str(data), *TINY, f"--set=telemetry.run_dir={runs}"]
    # 4 steps over 12 pairs of batch 4: the resumed leg takes the last batch of epoch 1 and the first of
    # epoch 2 (a new shuffle); a cosine schedule and warmup make the optimizer step count matter
    args += [
        "--set=trainer.lr=1e-3",
        "--set=pairs.steps=4",
        "--set=pairs.batch_size=4",
        "--set=pairs.eval_every=2",
    ]
    args += ["--set=trainer.lr_schedule=cosine", "--set=trainer.warmup_steps=2"]
    straight = runner.invoke(app, [*args, "--name", "straight"])
    assert straight.exit_code == 0, straight.output

    original = trainer_cls.step
    calls = {"n": 0}

    def step_then_sigterm(self, pairs):
        out = original(self, pairs)
        calls["n"] += 1
        if calls["n"] == 2:  # the signal handler records it; the run stops after this step
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(trainer_cls, "step", step_then_sigterm)
    stopped = runner.invoke(app, [*args, "--name", "resumed"])
    assert stopped.exit_code == 128 + signal.SIGTERM, stopped.output
    run = runs / "resumed"
    assert (run / "checkpoints" / "latest").read_text() == "step-000002"
    assert not (run / exported).exists()  # a stopped run exports nothing
    monkeypatch.setattr(trainer_cls, "step", original)

    resumed = runner.invoke(app, [*command, "--resume", str(run), "--no-progress"])
    assert resumed.exit_code == 0, resumed.output
    assert "resumed" in resumed.output and "at step 2" in resumed.output
    a = load_file(str(runs / "straight" / exported / weights))
    b = load_file(str(run / exported / weights))
    assert a.keys() == b.keys()
    assert all(a[k].equal(b[k]) for k in a)
    ma = _untimed(read_metrics(runs / "straight" / "metrics.jsonl"))
    mb = _untimed(read_metrics(run / "metrics.jsonl"))
    assert [r["step"] for r in mb] == [1, 2, 3, 4]
    assert ma == mb
    # the printed start figure is the one measured before step 1, kept in the checkpoint
    assert " ".join(straight.output.split()).split("held-out")[1] == " ".join(resumed.output.split()).split(
        "held-out"
    )[1].replace(str(run), str(runs / "straight"))


def test_resume_refuses_what_would_change_the_run(tmp_path):
    data = planted_pairs(tmp_path / "pairs.jsonl", 12)
    runs = tmp_path / "runs"
    args = ["dpo", "--data", str(data), *TINY, f"--set=telemetry.run_dir={runs}", "--set=pairs.steps=1"]
    assert runner.invoke(app, [*args, "--name", "d"]).exit_code == 0
    run = runs / "d"

    out = runner.invoke(app, ["dpo", "--resume", str(run), "--data", str(data), "--set=dpo.beta=1"])
    assert out.exit_code == 2
    assert "drop --set, --data" in " ".join(out.output.split())
    out = runner.invoke(app, ["rm", "train", "--resume", str(tmp_path / "nowhere")])
    assert out.exit_code == 2 and "is not a run directory" in " ".join(out.output.split())

    shutil.rmtree(run / "checkpoints")
    out = runner.invoke(app, ["dpo", "--resume", str(run)])
    assert out.exit_code == 1 and "checkpoint" in out.output
    (run / "pairs.json").unlink()
    out = runner.invoke(app, ["dpo", "--resume", str(run)])
    assert out.exit_code == 2 and "holds no pairs to resume on" in " ".join(out.output.split())
