"""The learner group: `trainer.data_parallel`, `tensor_parallel` or `context_parallel` > 1 (data x tensor,
data x context or context x tensor parallel, up to a 3-D dp x cp x tp mesh) starts that many Learner ranks, each in a process of its own (torch.multiprocessing spawn, one process group over
127.0.0.1: gloo, plus NCCL for CUDA tensors where CUDA exists; under trainer.device=cuda rank r holds
cuda:(r % GPUs)), and drives them from the controller.

Every rank gets the same call in the same order over its command channel (a pipe); rank 0's result comes
back. A rank that raises or dies stops the group: every rank process is ended and `LearnerRankError`
names the rank and its error. Checkpoints: FSDP and tensor-parallel ranks (context-parallel ones inside
a mesh with dp or tp too) write and read sharded torch.distributed.checkpoint folders (`save_sharded` /
`load_sharded`); context-parallel ranks alone hold the whole model, identical on every rank, so rank 0
writes the single-process Learner's folder and every rank reads it. Does not know about environments or engines.
"""

from __future__ import annotations

import contextlib
import pickle
import socket
import threading
import traceback
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from posttrain.config import RunConfig

STOP = b""  # the command that ends a rank's loop


class LearnerRankError(RuntimeError):
    """A learner rank raised or died; `rank` names it, `error` is its traceback or exit status."""

    def __init__(self, rank: int, error: str) -> None:
        lines = error.strip().splitlines() or ["(no message)"]
        detail = "\n" + error.strip() if len(lines) > 1 else ""  # a traceback: its last line first
        super().__init__(f"learner rank {rank} failed: {lines[-1]}{detail}")
        self.rank = rank
        self.error = error


def sharded(cfg: RunConfig) -> bool:
    """True when the ranks shard the weights (FSDP, tensor parallel): checkpoints are sharded folders."""
    return cfg.trainer.data_parallel > 1 or cfg.trainer.tensor_parallel > 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_rank_learner(cfg: RunConfig) -> Any:
    """This rank's Learner, made one rank of the configured mode (the process group is initialised)."""
    from posttrain.train import Learner
    from posttrain.train.distributed import ParallelPlan

    plan = ParallelPlan.of(cfg.trainer)
    return Learner(cfg.model, cfg.trainer, cfg.algorithm, seed=cfg.seed, batch_cfg=cfg.batch, plan=plan)


def save_rank(learner: Any, cfg: RunConfig, rank: int, directory: str) -> None:
    """Write the group's learner state into `directory` (sharded modes: every rank its shards)."""
    if sharded(cfg):
        from posttrain.train.distributed import save_sharded

        save_sharded(learner, directory)
    elif rank == 0:  # context parallel: every rank holds the same whole state
        learner.save(directory)


def restore_rank(learner: Any, cfg: RunConfig, directory: str) -> None:
    """Read a `save_rank` folder into this rank's learner."""
    if sharded(cfg):
        from posttrain.train.distributed import load_sharded

        load_sharded(learner, directory)
    else:
        from posttrain.train.state import read_learner_state

        learner.load_state_dict(read_learner_state(Path(directory))[1])


def _resolve(learner: Any, name: str) -> Any:
    target = learner
    for part in name.split("."):
        target = getattr(target, part)
    return target


def on_cpu(value: Any, copies: dict[tuple, Any] | None = None) -> Any:
    """`value` with every tensor in it (in dicts, lists, tuples, dataclasses) on the CPU: what a rank on a
    GPU sends back, so the controller (which may see no GPU) can unpickle it. CPU tensors stay as they are;
    a tensor met twice (tied weights) is copied once."""
    import dataclasses

    import torch

    copies = {} if copies is None else copies
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu":
            return value
        view = (value.untyped_storage().data_ptr(), value.storage_offset(), value.shape, value.stride())
        key = (*view, value.dtype, value.device)
        if key not in copies:
            copies[key] = value.cpu()
        return copies[key]
    if isinstance(value, dict):
        return {k: on_cpu(v, copies) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_cpu(v, copies) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: on_cpu(getattr(value, f.name), copies) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **fields)
    return value


