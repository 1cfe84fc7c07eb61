"""placement.weight_sync=broadcast: the controller broadcasts each push (torch.distributed, gloo on CPU)
to the Ray engine actors of a local 2-CPU cluster. A 2-step run's pushes reach every engine (each
reports the version); then moved weights (full, or LoRA adapters with a real delta, merged at the
actor) broadcast as v3 leave every engine holding exactly what a local engine loads from the learner;
a stale broadcast is refused before it is sent. Slow: a Ray cluster and engine processes start."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from posttrain.telemetry import RunDir, read_metrics

from .test_loop import _cfg

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # _held runs in the actors

BROADCAST = [
    "placement.backend=ray",
    "placement.weight_sync=broadcast",
    "placement.num_engines=2",
    "placement.engine_cpus=1",
    "orchestrator.steps=2",
    "orchestrator.checkpoint_every=0",
    "curriculum.probe_every=0",
]


def _held(worker) -> tuple[dict[str, torch.Tensor], int | None]:
    """The engine's tensors (fused as it keeps them) and the version its receiver holds."""
    r = worker.engine.runner
    out = {"embed": r.embed, "lm_head": r.lm_head, "final_norm": r.final_norm}
    for i, layer in enumerate(r.layers):
        out.update({f"{i}.{k}": v for k, v in layer.items() if isinstance(v, torch.Tensor)})
    receiver = getattr(worker, "receiver", None)
    return {k: v.detach().clone() for k, v in out.items()}, receiver and receiver.version


def _check_engines_hold_the_learners_weights(tmp_path, *extra: str) -> tuple[float, int]:
    import posttrain.orchestrator.rl.weight_sync as ws
    from posttrain.engine import make_engine
    from posttrain.models import load_policy, load_tokenizer
    from posttrain.orchestrator.rl import RLRun
    from posttrain.train.state import merged_weights

    cfg = _cfg(tmp_path, *BROADCAST, *extra)
    rl = RLRun(cfg, RunDir.create(cfg.telemetry.run_dir, "broadcast"))
    try:
        rl.train()
        rows = read_metrics(rl.run_dir.metrics)
        # the loop's pushes (v0 at start, v1, v2) were broadcast and every engine reported each one
        assert [r["step"] for r in rows] == [1, 2] and rl.engine.pushed == rl.learner.version == 2
        reference = make_engine(
            cfg.engine,
            load_policy(cfg.model.spec, dtype=cfg.engine.dtype, seed=cfg.seed),
            load_tokenizer(cfg.model.spec),
        )
        initial, _ = _held(SimpleNamespace(engine=reference))
        g = torch.Generator().manual_seed(0)
        if rl.learner.lora:  # adapters with a real delta (peft starts B at 0), pushed as adapters
            for name, p in rl.learner.model.named_parameters():
                if "lora_B" in name:
                    p.data = torch.randn(p.shape, generator=g) * 0.1
            update = ws.lora_update(rl.learner.model, 3)
            reference.load_weights(merged_weights(rl.learner.model), version=3)
        else:  # every weight moved, the tied LM head with the embeddings
            unique, aliases = ws.dedupe(rl.learner.weights())
            moved = {k: v + 0.01 * torch.randn(v.shape, generator=g).to(v.dtype) for k, v in unique.items()}
            moved.update({alias: moved[name] for alias, name in aliases.items()})
            update = ws.full_update(moved, 3)
            reference.load_weights(moved, version=3)
        rl.engine.broadcast_weights(update)
        want, _ = _held(SimpleNamespace(engine=reference))
        assert any(not torch.equal(initial[k], want[k]) for k in want)
        for got, version in ray.get([a.__ray_call__.remote(_held) for a in rl.engine.actors]):
            assert version == 3 and sorted(got) == sorted(want)
            for k in want:
                assert torch.equal(got[k], want[k]), k
        with pytest.raises(ws.StaleUpdate, match="broadcast of v2: the engines hold v3"):
            rl.engine.broadcast_weights(ws.full_update(rl.learner.weights(), 2))
        return rows[-1]["timeline/weight_sync_bytes"], ws.full_update(rl.learner.weights(), 0).nbytes
    finally:
        rl.close()


def test_broadcast_brings_the_learners_full_weights_to_every_engine(tmp_path):
    sent, full = _check_engines_hold_the_learners_weights(tmp_path)
    assert sent == full  # the tied LM head once
    assert not ray.is_initialized()  # the run's own local cluster went with it


def test_broadcast_brings_lora_adapters_merged_to_every_engine(tmp_path):
    # float32 engines: the actor merges into its base in the engine's dtype, merged_weights in float32
    lora = ["model.lora_rank=4", "model.lora_alpha=8", "engine.dtype=float32"]
    sent, full = _check_engines_hold_the_learners_weights(tmp_path, *lora)
    assert 0 < sent < full / 10  # adapters only
