"""Placement backends: where the rollout engines run.

`local` (the default) builds the engine in this process. `ray` runs `placement.num_engines` rollout
engines as Ray actors (each `placement.engine_cpus` CPUs, in one placement group; a local Ray cluster
unless `placement.ray_address` names one) behind `RayEngines`, which gives the controller the same
`Engine` interface: requests go to the engine with the fewest in flight, awaited without blocking the
event loop, so continuous batching works across callers as in-process. Weights reach the actors
through the shared-file transport (`weight_sync`): the controller pushes, each actor reads, verifies
and loads, and the controller checks every actor reports the pushed version.

An actor that dies mid-step is restarted by Ray (up to `MAX_RESTARTS` times); the new actor loads the
latest published weights, then runs the requests that were in flight again (a request is pure: seeded
sampling of given tokens). Past the restarts, requests fail, and the rollout code counts their
episodes as infrastructure failures, never as scores. In async mode a replacement may load weights
pushed after an in-flight request started: that request's tokens then come from the newer policy.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from posttrain.engine.types import Engine, GenerationOutput, GenerationRequest

MAX_RESTARTS = 3


class EngineWorker:
    """A rollout engine inside a Ray actor: built from the run config, fed by the shared-file transport."""

    def __init__(self, cfg_json: str, weight_dir: str, threads: int) -> None:
        import torch

        from posttrain.config import RunConfig
        from posttrain.engine import make_engine
        from posttrain.longctx.rope import apply_rope_scaling
        from posttrain.models import load_policy, load_tokenizer
        from posttrain.orchestrator import weight_sync as ws

        torch.set_num_threads(max(1, threads))
        cfg = RunConfig.model_validate_json(cfg_json)
        tokenizer = load_tokenizer(cfg.model.spec)
        model = apply_rope_scaling(
            load_policy(cfg.model.spec, dtype=cfg.engine.dtype, seed=cfg.seed), cfg.model.rope_scaling
        )
        # LoRA pushes carry adapters only: keep the base weights they are merged into
        base = {k: v.detach().clone() for k, v in model.state_dict().items()} if cfg.model.lora_rank else None
        self.engine = make_engine(cfg.engine, model, tokenizer)
        self.transport = ws.SharedFile(weight_dir)
        self.receiver = ws.Receiver(self.engine, base=base)
        if self.transport.latest() is not None:  # a restarted actor catches up before it serves
            self.transport.pull(self.receiver)

    def ready(self) -> int | None:
        return self.receiver.version

    def pid(self) -> int:
        return os.getpid()

    async def generate(self, request: GenerationRequest) -> GenerationOutput:
        return await self.engine.agenerate(request)

    def pull(self) -> int | None:
        """Load the latest published weights if they are new; the version this engine now holds."""
        self.transport.pull(self.receiver)
        return self.receiver.version

    def release_kv_cache(self) -> None:
        self.engine.release_kv_cache()


class RayEngines(Engine):
    """The `Engine` interface over rollout-engine actors (see the module docstring)."""

    caches_prefixes = True

    def __init__(self, cfg: Any, weight_dir: str) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group, remove_placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise RuntimeError(
                "placement.backend=ray needs the [ray] extra: pip install 'posttrain[ray]'"
            ) from None
        p = cfg.placement
        self._ray = ray
        self._remove_pg = remove_placement_group
        self.started_ray = False
        if not ray.is_initialized():
            ray.init(
                address=p.ray_address,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
                num_cpus=None if p.ray_address else max(os.cpu_count() or 1, p.num_engines * p.engine_cpus),
            )
            self.started_ray = True
        self.pg = placement_group([{"CPU": p.engine_cpus}] * p.num_engines, strategy="PACK")
        ray.get(self.pg.ready(), timeout=120)
        actor = ray.remote(num_cpus=p.engine_cpus, max_restarts=MAX_RESTARTS, max_concurrency=1000)(
            EngineWorker
        )
        cfg_json = cfg.model_dump_json()
        self.actors = [
            actor.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)
            ).remote(cfg_json, weight_dir, int(p.engine_cpus))
            for i in range(p.num_engines)
        ]
        ray.get([a.ready.remote() for a in self.actors], timeout=600)
        self.in_flight = [0] * len(self.actors)
        self.restarting: set[int] = set()
        self.version = 0

    # -- Engine ------------------------------------------------------------------------------------------

    async def agenerate(self, request: GenerationRequest) -> GenerationOutput:
        """The request on the least busy engine. A request is pure (seeded sampling of given tokens), so
        one whose engine died is sent again once a replacement (or another engine) is up."""
        from ray.exceptions import ActorUnavailableError, RayActorError

        for attempt in range(MAX_RESTARTS + 1):
            live = [j for j in range(len(self.actors)) if j not in self.restarting] or list(
                range(len(self.actors))
            )
            i = min(live, key=lambda j: self.in_flight[j])
            if i in self.restarting:
                await self._until_ready(i)
            self.in_flight[i] += 1
            try:
                return await self.actors[i].generate.remote(request)
            except (ActorUnavailableError, RayActorError):
                if attempt == MAX_RESTARTS:
                    raise
                self.restarting.add(i)
            finally:
                self.in_flight[i] -= 1
        raise AssertionError("unreachable")

    async def _until_ready(self, i: int, timeout_s: float = 300.0) -> None:
        """Wait until engine `i`'s replacement answers (it loads the latest weights first)."""
        from ray.exceptions import ActorUnavailableError

        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            try:
                await self.actors[i].ready.remote()
                self.restarting.discard(i)
                return
            except ActorUnavailableError:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.2)

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationOutput]:
        async def all_of() -> list[GenerationOutput]:
            return list(await asyncio.gather(*(self.agenerate(r) for r in requests)))

        return asyncio.run(all_of())

    def load_weights(self, weights: Any, version: int | None = None) -> None:
        raise RuntimeError(
            "rollout engines on Ray load weights through the shared-file transport (pull_weights), not in "
            "this process"
        )

    def pull_weights(self, version: int) -> None:
        """Every actor loads the pushed `version`; an actor that reports another one is an error."""
        from ray.exceptions import ActorUnavailableError

        got: list[int | None] = []
        for a in self.actors:
            for _ in range(1500):  # a restarting engine loads the latest push itself; wait for it (5 min)
                try:
                    got.append(self._ray.get(a.pull.remote(), timeout=600))
                    break
                except ActorUnavailableError:
                    time.sleep(0.2)
            else:
                raise RuntimeError(f"engine {self.actors.index(a)} did not come back within 5 minutes")
        wrong = [f"engine {i}: v{v}" for i, v in enumerate(got) if v != version]
        if wrong:
            raise RuntimeError(f"weight push v{version} did not reach every engine ({', '.join(wrong)})")
        self.version = version

    def release_kv_cache(self) -> None:
        self._ray.get([a.release_kv_cache.remote() for a in self.actors], timeout=600)

    def kill(self, index: int) -> None:
        """Kill engine `index` the way a crash would (Ray restarts it): for failure tests."""
        self._ray.kill(self.actors[index], no_restart=False)

    def close(self) -> None:
        for a in self.actors:
            self._ray.kill(a, no_restart=True)
        self.actors = []
        self._remove_pg(self.pg)
        if self.started_ray:
            self._ray.shutdown()