def dispatch(learner: Any, cfg: RunConfig, rank: int, name: str, args: tuple, kwargs: dict) -> tuple:
    """Run one command on this rank: ("ok", rank 0's result (its tensors on the CPU) or None, version) or
    ("error", traceback)."""
    try:
        if name == "save":
            result = save_rank(learner, cfg, rank, *args)
        elif name == "restore":
            result = restore_rank(learner, cfg, *args)
        else:  # lora_update / lora_base gather adapters whole: every rank takes part, as in all calls
            target = _resolve(learner, name)
            result = target(*args, **kwargs) if callable(target) else target
        return ("ok", on_cpu(result) if rank == 0 else None, learner.version)
    except BaseException:
        return ("error", traceback.format_exc(), None)


def init_group(rank: int, world: int, addr: str, port: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )


def _serve(learner: Any, cfg: RunConfig, rank: int, conn: Connection) -> None:
    while True:
        raw = conn.recv_bytes()
        if raw == STOP:
            return
        reply = dispatch(learner, cfg, rank, *pickle.loads(raw))
        # plain pickle: tensors travel as copies, not as shared memory a later step would change
        conn.send_bytes(pickle.dumps(reply))
        if reply[0] == "error":
            return


def rank_main(rank: int, world: int, port: int, cfg: RunConfig, threads: int, conn: Connection) -> None:
    """One learner rank's process: join the group, build the Learner, serve commands until told to stop."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        init_group(rank, world, "127.0.0.1", port)
        learner = build_rank_learner(cfg)
        conn.send_bytes(pickle.dumps(("ok", None, learner.version)))
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc(), None)))
        return
    try:
        _serve(learner, cfg, rank, conn)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


class _KlControl:
    """The ranks' KL controller as the run reads it (`kl_ctl.update`, `kl_ctl.value`)."""

    def __init__(self, group: LearnerGroup) -> None:
        self._group = group

    def update(self, *args: Any) -> None:
        self._group.call("kl_ctl.update", *args)

    @property
    def value(self) -> float:
        return float(self._group.call("kl_ctl.value"))


