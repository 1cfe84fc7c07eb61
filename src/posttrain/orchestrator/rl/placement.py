"""Placement backends: where the rollout engines run.

`local` (the default) builds the engine in this process. `ray` runs `placement.num_engines` rollout
engines as Ray actors (each `placement.engine_cpus` CPUs and `placement.engine_gpus` GPUs, in one
placement group; a local Ray cluster unless `placement.ray_address` names one) behind `RayEngines`, which gives the controller the same
`Engine` interface: requests go to the engine with the fewest in flight, awaited without blocking the
event loop, so continuous batching works across callers as in-process. Weights reach the actors
through the shared-file transport (`weight_sync`: the controller pushes, each actor reads, verifies
and loads) or, with `placement.weight_sync: broadcast`, by a torch.distributed broadcast from the
controller (rank 0) to a group the actors join at start (gloo on CPU engines, NCCL on CUDA ones). Either
way the controller checks every actor reports the pushed version.

An actor that dies mid-step is restarted by Ray (up to `MAX_RESTARTS` times); the new actor loads the
latest published weights, then runs the requests that were in flight again (a request is pure: seeded
sampling of given tokens). A broadcast group cannot take in a replacement, so under `broadcast` an
actor is not restarted: its requests go to the engines left. Past the restarts, requests fail, and
the rollout code counts their episodes as infrastructure failures, never as scores. In async mode a replacement may load weights
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
    """A rollout engine inside a Ray actor: built from the run config, fed by the shared-file transport
    (`weight_dir`) or by the broadcast group it joins (`join_broadcast`)."""

    def __init__(self, cfg_json: str, weight_dir: str | None, threads: int) -> None:
        import torch

        import posttrain.orchestrator.rl.weight_sync as ws
        from posttrain.config import RunConfig
        from posttrain.engine import make_engine
        from posttrain.longctx.rope import apply_rope_scaling
        from posttrain.models import load_policy, load_tokenizer

        torch.set_num_threads(max(1, threads))
        cfg = RunConfig.model_validate_json(cfg_json)
        tokenizer = load_tokenizer(cfg.model.spec)
        model = apply_rope_scaling(
            load_policy(cfg.model.spec, dtype=cfg.engine.dtype, seed=cfg.seed), cfg.model.rope_scaling
        )
        # LoRA pushes carry adapters only: keep the base weights they are merged into
        base = {k: v.detach().clone() for k, v in model.state_dict().items()} if cfg.model.lora_rank else None
        self.engine = make_engine(cfg.engine, model, tokenizer)
        self.device = cfg.engine.device
        self.transport = ws.SharedFile(weight_dir) if weight_dir is not None else None
        self.broadcast: ws.Broadcast | None = None
        self.receiver = ws.Receiver(self.engine, base=base)
        if self.transport is not None and self.transport.latest() is not None:  # a restarted actor catches up
            self.transport.pull(self.receiver)

    def join_broadcast(self, address: str, rank: int, world: int, timeout_s: float) -> None:
        """Join the controller's weight-broadcast group as `rank` (blocks until every member has)."""
        import posttrain.orchestrator.rl.weight_sync as ws

        join_broadcast_group(address, rank, world, self.device, timeout_s)
        self.broadcast = ws.Broadcast(src=0, device=self.device)

    def receive_broadcast(self) -> int | None:
        """Take part in one broadcast push from rank 0; the version this engine now holds."""
        if self.broadcast is None:
            raise RuntimeError("this engine has not joined a broadcast group")
        self.broadcast.push(None, self.receiver)
        return self.receiver.version

    def rewind(self) -> None:
        """Forget the version held (a resumed run pushes from its checkpoint's version again)."""
        self.receiver.version = None

    def ready(self) -> int | None:
        return self.receiver.version

    def pid(self) -> int:
        return os.getpid()

    async def generate(self, request: GenerationRequest) -> GenerationOutput:
        return await self.engine.agenerate(request)

    def pull(self) -> int | None:
        """Load the latest published weights if they are new; the version this engine now holds."""
        if self.transport is None:
            raise RuntimeError("this engine receives weights by broadcast, not from a folder")
        self.transport.pull(self.receiver)
        return self.receiver.version

    def release_kv_cache(self) -> None:
        self.engine.release_kv_cache()

    def release_weights(self) -> None:
        """Free the engine's weights and KV cache until the next push (placement.offload_engine_weights)."""
        self.engine.release_weights()

    def weight_storage_bytes(self) -> int:
        return self.engine.runner.weight_storage_bytes()


def join_broadcast_group(address: str, rank: int, world: int, device: str, timeout_s: float) -> None:
    """init_process_group for the weight broadcast: gloo for CPU engines, NCCL for CUDA ones."""
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError(
            "placement.weight_sync=broadcast: torch.distributed is already initialised in this process"
        )
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo",
        init_method=f"tcp://{address}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def import_ray() -> Any:
    """The ray module, or a clear error naming the extra to install."""
    try:
        import ray
    except ImportError:
        raise RuntimeError(
            "placement.backend=ray needs the [ray] extra: pip install 'posttrain[ray]'"
        ) from None
    return ray


