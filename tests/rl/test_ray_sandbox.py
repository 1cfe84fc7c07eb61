"""`sandbox.mode: ray` in a run: code episodes scored by sandbox actors log the local pool's step
metrics, and under `placement.backend: ray` the sandbox actors join the engines' cluster and go with
it at close. Slow: Ray clusters start here."""

from __future__ import annotations

import pytest

from posttrain.config import load_config
from posttrain.orchestrator.rl import RLRun
from posttrain.sandbox.ray_pool import RaySandboxPool
from posttrain.telemetry import RunDir, read_metrics

from .test_loop import TINY, FixedTextEngine, _untimed

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

SANDBOX_RAY = [
    "sandbox.mode=ray",
    "sandbox.ray_actors=2",
    "sandbox.ray_actor_cpus=0.5",
    "sandbox.pool_size=1",
]


def _code_run(tmp_path, name: str, *extra: str):
    cfg = load_config(
        None,
        [
            *TINY,
            "envs.domains=[{name: code.unit_tests, difficulties: [0]}, {name: math, difficulties: [0]}]",
            f"telemetry.run_dir={tmp_path}",
            "orchestrator.steps=1",
            "curriculum.probe_every=0",
            "curriculum.sampler=uniform_by_domain",
            *extra,
        ],
    )
    run_dir = RunDir.create(cfg.telemetry.run_dir, name)
    rl = RLRun(cfg, run_dir)
    rl.build()
    # every answer carries a code block, so code episodes reach the sandbox
    rl.engine = FixedTextEngine(rl.engine, rl.tokenizer, "```python\ndef solve(x):\n    return x\n```")
    rl.train()
    jobs = rl.sandbox.inner.stats["jobs"]
    rl.close()
    return read_metrics(run_dir.metrics), jobs


def test_code_episodes_on_sandbox_actors_log_the_local_pools_metrics(tmp_path):
    local, local_jobs = _code_run(tmp_path, "local", "sandbox.pool_size=1")
    actors, actor_jobs = _code_run(tmp_path, "actors", *SANDBOX_RAY)
    assert actor_jobs == local_jobs > 0  # the same jobs ran, on the actors
    assert _untimed(actors) == _untimed(local)
    assert actors[0]["rollout/infra_failures"] == 0 and "reward/code.unit_tests" in actors[0]
    assert not ray.is_initialized()  # the pool's own local cluster went with the run


def test_sandbox_actors_join_the_ray_engines_cluster_and_go_with_it(tmp_path):
    from posttrain.sandbox import Job

    cfg = load_config(
        None,
        [
            *TINY,
            "envs.domains=[{name: code.unit_tests, difficulties: [0]}]",
            f"telemetry.run_dir={tmp_path}",
            "placement.backend=ray",
            "placement.weight_sync=shared_file",
            *SANDBOX_RAY,
        ],
    )
    rl = RLRun(cfg, RunDir.create(cfg.telemetry.run_dir, "joined"))
    rl.build()
    pool = rl.sandbox.inner
    assert isinstance(pool, RaySandboxPool) and not pool.group.started_ray and rl.engine.started_ray
    assert ray.cluster_resources()["CPU"] >= 2  # room for 1 engine CPU and 2 x 0.5 sandbox CPUs
    res = rl.loop.run_until_complete(rl.sandbox.run(Job(code="print(6 * 7)")))
    assert res.stdout == b"42\n"
    rl.close()
    assert not ray.is_initialized()