class LearnerGroup:
    """`cfg.trainer.learner_ranks` Learner ranks in local processes, offering what the run uses of the
    Learner. `weights()` are full (LoRA merged); under LoRA (`lora`) `lora_update` and `lora_base` give
    the adapters and their base weights whole, so the run's weight sync pushes adapters only."""

    vision = None

    def __init__(self, cfg: RunConfig, start_timeout_s: float = 300.0) -> None:
        import torch
        import torch.multiprocessing as mp

        self.cfg = cfg
        self.lora = cfg.model.lora_rank > 0
        self.world = cfg.trainer.learner_ranks
        self.version = 0
        self.kl_ctl = _KlControl(self)
        self.lock = threading.Lock()  # the async rollout thread and the controller share the channels
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        ctx = mp.get_context("spawn")
        port = free_port()
        threads = max(1, torch.get_num_threads() // self.world)
        try:
            for rank in range(self.world):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=rank_main,
                    args=(rank, self.world, port, cfg, threads, child),
                    daemon=True,
                    name=f"learner-rank-{rank}",
                )
                proc.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(proc)
            self._replies(start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _replies(self, timeout_s: float | None = None) -> Any:
        """Every rank's reply to the last command; rank 0's result. The first rank that raised or died
        ends the group and raises `LearnerRankError`."""
        pending = set(range(self.world))
        results: dict[int, Any] = {}
        while pending:
            waitables: list[Any] = [self.conns[r] for r in pending] + [
                self.procs[r].sentinel for r in pending
            ]
            ready = wait(waitables, timeout=timeout_s)
            if not ready:
                self._fail(min(pending), f"no reply within {timeout_s} s")
            for rank in sorted(pending):
                conn, proc = self.conns[rank], self.procs[rank]
                if conn in ready or conn.poll():
                    try:
                        status, value, version = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        self._fail(rank, self._died(rank))
                    if status == "error":
                        self._fail(rank, value)
                    results[rank] = value
                    if rank == 0:
                        self.version = int(version)
                    pending.discard(rank)
                elif proc.sentinel in ready:
                    self._fail(rank, self._died(rank))
        return results[0]

    def _died(self, rank: int) -> str:
        proc = self.procs[rank]
        proc.join(5.0)
        return f"exited with code {proc.exitcode} without replying"

    def _fail(self, rank: int, error: str) -> None:
        self.close(wait_s=0.0)  # the other ranks may wait in a collective for the failed one
        raise LearnerRankError(rank, error)

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """`name` (a Learner method or attribute, dotted for nested ones) on every rank; rank 0's result."""
        with self.lock:
            if not self.procs:
                raise RuntimeError("the learner group is closed")
            raw = pickle.dumps((name, args, kwargs))
            for rank, conn in enumerate(self.conns):
                try:
                    conn.send_bytes(raw)
                except OSError:
                    self._fail(rank, self._died(rank))
            return self._replies()

    # what the run uses of the Learner
    def step(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        return self.call("step", *args, **kwargs)

    def weights(self) -> dict[str, Any]:
        return self.call("weights")

    def score_tokens(self, samples: list[Any]) -> Any:
        return self.call("score_tokens", samples)

    def lora_update(self, version: int) -> Any:
        """`Learner.lora_update` of the ranks' policy: its adapters, gathered whole, as `version`."""
        return self.call("lora_update", version)

    def lora_base(self) -> dict[str, Any]:
        """`Learner.lora_base` of the ranks' policy: the adapted modules' base weights, whole."""
        return self.call("lora_base")

    @property
    def image_store(self) -> None:
        """None: the ranks train text models only (a vision-language policy runs in one process)."""
        return None

    def attach_image_store(self, store: Any) -> None:
        """Nothing to attach: the ranks train text models, which read no images (a vision-language policy
        is refused by the ranks themselves, `train.distributed`)."""

    def state_dict(self) -> dict[str, Any]:
        """Rank 0's whole learner state (context-parallel ranks hold it whole); sharded ranks have no
        whole state in one process: `save` writes their shards."""
        if sharded(self.cfg):
            raise ValueError("sharded learner ranks (FSDP, tensor parallel) keep no whole state: use save()")
        return self.call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Every rank loads `state` (a whole learner state; sharded ranks read `restore` folders)."""
        if sharded(self.cfg):
            raise ValueError("sharded learner ranks (FSDP, tensor parallel) load shards: use restore()")
        self.call("load_state_dict", state)

    def offload_optimizer(self) -> None:
        self.call("offload_optimizer")

    def reload_optimizer(self) -> None:
        self.call("reload_optimizer")

    def save(self, directory: str | Path) -> None:
        """The group's learner state into `directory`: sharded folders for FSDP and tensor parallel
        ranks, the single-process Learner's folder (from rank 0) for context parallel ones."""
        self.call("save", str(directory))

    def restore(self, directory: str | Path) -> None:
        """Every rank reads a `save` folder."""
        self.call("restore", str(directory))

    def close(self, wait_s: float = 5.0) -> None:
        """Stop every rank (asked first, given `wait_s` to exit, then terminated, then killed); idempotent."""
        procs, conns = self.procs, self.conns
        self.procs, self.conns = [], []
        for conn, proc in zip(conns, procs, strict=True):
            if proc.is_alive():
                with contextlib.suppress(OSError):
                    conn.send_bytes(STOP)
        for proc in procs:
            proc.join(wait_s)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in conns:
            conn.close()


def rank_resources(cfg: RunConfig) -> tuple[dict[str, float], dict[str, float]]:
    """`ray_pool.actor_resources` of one learner rank actor: `placement.learner_cpus`, `learner_gpus`."""
    from posttrain.sandbox.ray_pool import actor_resources

    return actor_resources(cfg.placement.learner_cpus, cfg.placement.learner_gpus)


class RankActor:
    """One learner rank inside a Ray actor (`placement.backend: ray`)."""

    def __init__(self, threads: int) -> None:
        import torch

        torch.set_num_threads(max(1, threads))
        self.learner: Any = None

    def where(self) -> tuple[str, int]:
        """This actor's node address and a free port on it (rank 0's are the group's rendezvous)."""
        import ray

        addr = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((addr, 0))
            return addr, s.getsockname()[1]

    def pid(self) -> int:
        import os

        return os.getpid()

    def setup(self, rank: int, world: int, addr: str, port: int, cfg_json: str) -> tuple:
        from posttrain.config import RunConfig

        try:
            self.cfg, self.rank = RunConfig.model_validate_json(cfg_json), rank
            init_group(rank, world, addr, port)
            self.learner = build_rank_learner(self.cfg)
            return ("ok", None, self.learner.version)
        except BaseException:
            return ("error", traceback.format_exc(), None)

    def do(self, name: str, args: tuple, kwargs: dict) -> tuple:
        return dispatch(self.learner, self.cfg, self.rank, name, args, kwargs)


class RayLearnerGroup(LearnerGroup):
    """The learner group as `cfg.trainer.learner_ranks` Ray actors in one placement group
    (`placement.learner_cpus` CPUs and `learner_gpus` GPUs each, PACK); the process group forms among the
    actors at rank 0's node address. The same interface and failure rules as the local group."""

    def __init__(self, cfg: RunConfig, start_timeout_s: float = 300.0) -> None:
        from posttrain.orchestrator.rl.placement import import_ray
        from posttrain.sandbox.ray_pool import ActorGroup, init_ray

        ray = import_ray()

        p = cfg.placement
        self.cfg = cfg
        self.lora = cfg.model.lora_rank > 0
        self.world = cfg.trainer.learner_ranks
        self.version = 0
        self.kl_ctl = _KlControl(self)
        self.lock = threading.Lock()
        self._ray = ray
        self.procs, self.actors, self.group = [], [], None
        need = self.world * p.learner_cpus + p.num_engines * p.engine_cpus  # the engines share the cluster
        self.started_ray = init_ray(ray, p.ray_address, need)
        try:
            self.group = ActorGroup(
                RankActor,
                (max(1, int(p.learner_cpus)),),
                self.world,
                p.learner_cpus,
                gpus=p.learner_gpus,
                what="learner ranks (placement.learner_cpus, learner_gpus)",
                strategy="PACK",
                max_restarts=0,
                ready_timeout_s=120.0,
            )
            self.actors = list(self.group.handles)
            self.procs = self.actors  # what `close` ends and `call` checks
            addr, port = ray.get(self.actors[0].where.remote(), timeout=start_timeout_s)
            cfg_json = cfg.model_dump_json()
            self._gather(
                [a.setup.remote(r, self.world, addr, port, cfg_json) for r, a in enumerate(self.actors)]
            )
        except BaseException:
            self.close()
            raise

    @property
    def pg(self) -> Any:
        """The rank actors' placement group (None once closed)."""
        return None if self.group is None else self.group.pg

    def _gather(self, refs: list[Any], timeout_s: float | None = None) -> Any:
        ray = self._ray
        pending = {ref: rank for rank, ref in enumerate(refs)}
        result = None
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout_s)
            if not ready:
                self._fail(min(pending.values()), f"no reply within {timeout_s} s")
            rank = pending.pop(ready[0])
            try:
                status, value, version = ray.get(ready[0])
            except ray.exceptions.RayError as e:  # the actor died (or its task could not run)
                self._fail(rank, f"{type(e).__name__}: {str(e).strip().splitlines()[0]}")
            if status == "error":
                self._fail(rank, value)
            if rank == 0:
                result, self.version = value, int(version)
        return result

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            if not self.actors:
                raise RuntimeError("the learner group is closed")
            return self._gather([a.do.remote(name, args, kwargs) for a in self.actors])

    def close(self, wait_s: float = 5.0) -> None:
        """Kill every rank actor, remove the placement group (and Ray, if this group started it)."""
        self.actors, self.procs = [], []
        if self.group is not None:  # its actors and placement group
            with contextlib.suppress(Exception):
                self.group.close()
            self.group = None
        if self.started_ray:
            self.started_ray = False
            self._ray.shutdown()


def start_learner_group(cfg: RunConfig) -> LearnerGroup:
    """The configured learner group: local rank processes, or Ray actors under `placement.backend: ray`."""
    return RayLearnerGroup(cfg) if cfg.placement.backend == "ray" else LearnerGroup(cfg)
