"""A PPO critic under trainer.context_parallel=2 (2 gloo processes, the critic's decoder run over each
rank's zigzag shard with ring attention, its values gathered, its gradients summed over the ranks) against
the single-process Learner on the same samples, with algorithm.advantage=gae: the values, the step
metrics (the value loss among them) and every policy and critic weight after two RL steps within 1e-4,
for a critic copied from the policy and a separate one (tiny:qwen2 beside the tiny:llama policy)."""

from __future__ import annotations

import pytest
import torch

from posttrain.config import AlgorithmConfig, BatchConfig, ModelConfig, TrainerConfig
from posttrain.train import Learner, Sample, build_batch

from .test_context_parallel import on_two_ranks, samples

BATCH = BatchConfig(micro_batch_tokens=24)
ALGO = AlgorithmConfig(advantage="gae", entropy_coef=0.01)
METRICS = (
    "loss",
    "value_loss",
    "vf_clipfrac",
    "critic_grad_norm",
    "grad_norm",
    "entropy",
    "approx_kl",
    "advantage_abs_mean",
    "update_tokens",
)
CRITIC_SPEC = {"copy": None, "separate": "tiny:qwen2"}


def make_learner(cp: int, critic: str) -> Learner:
    trainer = TrainerConfig(
        lr=1e-3, critic_lr=5e-3, context_parallel=cp, critic=critic, critic_spec=CRITIC_SPEC[critic]
    )
    return Learner(ModelConfig(spec="tiny:llama"), trainer, ALGO, seed=0, batch_cfg=BATCH)


def _weights(learner: Learner) -> dict[str, torch.Tensor]:
    assert learner.critic is not None
    out = {f"policy.{n}": p.detach().clone() for n, p in learner.model.named_parameters()}
    out.update({f"critic.{n}": p.detach().clone() for n, p in learner.critic.named_parameters()})
    return out


def _values(learner: Learner, rows: list[Sample]) -> torch.Tensor:
    return learner.compute_values(build_batch(rows, learner.device))


def run(learner: Learner) -> dict:
    before = _weights(learner)
    values = [_values(learner, samples(1))]
    metrics = []
    for seed in (2, 3):
        metrics.append(learner.step(samples(seed)))
        values.append(_values(learner, samples(1)))
    return {"before": before, "after": _weights(learner), "values": values, "metrics": metrics}


@pytest.mark.parametrize("critic", ["copy", "separate"])
def test_a_critic_on_two_context_parallel_ranks_equals_the_single_process_learner(tmp_path, critic):
    ranks = on_two_ranks(lambda: run(make_learner(2, critic)), tmp_path)
    single = run(make_learner(1, critic))
    tol = 1e-4
    # the critic's head starts at zero, so the first values are 0; after a step they are not
    assert single["values"][1].abs().max() > 10 * tol and single["values"][2].abs().max() > 10 * tol
    for m in single["metrics"]:  # rewards vary within each group: GAE advantages are not all zero
        assert m["advantage_abs_mean"] > 0.1 and m["value_loss"] > 0
    moved = {n: (single["after"][n] - w).abs().max() for n, w in single["before"].items()}
    assert all(d > 10 * tol for d in moved.values()), [n for n, d in moved.items() if d <= 10 * tol]
    assert any(n.startswith("critic.") for n in moved) and any(n.startswith("policy.") for n in moved)
    for got in ranks:  # every rank holds the whole value matrices and the same updated weights
        for v_got, v_single in zip(got["values"], single["values"], strict=True):
            assert (v_got - v_single).abs().max() < tol
        assert got["after"].keys() == single["after"].keys()
        for name, w in single["after"].items():
            assert (got["after"][name] - w).abs().max() < tol, name
        for m_got, m_single in zip(got["metrics"], single["metrics"], strict=True):
            for key in METRICS:
                assert m_got[key] == pytest.approx(m_single[key], rel=1e-4, abs=1e-6), key