def engine_resources(cfg: Any) -> tuple[dict[str, float], dict[str, float]]:
    """`ray_pool.actor_resources` of one rollout-engine actor: `placement.engine_cpus`, `engine_gpus`."""
    from posttrain.sandbox.ray_pool import actor_resources

    return actor_resources(cfg.placement.engine_cpus, cfg.placement.engine_gpus)


class RayEngines(Engine):
    """The `Engine` interface over rollout-engine actors (see the module docstring). `weight_dir`: the
    shared-file folder the actors read; None: weights travel by broadcast (`broadcast_weights`)."""

    caches_prefixes = True

    def __init__(self, cfg: Any, weight_dir: str | None) -> None:
        from posttrain.sandbox.ray_pool import ActorGroup, init_ray

        ray = import_ray()
        p = cfg.placement
        self._ray = ray
        s, r = cfg.sandbox, cfg.reward  # a local cluster has room for the sandbox and reward actors too
        wanted = (
            p.num_engines * p.engine_cpus
            + (s.ray_actors * s.ray_actor_cpus if s.mode == "ray" else 0)
            + r.ray_actors * r.ray_actor_cpus
        )
        self.started_ray = init_ray(ray, p.ray_address, wanted)
        self.group = ActorGroup(
            EngineWorker,
            (cfg.model_dump_json(), weight_dir, int(p.engine_cpus)),
            p.num_engines,
            p.engine_cpus,
            gpus=p.engine_gpus,
            what="rollout engines (placement.engine_cpus, engine_gpus)",
            strategy="PACK",
            max_restarts=MAX_RESTARTS if weight_dir is not None else 0,
            max_concurrency=1000,
            ready_timeout_s=120.0,
        )
        self.actors = self.group.handles
        ray.get([a.ready.remote() for a in self.actors], timeout=600)
        self.in_flight = [0] * len(self.actors)
        self.restarting: set[int] = set()
        self.version = 0
        self.pushed: int | None = None  # the last version broadcast (None: none yet)
        self.broadcaster = None if weight_dir is not None else self._form_broadcast_group(cfg.engine.device)

    def _form_broadcast_group(self, device: str, timeout_s: float = 600.0) -> Any:
        """This process as rank 0, actor i as rank i + 1, rendezvous at this node's address."""
        import socket

        import posttrain.orchestrator.rl.weight_sync as ws

        host = self._ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        world = len(self.actors) + 1
        joins = [
            a.join_broadcast.remote(f"{host}:{port}", i + 1, world, timeout_s)
            for i, a in enumerate(self.actors)
        ]
        join_broadcast_group(f"{host}:{port}", 0, world, device, timeout_s)
        self._ray.get(joins, timeout=timeout_s)
        return ws.Broadcast(src=0, device=device)

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
            "rollout engines on Ray load weights through the shared-file transport (pull_weights) or the "
            "broadcast (broadcast_weights), not in this process"
        )

    def broadcast_weights(self, update: Any) -> None:
        """Broadcast `update` (a `weight_sync.WeightUpdate`) to every actor; each must report its version."""
        import posttrain.orchestrator.rl.weight_sync as ws

        if self.broadcaster is None:
            raise RuntimeError("these rollout engines read weights from a folder (pull_weights)")
        if self.pushed is not None and update.version <= self.pushed:  # a receiver refusing it would hang
            raise ws.StaleUpdate(f"broadcast of v{update.version}: the engines hold v{self.pushed}")
        got = [a.receive_broadcast.remote() for a in self.actors]
        self.broadcaster.push(update)
        self._check_versions(self._ray.get(got, timeout=600), update.version)
        self.pushed = update.version

    def rewind_weights(self) -> None:
        """Forget the pushed versions on both sides (a resume pushes its checkpoint's version again)."""
        self._ray.get([a.rewind.remote() for a in self.actors], timeout=600)
        self.pushed = None

    def _check_versions(self, got: list[int | None], version: int) -> None:
        wrong = [f"engine {i}: v{v}" for i, v in enumerate(got) if v != version]
        if wrong:
            raise RuntimeError(f"weight push v{version} did not reach every engine ({', '.join(wrong)})")
        self.version = version

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
        self._check_versions(got, version)

    def release_kv_cache(self) -> None:
        self._ray.get([a.release_kv_cache.remote() for a in self.actors], timeout=600)

    def release_weights(self) -> None:
        """Every actor frees its engine's weights until the next push; an actor Ray restarts meanwhile
        loads the latest published weights, whole, before the push brings the new ones."""
        self._ray.get([a.release_weights.remote() for a in self.actors], timeout=600)

    def kill(self, index: int) -> None:
        """Kill engine `index` the way a crash would (Ray restarts it): for failure tests."""
        self._ray.kill(self.actors[index], no_restart=False)

    def close(self) -> None:
        self.group.close()  # the actors and their placement group
        self.actors = []
        if self.broadcaster is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.broadcaster = None
        if self.started_ray:
            self._ray.shutdown()
