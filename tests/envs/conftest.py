"""Shared fixtures for the environment tests: one warm sandbox for the whole session, and a sandbox
double that always fails like broken infrastructure."""

from __future__ import annotations

import asyncio

import pytest

from posttrain.sandbox.api import ExecResult, ExecStatus


@pytest.fixture(scope="session")
def sandbox():
    from posttrain.sandbox import LocalSandbox, SandboxUnavailable

    try:
        sb = LocalSandbox(pool_size=2)
    except SandboxUnavailable as err:
        pytest.skip(f"sandbox unavailable on this machine: {err}")
    yield sb
    sb.close_blocking()


class BrokenSandbox:
    """Every job comes back as SANDBOX_ERROR (or raises, with raises=True)."""

    def __init__(self, raises: bool = False) -> None:
        self.raises = raises
        self.jobs = 0

    async def run(self, job):
        self.jobs += 1
        if self.raises:
            raise ConnectionError("sandbox service unreachable")
        return ExecResult(status=ExecStatus.SANDBOX_ERROR, error="worker died")

    async def run_batch(self, jobs):
        return [await self.run(j) for j in jobs]

    async def close(self):
        return None


def run(coro):
    return asyncio.run(coro)


def step_twice(domain, task, second: str):
    """(first, again): the reference answer's step result, then a second step's with `second`."""

    async def go():
        env = domain.make_env()
        await env.reset(task)
        first = await env.step(domain.reference(task)[0])
        return first, await env.step(second)

    return run(go())
