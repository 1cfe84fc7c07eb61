"""The config's per-job limits: every job sent through `ConfiguredSandbox` (what `make_sandbox` returns, so
training, eval and `tasks check` alike) has its wall and CPU time capped at `sandbox.wall_time_s` and its
memory limit set to `sandbox.memory_mb`. It does not execute anything: the wrapped sandbox does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from posttrain.sandbox.api import ExecResult, Job, Limits


class ConfiguredSandbox:
    """A `Sandbox` that applies the config's per-job limits, then hands the job to `inner`."""

    def __init__(self, inner: Any, cfg: Any) -> None:
        self.inner = inner
        self.limits = Limits(
            wall_time_s=cfg.wall_time_s, cpu_time_s=cfg.wall_time_s, memory_bytes=cfg.memory_mb << 20
        )

    def apply(self, job: Job) -> Job:
        """`job` with wall/CPU time at most the configured ones and the configured memory limit."""
        lim = job.limits
        capped = dataclasses.replace(
            lim,
            wall_time_s=min(lim.wall_time_s, self.limits.wall_time_s),
            cpu_time_s=min(lim.cpu_time_s, self.limits.cpu_time_s),
            memory_bytes=self.limits.memory_bytes,
        )
        return dataclasses.replace(job, limits=capped)

    async def run(self, job: Job) -> ExecResult:
        return await self.inner.run(self.apply(job))

    async def run_batch(self, jobs: Sequence[Job]) -> list[ExecResult]:
        return await self.inner.run_batch([self.apply(j) for j in jobs])

    async def close(self) -> None:
        await self.inner.close()

    def __getattr__(self, name: str) -> Any:  # stats, layers, warm(), ... of the wrapped sandbox
        return getattr(self.inner, name)
