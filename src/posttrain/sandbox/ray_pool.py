"""The sandbox pool as Ray actors (`sandbox.mode: ray`): `sandbox.ray_actors` actors of
`sandbox.ray_actor_cpus` CPUs each, in one placement group (SPREAD), each owning a `LocalSandbox` warm
pool. `RaySandboxPool` spreads jobs over them with `BalancedSandbox`, the fleet's balancing and retry.
`ActorGroup` (start the actors of one class in one placement group, stop them) serves the rollout
engines, learner ranks and reward-model actors too.

An actor that dies takes its jobs in flight with it: they are retried on another actor, and the dead
one is out of rotation until Ray has restarted it (up to `MAX_RESTARTS` times) and it passes a health
check. A job no actor could run is `SANDBOX_ERROR`, never a score. A job an actor refuses (a bad job)
raises its `ValueError` here, as `LocalSandbox` does. Ray is imported lazily (the [ray] extra).
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Sequence
from typing import Any

from posttrain.sandbox.api import ExecResult, Job
from posttrain.sandbox.fleet import BalancedSandbox

MAX_RESTARTS = 3


class SandboxWorker:
    """A `LocalSandbox` inside a Ray actor, built from the sandbox config and warmed at start."""

    def __init__(self, cfg_json: str) -> None:
        from posttrain.config import SandboxConfig
        from posttrain.sandbox.pool import LocalSandbox

        self.sandbox = LocalSandbox(SandboxConfig.model_validate_json(cfg_json))
        self.sandbox.warm()

    async def run_batch(self, jobs: list[Job]) -> list[ExecResult]:
        return await self.sandbox.run_batch(jobs)

    def health(self) -> dict:
        return {"pid": os.getpid(), "layers": self.sandbox.layers, "stats": dict(self.sandbox.stats)}

    def close(self) -> None:
        """Stop the pools and kill their workers (before the actor itself is killed)."""
        self.sandbox.close_blocking()


class ActorClient:
    """One sandbox actor as a `BalancedSandbox` node: a dead or unanswering actor is a failed node."""

    def __init__(self, handle: Any, index: int, timeout_s: float) -> None:
        self.handle = handle
        self.index = index
        self.timeout_s = timeout_s

    @property
    def name(self) -> str:
        return f"sandbox actor {self.index}"

    async def try_batch(self, jobs: Sequence[Job]) -> tuple[list[ExecResult] | None, str]:
        from ray.exceptions import RayActorError

        if not jobs:
            return [], ""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self.handle.run_batch.remote(list(jobs)), ""
        except TimeoutError:
            return None, f"sandbox actor did not answer within {self.timeout_s} s"
        except RayActorError as err:  # died, or unreachable while Ray restarts it
            return None, f"sandbox actor failed: {type(err).__name__}: {str(err)[:300]}"

    async def health(self, timeout_s: float | None = None) -> dict:
        async with asyncio.timeout(timeout_s if timeout_s is not None else self.timeout_s):
            return await self.handle.health.remote()

    async def close(self) -> None:
        return None


def ray_worker_config(cfg: Any) -> Any:
    """The sandbox config each actor's `LocalSandbox` gets: local mode, and `pool_size` 0 resolved to the
    actor's CPUs rounded up (the node's CPU count is not the actor's share)."""
    pool_size = cfg.pool_size or max(1, math.ceil(cfg.ray_actor_cpus))
    return cfg.model_copy(update={"mode": "local", "pool_size": pool_size})


def actor_resources(cpus: float, gpus: float = 0.0) -> tuple[dict[str, float], dict[str, float]]:
    """One actor's placement-group bundle and its Ray actor options for `cpus` CPUs and `gpus` GPUs (a
    bundle names GPU only when it reserves some: Ray refuses a bundle of zero of a resource)."""
    bundle = {"CPU": cpus} | ({"GPU": gpus} if gpus > 0 else {})
    return bundle, {"num_cpus": cpus, "num_gpus": gpus}


def init_ray(ray: Any, address: str | None, want_cpus: float) -> bool:
    """Connect this process to Ray unless it is already: to the cluster at `address`, or (None) to a
    local cluster started with at least `want_cpus` CPUs (the machine's count if larger). True when this
    call connected, so the caller's close shuts it down."""
    if ray.is_initialized():
        return False
    ray.init(
        address=address,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        num_cpus=None if address else max(os.cpu_count() or 1, math.ceil(want_cpus)),
    )
    return True


