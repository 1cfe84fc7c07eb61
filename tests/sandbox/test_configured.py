"""make_sandbox applies the config's per-job limits for every user (training, eval, tasks check)."""

from __future__ import annotations

import asyncio

from posttrain.config import SandboxConfig, load_config
from posttrain.sandbox import ConfiguredSandbox, ExecResult, ExecStatus, Job, Limits, make_sandbox


class Recorder:
    def __init__(self) -> None:
        self.jobs: list[Job] = []

    async def run(self, job: Job) -> ExecResult:
        self.jobs.append(job)
        return ExecResult(ExecStatus.OK)

    async def run_batch(self, jobs: list[Job]) -> list[ExecResult]:
        return [await self.run(j) for j in jobs]


def test_jobs_get_the_wall_ceiling_and_the_memory_limit():
    inner = Recorder()
    sb = ConfiguredSandbox(inner, SandboxConfig(wall_time_s=3, memory_mb=100))
    asyncio.run(sb.run(Job(code="", limits=Limits(wall_time_s=20.0, cpu_time_s=9.0))))
    asyncio.run(sb.run_batch([Job(code="", limits=Limits(wall_time_s=1.0, cpu_time_s=1.5))]))
    got = [(j.limits.wall_time_s, j.limits.cpu_time_s, j.limits.memory_bytes) for j in inner.jobs]
    assert got == [(3.0, 3.0, 100 << 20), (1.0, 1.5, 100 << 20)]


def test_make_sandbox_wraps_the_configured_backend():
    remote = make_sandbox(
        load_config(
            None, ["sandbox.mode=remote", "sandbox.url=http://127.0.0.1:9", "sandbox.wall_time_s=7"]
        ).sandbox
    )
    assert isinstance(remote, ConfiguredSandbox) and remote.limits.wall_time_s == 7.0


def test_the_service_limit_key_was_renamed_with_a_hint():
    import pytest

    from posttrain.config import ConfigError

    with pytest.raises(ConfigError, match="sandbox.max_concurrent_jobs"):
        load_config(None, ["sandbox.max_concurrent_requests=4"])
