"""placement.backend=ray on a local Ray cluster: rollout engines as actors behind the Engine interface.
A 2-step run equals the local backend's for the same seed; an engine actor killed mid-step is replaced
by Ray, the replacement loads the latest weights and reruns the requests in flight, and the run goes on
with no episode lost. Slow: a Ray cluster and engine processes start in each test."""

from __future__ import annotations

import pytest

from posttrain.telemetry import RunDir, read_metrics

from .test_loop import _cfg, _run, _untimed

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

RAY = ["placement.backend=ray", "placement.weight_sync=shared_file", "placement.engine_cpus=2"]


def test_ray_rollout_engines_train_as_the_local_backend(tmp_path):
    local = _run(_cfg(tmp_path, "orchestrator.steps=2"), "local")
    remote = _run(_cfg(tmp_path, "orchestrator.steps=2", *RAY), "ray")
    rows_l = _untimed(read_metrics(local.run_dir.metrics))
    rows_r = _untimed(read_metrics(remote.run_dir.metrics))
    assert [r["step"] for r in rows_r] == [1, 2]
    for a, b in zip(rows_l, rows_r, strict=True):
        assert a.keys() == b.keys()
        for k in a:  # rewards, counts and tokens exactly (below); floats up to summation order
            # the engine's logprobs depend on which requests shared a decode batch (float rounding of
            # matmuls of other shapes: ~1e-5 nats here), and batches form by arrival time over RPC
            tol = 1e-4 if k.startswith("train/mismatch") else 1e-6
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=tol), k
        assert (
            b["reward/mean"] == a["reward/mean"]
            and b["rollout/generated_tokens"] == a["rollout/generated_tokens"]
        )
    local.close()
    remote.close()


def test_async_disaggregated_ray_engine_trains_as_the_local_async_run(tmp_path):
    """orchestrator.mode=async with the fixed lag: the engine actor generates batch b+1 while the learner
    updates on batch b, and the run equals the local async run (batches depend on the lag, not timing)."""
    sets = ["orchestrator.steps=3", "orchestrator.mode=async", "orchestrator.max_staleness=1"]
    local = _run(_cfg(tmp_path, *sets), "local-async")
    remote = _run(_cfg(tmp_path, *sets, *RAY[:2], "placement.engine_cpus=1"), "ray-async")
    rows_l = _untimed(read_metrics(local.run_dir.metrics))
    rows_r = _untimed(read_metrics(remote.run_dir.metrics))
    assert [r["step"] for r in rows_r] == [1, 2, 3]
    for a, b in zip(rows_l, rows_r, strict=True):
        assert b["reward/mean"] == a["reward/mean"]
        assert b["rollout/generated_tokens"] == a["rollout/generated_tokens"]
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-4, abs=1e-6)
    local.close()
    remote.close()


def test_a_killed_engine_actor_is_replaced_and_no_episode_is_lost(tmp_path, monkeypatch):
    from posttrain.orchestrator.rl import RLRun
    from posttrain.orchestrator.rl.placement import RayEngines

    calls = {"n": 0, "pid": None}
    real = RayEngines.agenerate

    async def killing(self, request):
        calls["n"] += 1
        if calls["n"] == 3:  # mid-step 1: the actor dies with requests in flight
            calls["pid"] = await self.actors[0].pid.remote()
            self.kill(0)
        return await real(self, request)

    monkeypatch.setattr(RayEngines, "agenerate", killing)
    cfg = _cfg(tmp_path, "orchestrator.steps=3", "curriculum.probe_every=0", *RAY)
    run_dir = RunDir.create(cfg.telemetry.run_dir, "kill")
    rl = RLRun(cfg, run_dir)
    rl.train()
    rows = read_metrics(run_dir.metrics)
    assert [r["step"] for r in rows] == [1, 2, 3]  # the run went on
    # the requests in flight ran again on the replacement: no episode lost, none scored as a failure
    assert [r["rollout/infra_failures"] for r in rows] == [0, 0, 0]
    assert rows[0]["rollout/episodes"] == cfg.batch.prompts_per_step * cfg.batch.samples_per_prompt
    pid, version = ray.get([rl.engine.actors[0].pid.remote(), rl.engine.actors[0].ready.remote()])
    assert calls["pid"] is not None and pid != calls["pid"]  # a new process ...
    assert version == rl.learner.version  # ... with the latest push
    rl.close()
    assert not ray.is_initialized()  # the run's own local cluster went with it