class ActorGroup:
    """`n` Ray actors of `cls` (built with `args`), `cpus` CPUs and `gpus` GPUs each (`actor_resources`),
    one per bundle of one placement group (`strategy`), restarted by Ray up to `max_restarts` times.
    Joins the Ray cluster this process is connected to, or connects to `ray_address` (None: starts a
    local one, which `close` stops). `what` (the config key) names the errors: the missing [ray] extra,
    a cluster with no room within `ready_timeout_s`."""

    def __init__(
        self,
        cls: type,
        args: tuple,
        n: int,
        cpus: float,
        *,
        what: str,
        strategy: str,
        gpus: float = 0.0,
        max_restarts: int = MAX_RESTARTS,
        max_concurrency: int = 1,
        ray_address: str | None = None,
        ready_timeout_s: float = 300.0,
    ) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group, remove_placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise RuntimeError(f"{what} needs the [ray] extra: pip install 'posttrain[ray]'") from None
        self.ray, self._remove_pg = ray, remove_placement_group
        self.started_ray = init_ray(ray, ray_address, n * cpus)
        bundle, options = actor_resources(cpus, gpus)
        self.pg = placement_group([bundle] * n, strategy=strategy)
        if not self.pg.wait(timeout_seconds=int(ready_timeout_s)):
            self._remove_pg(self.pg)
            resources = ray.cluster_resources()
            if self.started_ray:  # the local cluster this call started goes with it
                ray.shutdown()
            raise RuntimeError(
                f"{what}: the Ray cluster has no room for {n} actors of {bundle} within {ready_timeout_s:.0f} s "
                f"(it has {resources})"
            )
        actor = ray.remote(**options, max_restarts=max_restarts, max_concurrency=max_concurrency)(cls)
        self.handles = [
            actor.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)
            ).remote(*args)
            for i in range(n)
        ]

    def kill(self, index: int, restart: bool = True) -> None:
        """Kill actor `index` the way a crash would (Ray restarts it unless `restart` is False)."""
        self.ray.kill(self.handles[index], no_restart=not restart)

    def close(self) -> None:
        """Kill every actor and free the placement group (nothing when closed, or the cluster went first)."""
        if not self.handles or not self.ray.is_initialized():
            self.handles = []
            return
        for handle in self.handles:
            self.ray.kill(handle, no_restart=True)
        self.handles = []
        self._remove_pg(self.pg)
        if self.started_ray:
            self.ray.shutdown()


class RaySandboxPool(BalancedSandbox):
    """`BalancedSandbox` over `cfg.ray_actors` sandbox actors (an `ActorGroup`, SPREAD; see the module
    docstring)."""

    what = "sandbox actor"

    def __init__(
        self,
        cfg: Any,
        ray_address: str | None = None,
        cooldown_s: float = 5.0,
        health_timeout_s: float = 10.0,
        ready_timeout_s: float = 300.0,
    ) -> None:
        self.group = ActorGroup(
            SandboxWorker,
            (ray_worker_config(cfg).model_dump_json(),),
            cfg.ray_actors,
            cfg.ray_actor_cpus,
            what="sandbox.mode=ray",
            strategy="SPREAD",
            max_concurrency=1000,
            ray_address=ray_address,
            ready_timeout_s=ready_timeout_s,
        )
        handles = self.group.handles
        self.group.ray.get([h.health.remote() for h in handles], timeout=ready_timeout_s)
        super().__init__(
            [ActorClient(h, i, cfg.remote_timeout_s) for i, h in enumerate(handles)],
            cooldown_s,
            health_timeout_s,
        )

    async def close(self) -> None:
        await super().close()
        if self.group.handles and self.group.ray.is_initialized():
            try:  # the workers first: killing an actor does not reach a worker it is still starting
                async with asyncio.timeout(60):
                    await asyncio.gather(
                        *(h.close.remote() for h in self.group.handles), return_exceptions=True
                    )
            except TimeoutError:
                pass
        self.group.close()
