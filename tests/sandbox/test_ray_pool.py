"""`sandbox.mode: ray`: warm pools inside Ray actors behind `RaySandboxPool`. The same jobs give the
local pool's results; an actor killed mid-batch (`ray.kill`) loses no job to a score, and Ray's
replacement passes a health check and gets jobs again; a job no actor can run is `SANDBOX_ERROR`; bad
config values exit 2 naming the key. The Ray tests are slow: one local 2-CPU cluster for the module."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time

import pytest
from typer.testing import CliRunner

from posttrain.cli import app
from posttrain.config import SandboxConfig
from posttrain.sandbox import ExecStatus, Job, Limits, make_sandbox
from posttrain.sandbox.ray_pool import RaySandboxPool, ray_worker_config

CFG = SandboxConfig(mode="ray", ray_actors=2, ray_actor_cpus=0.5, pool_size=1)


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def _jobs() -> list[Job]:
    return [
        Job(code="print('hello')"),
        Job(code="import sys\nprint(sys.stdin.read().upper())", stdin=b"abc"),
        Job(code="import sys\nsys.stderr.write('no\\n')\nraise SystemExit(3)"),
        Job(code="1/0"),
        Job(
            code="open('out.txt', 'w').write(open('data.txt').read() * 2)",
            files={"data.txt": b"xy"},
        ),
        Job(code="echo $((2 + 3))", language="bash"),
        Job(code="print('x' * 100000)", limits=Limits(max_output_bytes=1000)),
        Job(code="while True:\n    pass", limits=Limits(wall_time_s=0.5, cpu_time_s=0.5)),
    ]


def _facts(res) -> dict:
    """Everything but the timings and memory figures, which differ between any two runs."""
    out = dataclasses.asdict(res)
    for key in ("wall_ms", "cpu_ms", "max_rss_bytes", "compile_ms"):
        out.pop(key)
    if res.status is ExecStatus.OUTPUT_TRUNCATED:
        # the cap kills the job (signal 9) unless it exits first (code 0): a race in any pool, local too
        out.pop("exit_code")
        out.pop("signal")
    return out


@pytest.mark.slow
def test_ray_actors_give_the_local_pools_results(ray_cluster):
    async def go():
        local = make_sandbox(ray_worker_config(CFG))
        pool = make_sandbox(CFG)
        try:
            return await local.run_batch(_jobs()), await pool.run_batch(_jobs()), dict(pool.stats)
        finally:
            await local.close()
            await pool.close()

    local, remote, stats = asyncio.run(go())
    assert [_facts(r) for r in remote] == [_facts(r) for r in local]
    assert [r.status for r in remote] == [
        ExecStatus.OK,
        ExecStatus.OK,
        ExecStatus.RUNTIME_ERROR,
        ExecStatus.RUNTIME_ERROR,
        ExecStatus.OK,
        ExecStatus.OK,
        ExecStatus.OUTPUT_TRUNCATED,
        ExecStatus.TIMEOUT,
    ]
    assert remote[1].stdout == b"ABC\n" and remote[4].files["out.txt"] == b"xyxy"
    assert stats == {"jobs": 8, "retried": 0, "sandbox_errors": 0, "node_failures": 0}


@pytest.mark.slow
def test_an_actor_killed_mid_batch_loses_no_job_and_its_replacement_gets_jobs_again(ray_cluster):
    jobs = [Job(code=f"import time\ntime.sleep(0.4)\nprint({i})") for i in range(8)]

    async def go():
        pool = RaySandboxPool(CFG, cooldown_s=0.5)
        try:
            before = await pool.health()
            batch = asyncio.ensure_future(pool.run_batch(jobs))
            await asyncio.sleep(0.6)  # both actors are running jobs of the batch
            pool.group.kill(0)
            results = await batch
            deadline = time.monotonic() + 120
            while True:  # Ray restarts the actor; it is back once a health check passes
                await asyncio.sleep(0.5)
                after = await pool.health()
                if after["nodes"][0]["ok"] or time.monotonic() > deadline:
                    break
            jobs_before = pool.nodes[0].jobs
            again = await pool.run_batch(jobs[:4])
            return before, results, after, again, pool.nodes[0].jobs - jobs_before, dict(pool.stats)
        finally:
            await pool.close()

    before, results, after, again, ran_on_0, stats = asyncio.run(go())
    assert [r.status for r in results + again] == [ExecStatus.OK] * 12
    assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(8)]
    assert stats["retried"] >= 1 and stats["node_failures"] >= 1 and stats["sandbox_errors"] == 0
    assert after["nodes"][0]["ok"] and after["nodes"][0]["pid"] != before["nodes"][0]["pid"]
    assert ran_on_0 == 2  # back in rotation: half of the next batch


@pytest.mark.slow
def test_a_job_no_actor_can_run_is_an_infra_failure_and_a_bad_job_raises(ray_cluster):
    cfg = CFG.model_copy(update={"ray_actors": 1})

    async def go():
        pool = RaySandboxPool(cfg, cooldown_s=0.5)
        try:
            with pytest.raises(ValueError, match="unknown language 'cobol'"):
                await pool.run(Job(code="x", language="cobol"))
            assert pool.stats["node_failures"] == 0  # a refused job is not the actor's failure
            pool.group.kill(0, restart=False)
            return await pool.run(Job(code="print(1)")), dict(pool.stats)
        finally:
            await pool.close()

    res, stats = asyncio.run(go())
    assert res.status == ExecStatus.SANDBOX_ERROR and res.is_infra_failure
    assert res.error.startswith("no sandbox actor could run this job (1 of 1 tried")
    assert "sandbox actor 0: sandbox actor failed" in res.error
    assert stats["sandbox_errors"] == 1


def test_bad_ray_sandbox_config_values_exit_2_naming_the_key():
    runner = CliRunner()
    for setting, message in [
        ("sandbox.ray_actors=0", "'sandbox.ray_actors': got 0: Input should be greater than or equal to 1"),
        ("sandbox.ray_actor_cpus=0", "'sandbox.ray_actor_cpus': got 0: Input should be greater than 0"),
        ("sandbox.mode=docker", "Input should be 'local', 'remote' or 'ray'"),
    ]:
        out = runner.invoke(app, ["config", "show", "--set", setting])
        assert out.exit_code == 2 and message in out.output, out.output


def test_each_actor_gets_its_cpu_share_of_workers_and_a_missing_extra_is_named(monkeypatch):
    assert ray_worker_config(CFG.model_copy(update={"pool_size": 0})).pool_size == 1
    assert ray_worker_config(CFG.model_copy(update={"pool_size": 0, "ray_actor_cpus": 2.5})).pool_size == 3
    assert ray_worker_config(CFG).pool_size == 1 and ray_worker_config(CFG).mode == "local"
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(RuntimeError, match=r"sandbox.mode=ray needs the \[ray\] extra"):
        RaySandboxPool(CFG)
