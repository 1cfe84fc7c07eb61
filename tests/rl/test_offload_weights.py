"""placement.offload_engine_weights: the paged engine's weights are freed around each learner update and
restored by the push after it; a run with it equals the run without, and configs it cannot serve are
refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.config import ConfigError, load_config, save_config
from posttrain.orchestrator.rl import RLRun
from posttrain.telemetry import RunDir, read_metrics

from .test_loop import DOMAINS
from .test_loop import TINY as LOOP_TINY

# test_loop's tiny run, 2 steps, no probes or checkpoints; the tiny model earns no reward, so an entropy
# bonus makes the learner move and every push carry new weights
TINY = [
    *LOOP_TINY,
    *DOMAINS,
    "algorithm.entropy_coef=0.01",
    "orchestrator.steps=2",
    "orchestrator.checkpoint_every=0",
    "curriculum.probe_every=0",
]


def _run(tmp_path: Path, name: str, *extra: str) -> tuple[RLRun, list[int]]:
    """A 2-step run; the engine's weight bytes seen at the start of every learner step."""
    cfg = load_config(None, [*TINY, f"telemetry.run_dir={tmp_path}", *extra])
    run_dir = RunDir.create(cfg.telemetry.run_dir, name)
    save_config(cfg, run_dir.config)
    rl = RLRun(cfg, run_dir)
    rl.build()
    seen: list[int] = []
    step = rl.learner.step
    actors = getattr(rl.engine, "actors", None)  # the Ray placement: the bytes of every engine actor's

    def observed_step(*args, **kwargs):
        if actors is None:
            seen.append(rl.engine.runner.weight_storage_bytes())
        else:
            import ray

            seen.append(sum(ray.get([a.weight_storage_bytes.remote() for a in actors], timeout=60)))
        return step(*args, **kwargs)

    rl.learner.step = observed_step
    rl.train()
    return rl, seen


def _untimed(rl: RLRun) -> list[dict]:
    """The run's logged rows without wall-clock figures (seconds, rates, timestamps)."""
    return [
        {
            k: v
            for k, v in r.items()
            if not k.startswith(("timeline/", "time")) and not k.endswith(("_s", "_per_s"))
        }
        for r in read_metrics(rl.run_dir.metrics)
    ]


@pytest.mark.parametrize("sync", ["in_process", "shared_file"])
def test_a_run_with_engine_weights_offloaded_equals_the_run_without(tmp_path, sync):
    plain, kept = _run(tmp_path, f"plain-{sync}", f"placement.weight_sync={sync}")
    off, freed = _run(
        tmp_path, f"off-{sync}", f"placement.weight_sync={sync}", "placement.offload_engine_weights=true"
    )
    try:
        assert len(kept) == len(freed) == 2
        assert all(b > 0 for b in kept) and freed == [0, 0]  # released during every update
        rows = _untimed(off)
        assert rows == _untimed(plain) and len(rows) == 2
        assert all(r["train/grad_norm"] > 0 for r in rows)  # the weights moved: each push carried new ones
        for name, tensor in plain.learner.weights().items():
            assert torch.equal(tensor, off.learner.weights()[name]), name
        # restored by the last push: the engine holds the learner's final weights, whole
        assert off.engine.runner.weight_storage_bytes() == plain.engine.runner.weight_storage_bytes()
        for name, tensor in off.learner.weights().items():
            found = off.engine.runner.weight_for(name)
            if found is not None:
                assert torch.equal(found[0], tensor.to(found[0].dtype)), name
        events = [e for e in off.phases.events if e in ("release_weights", "update", "sync_weights")]
        assert events == ["sync_weights"] + ["release_weights", "update", "sync_weights"] * 2
    finally:
        plain.close()
        off.close()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["orchestrator.mode=async"], "offload_engine_weights: orchestrator.mode=async generates during"),
        (["engine.backend=hf"], "offload_engine_weights: engine.backend=hf has no weight release"),
        (
            ["model.lora_rank=4", "placement.weight_sync=shared_file"],
            "offload_engine_weights: LoRA pushes through placement.weight_sync=shared_file",
        ),
    ],
)
def test_weight_offload_is_refused_where_it_cannot_work(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*TINY, "placement.offload_engine_weights=true", *extra])
    load_config(None, [*TINY, *extra])  # the same config without the key is valid


@pytest.mark.slow
def test_ray_engine_actors_offload_their_weights_and_train_as_the_local_run(tmp_path):
    pytest.importorskip("ray")
    ray_sets = ["placement.backend=ray", "placement.weight_sync=shared_file", "placement.engine_cpus=1"]
    local, kept = _run(tmp_path, "local")
    remote, freed = _run(tmp_path, "ray", *ray_sets, "placement.offload_engine_weights=true")
    try:
        assert all(b > 0 for b in kept) and freed == [0, 0]  # the actor's engine held nothing
        rows_l, rows_r = _untimed(local), _untimed(remote)
        assert len(rows_r) == 2
        for a, b in zip(rows_l, rows_r, strict=True):
            assert b["reward/mean"] == a["reward/mean"]
            assert b["rollout/generated_tokens"] == a["rollout/generated_tokens"]
            # the actor's logprobs depend on which requests shared a decode batch (see test_ray_placement)
            assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-4, abs=1e-6)
    finally:
        local.close()
        remote.close()
