"""The RL loop on a tiny MoE (tiny:mixtral): the engine's expert choices reach the Learner through the
rollouts of a math and a tool domain (up to 2 turns; every trajectory's routing covers its fed
positions, or replay would refuse the batch), replay and the aux losses run in the loop, and the
routing metrics are logged."""

from __future__ import annotations

from posttrain.config import load_config
from posttrain.orchestrator.rl import RLRun
from posttrain.telemetry import RunDir, read_metrics

TINY_MOE = [
    "model.spec=tiny:mixtral",
    "engine.num_kv_blocks=512",
    "engine.max_new_tokens=16",
    "envs.max_episode_tokens=80",
    "envs.max_turns=2",
    "envs.domains=[{name: math, difficulties: [0]}, {name: tools.apis, difficulties: [0]}]",
    "batch.samples_per_prompt=2",
    "batch.prompts_per_step=2",
    "orchestrator.steps=2",
    "orchestrator.checkpoint_every=0",
    "curriculum.probe_every=0",
    "trainer.lr=1e-3",
    "trainer.moe.routing_replay=true",
    "trainer.moe.aux_loss_coef=0.01",
    "trainer.moe.z_loss_coef=0.001",
    "telemetry.progress=false",
    "telemetry.tensorboard=false",
]


def test_grpo_with_routing_replay_on_a_tiny_moe(tmp_path):
    cfg = load_config(None, [*TINY_MOE, f"telemetry.run_dir={tmp_path}"])
    run = RLRun(cfg, RunDir.create(tmp_path, "moe"))
    seen = []
    collect = run.collect_step

    def spy(step, spent=None):
        batch = collect(step, spent)
        seen.extend(batch.trajectories)
        return batch

    run.collect_step = spy
    run.train()
    assert seen and all(t.routing is not None and len(t.routing) == len(t.token_ids) - 1 for t in seen)
    rows = [r for r in read_metrics(run.run_dir.metrics) if "moe/routing_mismatch" in r]
    assert len(rows) == 2
    for r in rows:
        # same weights, same float32 arithmetic up to rounding: the Learner's free choice is the engine's
        assert r["moe/routing_mismatch"] < 0.05
        assert r["moe/aux_loss"] >= 1.0 - 1e-6 and r["moe/z_loss"] > 0
        assert 1.0 <= r["moe/load/layer0"] <= 4.0
