"""The drift probe: KL to the initial policy and entropy on general prompts, from the reference's own
sampled completions. Hand-computed estimators; zero drift before any update; a 2-step run logs it."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.orchestrator.rl.drift import DriftProbe
from posttrain.telemetry import read_metrics

from .test_loop import _cfg, _run


class ScoredLearner:
    def __init__(self, lp, ent):
        self.lp, self.ent = lp, ent

    def score_tokens(self, samples):
        return self.lp, self.ent, torch.tensor([[0.0, 1.0, 1.0]])


def test_estimators_by_hand():
    ref_lp = torch.tensor([[0.0, -1.0, -2.0]])
    probe = DriftProbe([object()], ref_lp, torch.tensor([[9.0, 1.0, 3.0]]), torch.tensor([[0.0, 1.0, 1.0]]))
    # r = policy - ref = +0.5 and -0.5 on the two completion tokens; the prompt token is not counted
    out = probe.measure(ScoredLearner(torch.tensor([[5.0, -0.5, -2.5]]), torch.tensor([[7.0, 2.0, 2.0]])))
    k3 = ((math.exp(0.5) - 1 - 0.5) + (math.exp(-0.5) - 1 + 0.5)) / 2
    assert out["drift/kl_k3"] == pytest.approx(k3) and k3 == pytest.approx(0.12763, abs=1e-5)
    assert out["drift/kl_k1"] == pytest.approx(0.0, abs=1e-12)
    assert out["drift/entropy"] == 2.0 and out["drift/ref_entropy"] == 2.0 and out["drift/tokens"] == 2.0


def test_a_run_logs_drift_of_the_engines_own_tokens(tmp_path):
    run = _run(
        _cfg(tmp_path, "orchestrator.steps=2", "curriculum.drift_every=1", "curriculum.drift_prompts=4"), "d"
    )
    probe = run.drift
    assert len(probe.samples) == 4
    m = probe.mask > 0
    behaviour = torch.zeros_like(probe.ref_logprobs)
    for i, s in enumerate(probe.samples):
        behaviour[i, : len(s.behavior_logprobs)] = torch.tensor(s.behavior_logprobs)
    # the learner's reference logprobs are those the engine sampled the tokens with (bf16 engine, fp32 learner)
    assert torch.allclose(probe.ref_logprobs[m], behaviour[m], atol=1e-2)
    rows = read_metrics(run.run_dir.metrics)
    assert [r["drift/ref_entropy"] for r in rows] == [rows[0]["drift/ref_entropy"]] * 2
    # the tiny random policy earns equal rewards everywhere: zero advantages, no move, no drift
    assert [(r["train/loss"], r["drift/kl_k3"], r["drift/kl_k1"]) for r in rows] == [(0.0, 0.0, 0.0)] * 2
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a policy that did move
        for p in run.learner.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    moved = probe.measure(run.learner)
    assert moved["drift/kl_k3"] > 0 and moved["drift/entropy"] != moved["drift/ref_entropy"]
    run.close()


def test_no_drift_before_any_update(tmp_path):
    import asyncio

    from posttrain.config import AlgorithmConfig, EngineConfig, ModelConfig, TrainerConfig
    from posttrain.engine import make_engine
    from posttrain.models import load_policy, load_tokenizer
    from posttrain.train import Learner

    learner = Learner(ModelConfig(spec="tiny:llama"), TrainerConfig(), AlgorithmConfig(), seed=0)
    tok = load_tokenizer("tiny:llama")
    engine = make_engine(EngineConfig(num_kv_blocks=256), load_policy("tiny:llama", seed=0), tok)
    engine.load_weights(learner.weights(), version=0)
    loop = asyncio.new_event_loop()
    probe = DriftProbe.build(engine, tok, learner, n_prompts=3, max_tokens=8, seed=0, loop=loop)
    loop.close()
    out = probe.measure(learner)
    assert out["drift/kl_k3"] == 0.0 and out["drift/kl_k1"] == 0.0
    assert out["drift/entropy"] == out["drift/ref_entropy"] and out["drift/tokens"] > 0
    with pytest.raises(ValueError, match="curriculum.drift_prompts must be 1..16, got 17"):
        DriftProbe.build(
            engine, tok, learner, n_prompts=17, max_tokens=8, seed=0, loop=asyncio.new_event_loop()
        )


KL_DRIFT = [
    "orchestrator.steps=2",
    "curriculum.drift_every=1",
    "curriculum.drift_prompts=2",
    "algorithm.kl_coef=0.1",
    "algorithm.kl_target=0.5",
    "algorithm.kl_control=drift",
]


@pytest.mark.parametrize("measured", [None, 1.0], ids=["no-drift", "drift-above-target"])
def test_the_kl_coefficient_steered_by_the_drift_probe_moves_the_right_way(tmp_path, monkeypatch, measured):
    if measured is not None:
        real = DriftProbe.measure
        monkeypatch.setattr(
            DriftProbe, "measure", lambda self, lrn: {**real(self, lrn), "drift/kl_k3": measured}
        )
    run = _run(_cfg(tmp_path, *KL_DRIFT), "kl")
    rows = read_metrics(run.run_dir.metrics)
    # Ziegler's rule per probe: beta *= 1 + clip(kl / 0.5 - 1, -0.2, 0.2) * 6 samples / 10000 (horizon)
    factor = 1 + (0.2 if measured else -0.2) * 6 / 10000
    assert [r["drift/kl_coef"] for r in rows] == pytest.approx([0.1 * factor, 0.1 * factor**2], rel=1e-12)
    assert rows[-1]["train/kl_coef"] == pytest.approx(0.1 * factor)  # the learner used the steered value
    run.close()


def test_kl_control_drift_needs_the_probe_and_a_target(tmp_path):
    from posttrain.orchestrator.rl import RLRun

    with pytest.raises(ValueError, match="kl_control='drift' needs curriculum.drift_every > 0"):
        RLRun.check(
            _cfg(tmp_path, "algorithm.kl_control=drift", "algorithm.kl_coef=0.1", "algorithm.kl_target=1")
        )
