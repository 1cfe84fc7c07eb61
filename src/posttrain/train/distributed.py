"""Data-parallel, sharded Learner ranks (FSDP2 `fully_shard`) and tensor-parallel ones (DTensor
`parallelize_module`), over torch.distributed, and the `ParallelPlan` that picks among them.

A Learner is handed its plan at construction (`Learner(..., plan=ParallelPlan.of(trainer))`, what a
learner group's rank does) and applies it itself: `ParallelPlan.split` shards or splits the parts in
place and returns a `Placement` (this rank's places, the optimizer factory the split parameters need,
the mesh); the Learner records the places and builds its optimizers from the split parts. Nothing here
assigns a Learner attribute. `shard_learner`, `tensor_parallel_learner`, `parallelize_2d` and
`parallelize_dp_cp` are shorthands for `learner.replan(ParallelPlan(...))` on a Learner built unsplit.

FSDP (`layout="fsdp"`, dp > 1) turns a `Learner` built in each rank's process (same config and seed, so
the same initial weights) into one rank of a data-parallel learner: every decoder layer and the root are
sharded across the ranks (gloo on CPUs, NCCL on GPUs), the optimizer holds only this rank's shards,
and `Learner.update` gives each rank a share of every mini-batch's micro-batches. All ranks call the
same methods with the same batch, in the same order. Each rank's loss is scaled by the world size,
because FSDP averages gradients while a mini-batch's loss weights are already normalised over the whole
mini-batch: the sum over ranks is then the single-process gradient. When the micro-batches do not
divide evenly, a rank runs a repeat of one with weight 0 (FSDP's collectives need every rank to
take part in every forward and backward). Metrics are reduced over the ranks, so every rank reports
what one process would.

No-grad passes (old and reference logprobs) and the supervised and preference steps run the whole
batch on every rank: correct (the averaged gradient of identical losses is that loss's gradient) and
simple, not faster. A critic (`trainer.critic`) is sharded the same way, as a root of its own (the
Learner calls its forward), its value loss scaled and shared out with the policy's micro-batches.

Tensor parallelism (`layout="tp"`) splits each decoder layer's attention heads and MLP columns over
the ranks instead (Megatron's column-in, row-out split, `TP_PLAN`); all ranks run the whole batch.
LoRA adapters follow their base layer's split (`tp_plan`). A "dp_tp" plan composes
the two on a (dp, tp) DeviceMesh: tensor parallel inside each "tp" group, FSDP2 over "dp", each dp group
taking its share of the micro-batches. A critic's decoder layers are split (and sharded) as the
policy's. A "dp_cp" plan composes FSDP2 with context parallelism on a (dp, cp)
mesh, or a (dp, cp, tp) one: each cp group splits every sequence of its dp group's micro-batches, each
tp group splits the heads inside a cp rank, FSDP shards over the dp x cp ranks.

Checkpoints: `save_sharded` writes a torch.distributed.checkpoint folder (each rank its shards of the
weights and optimizer states, the critic's included, plus the learner's counters), and `load_sharded` reads it on any number
of ranks, one included (no process group needed).
"""

from __future__ import annotations

import functools
import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from posttrain.train.forward import causal_lm


@dataclass
class DataParallel:
    """This process's place among the learner ranks; `root` is the sharded module the policy forward
    goes through (see `shard_learner`)."""

    rank: int
    world: int
    group: Any = None
    root: Any = None
    inside: bool = False  # the root's forward is running the Learner's own forward
    critic_root: Any = None  # a dp x cp mesh's sharded module the critic's forward goes through
    # how many ranks FSDP averages the gradients over (None: `world`; a dp x cp mesh shards over both)
    grad_ranks: int | None = None

    def share(self, micro_batches: list[Any]) -> list[tuple[Any, float]]:
        """This rank's micro-batches with the loss scale each runs with: round-robin, each scaled by the
        number of ranks FSDP averages over, padded with weight-0 repeats so that every rank runs as many."""
        n = len(micro_batches)
        rounds = -(-n // self.world) if n else 0
        scale = float(self.grad_ranks or self.world)
        out = []
        for r in range(rounds):
            i = r * self.world + self.rank
            out.append((micro_batches[i], scale) if i < n else (micro_batches[0], 0.0))
        return out

    def sum_(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t.tolist()

    def max_(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def reduce_weighted(
        self, sums: dict[str, float], counts: dict[str, float]
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Sums and counts of weighted-mean metrics added over the ranks (key sets may differ)."""
        keys: list[Any] = [None] * self.world
        dist.all_gather_object(keys, sorted(sums), group=self.group)
        union = sorted({k for ks in keys for k in ks})
        flat = self.sum_([sums.get(k, 0.0) for k in union] + [counts.get(k, 0.0) for k in union])
        n = len(union)
        return dict(zip(union, flat[:n], strict=True)), dict(zip(union, flat[n:], strict=True))


def init_local_gloo(rank: int, world: int, port: int, timeout_s: float = 120.0) -> None:
    """Join a gloo process group of `world` processes on 127.0.0.1:`port` (tests, benchmarks, one host)."""
    import datetime

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The decoder layers of a causal LM (peft-wrapped or not): the units FSDP shards one by one."""
    layers = getattr(causal_lm(model).get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")
    return list(layers)


def critic_layers(critic: Any) -> list[torch.nn.Module]:
    """The decoder layers of a critic (`train.forward.ValueModel`): split and sharded as the policy's."""
    layers = getattr(critic.decoder, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of the critic ({type(critic.decoder).__name__})")
    return list(layers)


class _Root(torch.nn.Module):
    """The FSDP root around a module whose own forward the Learner never calls: the policy (it runs the
    decoder, then its head in chunks) or, on context-parallel ranks, the critic (its decoder over a
    shard, its head on some positions). The parameters outside the decoder layers (embeddings, final
    norm, the head) get their all-gather from this module's forward, which runs `run`, the Learner's
    forward of that module."""

    def __init__(self, module: torch.nn.Module, learner: Any, run: Callable[..., Any]) -> None:
        super().__init__()
        self.module = module
        self._learner, self._run = [learner], run  # not registered as submodules

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        dp = self._learner[0].dp
        dp.inside = True
        try:
            return self._run(*args, **kwargs)
        finally:
            dp.inside = False


def _policy_root(learner: Any) -> _Root:
    return _Root(learner.model, learner, functools.partial(learner.policy_forward, learner.model))


def _refuse_vision(learner: Any, what: str) -> None:
    if getattr(learner, "vision", None) is not None:
        raise ValueError(
            f"a vision-language policy does not train {what} here: its images enter at the embeddings "
            "on the single-process path only (train/vision.py); use one learner process"
        )


def _refuse_unsplittable(learner: Any, what: str, verb: str) -> None:
    """Refuse what the sharded learner ranks do not handle: context parallelism, and an optimizer that
    already holds state."""
    if learner.cp is not None:
        raise ValueError(f"{what} learner ranks do not compose with trainer.context_parallel > 1 yet")
    if learner.optimizer_steps:
        raise ValueError(f"{verb} a learner before its first update (its optimizer state would be lost)")


def _shard(learner: Any, group: Any = None) -> Placement:
    """Shard `learner`'s policy (and critic) over the process group (initialised by the caller); the
    Learner then builds their optimizers over this rank's shards."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    _refuse_vision(learner, "data-parallel (FSDP)")

    if not dist.is_initialized():
        raise RuntimeError("shard_learner needs torch.distributed initialised (init_process_group)")
    _refuse_unsplittable(learner, "data-parallel", "shard")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    device_type = learner.device.type
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    mesh = DeviceMesh(device_type, ranks)
    for layer in decoder_layers(learner.model):
        fully_shard(layer, mesh=mesh)
    root = _policy_root(learner)
    fully_shard(root, mesh=mesh)
    if learner.critic is not None:  # the Learner calls the critic's own forward: it is its own root
        for layer in critic_layers(learner.critic):
            fully_shard(layer, mesh=mesh)
        fully_shard(learner.critic, mesh=mesh)
    return Placement(dp=DataParallel(rank, world, group, root=root))  # optimizers: over this rank's shards


# Megatron's split of a Llama-family decoder layer: column-parallel in, row-parallel out
TP_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def tp_plan(layer: torch.nn.Module) -> dict[str, Any]:
    """The `parallelize_module` plan of one decoder layer: `TP_PLAN`, and for a peft LoRA layer its base
    layer split the same way, with the adapter that touches the split dimension split to match: a
    column-parallel layer's B by output columns (A replicated), a row-parallel layer's A by input
    columns (B replicated). Every rank then adds its share of B @ A to its share of the output."""
    from peft.tuners.lora import LoraLayer
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan: dict[str, Any] = {}
    for name, style in TP_PLAN.items():
        module = layer.get_submodule(name)
        if not isinstance(module, LoraLayer):
            plan[name] = styles[style]()
            continue
        if any(module.use_dora.get(ad, False) for ad in module.lora_A):
            raise ValueError("tensor parallelism does not split DoRA adapters; use plain LoRA")
        plan[f"{name}.base_layer"] = styles[style]()
        for ad in module.lora_A:
            if style == "colwise":
                plan[f"{name}.lora_B.{ad}"] = ColwiseParallel()
            else:
                plan[f"{name}.lora_A.{ad}"] = RowwiseParallel()
    return plan


def _check_tp_split(learner: Any, tp: int) -> None:
    configs = [("", causal_lm(learner.model).config)]
    if learner.critic is not None:
        configs.append(("the critic's ", learner.critic.decoder.config))
    for whose, config in configs:
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            if getattr(config, name) % tp:
                raise ValueError(
                    f"tensor parallelism over {tp} ranks needs {whose}{name}={getattr(config, name)} "
                    "divisible by it"
                )


def _dtensor_adamw(params: list[torch.nn.Parameter], lr: float, tc: Any) -> torch.optim.Optimizer:
    # the per-parameter loop: the fused and foreach kernels cannot take replicas and DTensors (on
    # different meshes) together
    return torch.optim.AdamW(
        params, lr=lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay, foreach=False
    )


def _dtensor_factory(learner: Any) -> Callable[[list[torch.nn.Parameter], float], torch.optim.Optimizer]:
    """The optimizer factory for the policy's (and the critic's) split parameters."""
    tc = learner.trainer_cfg
    return lambda params, lr: _dtensor_adamw(params, lr, tc)


@dataclass
class TensorParallel:
    """This process's place in a tensor-parallel group: every rank runs every row of the batch, each
    with its share of the attention heads and MLP columns."""

    rank: int
    world: int
    group: Any = None


def _tensor_parallel(learner: Any, group: Any = None) -> Placement:
    """Split `learner`'s decoder layers (the policy's and the critic's) over the process group with
    DTensor `parallelize_module` (`tp_plan`; embeddings, norms and heads stay replicated, LoRA adapters
    split with their base layer); the optimizers are then built over the DTensors; every rank calls the
    same methods with the same batch. Heads, KV heads and MLP columns must divide by the world size."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    _refuse_vision(learner, "tensor-parallel")

    if not dist.is_initialized():
        raise RuntimeError("tensor_parallel_learner needs torch.distributed initialised (init_process_group)")
    _refuse_unsplittable(learner, "tensor-parallel", "split")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    _check_tp_split(learner, world)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    mesh = DeviceMesh(learner.device.type, ranks)
    for layer in decoder_layers(learner.model):
        parallelize_module(layer, mesh, tp_plan(layer))
    if learner.critic is not None:
        for layer in critic_layers(learner.critic):
            parallelize_module(layer, mesh, tp_plan(layer))
    return Placement(tp=TensorParallel(rank, world, group), optimizer_factory=_dtensor_factory(learner))


def _parallelize_2d(learner: Any, dp: int, tp: int) -> Placement:
    """Make `learner` one rank of a dp x tp learner over all of torch.distributed's ranks (PyTorch's 2-D
    recipe): a DeviceMesh of shape (dp, tp) named ("dp", "tp"); every decoder layer split over its "tp"
    group (`tp_plan`), then it and the root sharded with FSDP2 over "dp" (the critic's likewise); the
    optimizers built over the DTensor parameters. Each dp group takes its share of every mini-batch's
    micro-batches (the ranks of one tp group run the same ones); gradient clipping takes the norm over
    the whole model. The placement holds the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    _refuse_vision(learner, "2-D parallel")

    if not dist.is_initialized():
        raise RuntimeError("parallelize_2d needs torch.distributed initialised (init_process_group)")
    if dp < 1 or tp < 1 or dp * tp != dist.get_world_size():
        raise ValueError(
            f"a dp={dp} x tp={tp} mesh needs dp*tp={dp * tp} ranks; torch.distributed has "
            f"{dist.get_world_size()} (the world size)"
        )
    _refuse_unsplittable(learner, "2-D parallel", "split")
    _check_tp_split(learner, tp)
    mesh = init_device_mesh(learner.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    for layer in decoder_layers(learner.model):
        parallelize_module(layer, mesh["tp"], tp_plan(layer))
        fully_shard(layer, mesh=mesh["dp"])
    root = _policy_root(learner)
    fully_shard(root, mesh=mesh["dp"])
    if learner.critic is not None:
        for layer in critic_layers(learner.critic):
            parallelize_module(layer, mesh["tp"], tp_plan(layer))
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(learner.critic, mesh=mesh["dp"])
    return Placement(
        dp=DataParallel(mesh["dp"].get_local_rank(), dp, mesh["dp"].get_group(), root=root),
        tp=TensorParallel(mesh["tp"].get_local_rank(), tp, mesh["tp"].get_group()),
        optimizer_factory=_dtensor_factory(learner),
        mesh=mesh,
    )


def _parallelize_dp_cp(learner: Any, dp: int, cp: int, tp: int = 1) -> Placement:
    """Make `learner` (built with trainer.context_parallel=cp and tensor_parallel=tp in each process, same
    config and seed) one rank of a dp x cp (x tp) learner over all of torch.distributed's ranks: a
    DeviceMesh of shape (dp, cp) named ("dp", "cp"), or (dp, cp, tp) named ("dp", "cp", "tp"); each "cp"
    group splits every sequence of its rows zigzag, attention round the ring over that group
    (`train.context_parallel`); each dp group takes its share of every mini-batch's micro-batches. With
    tp > 1 every decoder layer is first split over its "tp" group (`tp_plan`, as `parallelize_2d`): a
    rank's ring then carries its share of the heads. The policy is sharded with FSDP2 over all dp x cp
    ranks (torchtitan's `dp_shard_cp`): the ranks of a cp group hold the same weights, so sharding over
    them too divides the memory by dp x cp, and FSDP's one reduce-scatter both sums the cp ranks' partial
    gradients (each holds those of its positions) and averages over the dp groups, each rank's loss being
    scaled by dp x cp. A critic is split and sharded the same way (its own `_Root`), the value loss scaled
    as the policy's. The reference stays whole on every rank. The placement holds the mesh."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from posttrain.train.context_parallel import context_parallel_learner

    what = "data x context parallel" if tp == 1 else "data x context x tensor parallel"
    _refuse_vision(learner, what)
    if not dist.is_initialized():
        raise RuntimeError("parallelize_dp_cp needs torch.distributed initialised (init_process_group)")
    world = dist.get_world_size()
    if dp < 1 or cp < 2 or tp < 1 or dp * cp * tp != world:
        raise ValueError(
            f"a dp={dp} x cp={cp} x tp={tp} mesh needs cp > 1 and dp*cp*tp={dp * cp * tp} ranks; "
            f"torch.distributed has {world} (the world size)"
        )
    tc = learner.trainer_cfg
    if tc.context_parallel != cp or tc.tensor_parallel != tp:
        raise ValueError(
            f"parallelize_dp_cp(cp={cp}, tp={tp}) needs a Learner built with trainer.context_parallel={cp} "
            f"and trainer.tensor_parallel={tp}"
        )
    _refuse_unsplittable(learner, what, "shard" if tp == 1 else "split")
    if tp > 1:
        _check_tp_split(learner, tp)
        mesh = init_device_mesh(learner.device.type, (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
        shard_mesh = mesh["dp", "cp"]._flatten("dp_cp")  # a sub-mesh of the TP mesh's parent: 2-D DTensors
    else:
        mesh = init_device_mesh(learner.device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
        shard_mesh = DeviceMesh(learner.device.type, list(range(world)))  # every rank
    cp_place = context_parallel_learner(learner, mesh["cp"].get_group())

    def shard(layers: list[torch.nn.Module], root: torch.nn.Module) -> None:
        for layer in layers:
            if tp > 1:
                parallelize_module(layer, mesh["tp"], tp_plan(layer))
            fully_shard(layer, mesh=shard_mesh)
        fully_shard(root, mesh=shard_mesh)

    root = _policy_root(learner)
    shard(decoder_layers(learner.model), root)
    critic_root = None
    if learner.critic is not None:
        critic_root = _Root(learner.critic, learner, learner.value_forward)
        shard(critic_layers(learner.critic), critic_root)
    tp_place = TensorParallel(mesh["tp"].get_local_rank(), tp, mesh["tp"].get_group()) if tp > 1 else None
    dp_place = DataParallel(
        mesh["dp"].get_local_rank(),
        dp,
        mesh["dp"].get_group(),
        root=root,
        grad_ranks=dp * cp,
        critic_root=critic_root,
    )
    factory = _dtensor_factory(learner) if tp > 1 else None
    return Placement(dp=dp_place, tp=tp_place, cp=cp_place, optimizer_factory=factory, mesh=mesh)


@dataclass
class Placement:
    """What applying a `ParallelPlan` to a Learner's parts gives the Learner: this rank's places in the
    data, tensor and context parallelisms it has (None: not split that way), the optimizer factory the
    split parameters need (None: `train.optim.make_adamw`'s), and the DeviceMesh of a 2-D or 3-D plan."""

    dp: DataParallel | None = None
    tp: TensorParallel | None = None
    cp: Any = None  # a train.context_parallel.ContextParallel
    optimizer_factory: Callable[[list[torch.nn.Parameter], float], torch.optim.Optimizer] | None = None
    mesh: Any = None


def _context_parallel_only(learner: Any, plan: ParallelPlan) -> Placement:
    from posttrain.train.context_parallel import context_parallel_learner

    return Placement(cp=context_parallel_learner(learner))


_SPLITS: dict[str, Callable[[Any, ParallelPlan], Placement]] = {
    "none": lambda learner, plan: Placement(),
    "cp": _context_parallel_only,
    "fsdp": lambda learner, plan: _shard(learner, plan.group),
    "tp": lambda learner, plan: _tensor_parallel(learner, plan.group),
    "dp_tp": lambda learner, plan: _parallelize_2d(learner, plan.dp, plan.tp),
    "dp_cp": lambda learner, plan: _parallelize_dp_cp(learner, plan.dp, plan.cp, plan.tp),
}


@dataclass(frozen=True)
class ParallelPlan:
    """How a Learner's parts are split: `dp` FSDP2 data-parallel groups, `tp` tensor-parallel ranks, `cp`
    context-parallel ranks (trainer.data_parallel / tensor_parallel / context_parallel). The Learner is
    handed it at construction (`Learner(..., plan=...)`) and applies it to its parts before building its
    optimizers from them (`split`, then `Learner.replan`); dp or tp > 1 need the process group initialised.

    `layout` names the split; None picks it from the sizes: "dp_cp" (cp > 1 with dp or tp > 1, a
    (dp, cp[, tp]) mesh), "dp_tp" (a (dp, tp) mesh), "fsdp" (dp > 1), "tp" (tp > 1), "cp" (cp > 1),
    "none". An explicit "fsdp" or "tp" layout spans `group` (None: the whole world), whatever its size,
    one rank included: the sizes are then the group's."""

    dp: int = 1
    tp: int = 1
    cp: int = 1
    layout: str | None = None
    group: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.layout is not None and self.layout not in _SPLITS:
            raise ValueError(f"unknown parallel layout {self.layout!r}; one of {sorted(_SPLITS)}")

    @classmethod
    def of(cls, trainer_cfg: Any) -> ParallelPlan:
        return cls(trainer_cfg.data_parallel, trainer_cfg.tensor_parallel, trainer_cfg.context_parallel)

    @property
    def kind(self) -> str:
        """The layout, explicit or picked from the sizes (see the class doc)."""
        if self.layout is not None:
            return self.layout
        dp, tp, cp = self.dp, self.tp, self.cp
        if cp > 1 and (dp > 1 or tp > 1):
            return "dp_cp"
        if dp > 1 and tp > 1:
            return "dp_tp"
        if dp > 1:
            return "fsdp"
        if tp > 1:
            return "tp"
        return "cp" if cp > 1 else "none"

    def split(self, learner: Any) -> Placement:
        """Split `learner`'s parts in place as planned (sharding and splitting its modules; it assigns
        nothing on the Learner) and return this rank's `Placement`; `Learner.replan` calls this."""
        return _SPLITS[self.kind](learner, self)


def shard_learner(learner: Any, group: Any = None) -> DataParallel:
    """Make an already built, never updated `learner` one rank of an FSDP2 data-parallel learner over
    `group` (initialised by the caller; None: the world), whatever its size. A thin shorthand for
    `learner.replan(ParallelPlan(layout="fsdp", group=group))` (the Learner shards its parts and rebuilds
    its optimizers over this rank's shards); returns the rank's `DataParallel`. Runs build the Learner
    with its plan instead (`Learner(..., plan=ParallelPlan.of(trainer))`)."""
    return learner.replan(ParallelPlan(layout="fsdp", group=group)).dp


def tensor_parallel_learner(learner: Any, group: Any = None) -> TensorParallel:
    """`learner.replan(ParallelPlan(layout="tp", group=group))` (see `_tensor_parallel`): the Learner
    splits its decoder layers over `group` and rebuilds its optimizers; returns the rank's place."""
    return learner.replan(ParallelPlan(layout="tp", group=group)).tp


def parallelize_2d(learner: Any, dp: int, tp: int) -> Any:
    """`learner.replan(ParallelPlan(dp, tp, layout="dp_tp"))` (see `_parallelize_2d`): the Learner becomes
    one rank of a dp x tp learner over all of torch.distributed's ranks; returns the mesh."""
    return learner.replan(ParallelPlan(dp=dp, tp=tp, layout="dp_tp")).mesh


def parallelize_dp_cp(learner: Any, dp: int, cp: int, tp: int = 1) -> Any:
    """`learner.replan(ParallelPlan(dp, tp, cp, layout="dp_cp"))` (see `_parallelize_dp_cp`; the Learner
    is built with trainer.context_parallel=cp and tensor_parallel=tp): one rank of a dp x cp (x tp)
    learner over all of torch.distributed's ranks; returns the mesh."""
    return learner.replan(ParallelPlan(dp=dp, tp=tp, cp=cp, layout="dp_cp")).mesh


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for a mix of plain tensors and DTensors on different meshes (what
    tensor and 2-D parallelism leave): a DTensor's squares are summed over the mesh dimensions it is
    sharded on, a replica (plain, or replicated on a dimension) counted once."""
    from torch.distributed.tensor import DTensor

    local = torch.zeros((), dtype=torch.float64)
    # (mesh, the dimensions it is sharded on) -> the sum of those shards' squares on this rank; every
    # rank meets the parameters in the same order, so the collectives below line up
    sharded: dict[tuple[int, tuple[int, ...]], tuple[Any, list[int], torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        if not isinstance(g, DTensor):
            local += g.double().pow(2).sum()
            continue
        # not `is_shard()`: FSDP2 over a tensor-parallel split shards with `_StridedShard`, which is not
        dims = [i for i, pl in enumerate(g.placements) if not pl.is_replicate()]
        part = g.to_local().double().pow(2).sum()
        if not dims:
            local += part
            continue
        key = (id(g.device_mesh), tuple(dims))
        mesh, _, acc = sharded.setdefault(key, (g.device_mesh, dims, torch.zeros((), dtype=torch.float64)))
        acc += part
    total = local.clone()
    for mesh, dims, acc in sharded.values():
        for d in dims:
            dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=mesh.get_group(d))
        total += acc
    total = total.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype).item())
    return total.float()


def _whole(t: Any) -> Any:
    """The whole tensor of a DTensor (gathered from its shards), a plain tensor as it is."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def full_value(x: Any) -> float:
    """A float from a tensor that may be a DTensor (a sharded grad norm)."""
    return float(_whole(x))


def full_weights(learner: Any) -> dict[str, torch.Tensor]:
    """HF-named full weights of a sharded policy (every rank gets them), LoRA merged as
    `train.state.merged_weights` merges them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from posttrain.train.state import merge_lora_state

    sd = get_model_state_dict(learner.model, options=StateDictOptions(full_state_dict=True))
    get_base = getattr(learner.model, "get_base_model", None)
    if not callable(get_base):
        return {k: v.detach() for k, v in sd.items()}
    return merge_lora_state(get_base(), {k.removeprefix("base_model.model."): v for k, v in sd.items()})


def _parallel(learner: Any) -> list[Any]:
    """This rank's places in the learner's parallelisms (data, tensor, context), those it has."""
    return [x for x in (getattr(learner, a, None) for a in ("dp", "tp", "cp")) if x is not None]


def _learner_ranks(learner: Any) -> int:
    """How many processes hold this learner: the product of its parallelisms' sizes."""
    return math.prod(x.world for x in _parallel(learner))


def _counters(learner: Any) -> dict[str, Any]:
    return {
        "version": learner.version,
        "optimizer_steps": learner.optimizer_steps,
        "kl": dict(learner.kl_ctl.state_dict()),
        "generator": learner.generator.get_state().tolist(),
        "world": _learner_ranks(learner),
        "critic": learner.critic is not None,
    }


def _dcp_state(learner: Any) -> dict[str, Any]:
    """The state dicts a sharded checkpoint holds: the policy's and its optimizer's, and the critic's
    and its optimizer's when there is a critic."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(learner.model, learner.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    if learner.critic is not None:
        state["critic"], state["critic_optim"] = get_state_dict(learner.critic, learner.critic_optimizer)
    return state


def save_sharded(learner: Any, directory: str | Path) -> None:
    """Every rank writes its shards of the weights and optimizer states (policy, and critic if any)
    into `directory` (a torch.distributed.checkpoint folder); rank 0 adds the learner's counters."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_dcp_state(learner), checkpoint_id=str(directory))
    parts = _parallel(learner)
    if all(x.rank == 0 for x in parts):
        (Path(directory) / "learner_counters.json").write_text(json.dumps(_counters(learner)))
    if dist.is_initialized():
        # one parallelism: its group; two (a 2-D mesh over the whole world) or none: the world
        dist.barrier(group=parts[0].group if len(parts) == 1 else None)


def load_sharded(learner: Any, directory: str | Path) -> None:
    """Restore a `save_sharded` folder into `learner`, sharded over any number of ranks or none."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(directory)
    if not (path / "learner_counters.json").is_file():
        raise FileNotFoundError(f"{path} is not a sharded learner checkpoint (no learner_counters.json)")
    counters = json.loads((path / "learner_counters.json").read_text())
    if bool(counters.get("critic", False)) != (learner.critic is not None):
        raise ValueError(
            f"{path} and this learner disagree on having a critic (trainer.critic): the checkpoint "
            f"{'has' if counters.get('critic') else 'has none'}"
        )
    state = _dcp_state(learner)
    with warnings.catch_warnings():  # without a process group DCP loads in one process: what we want
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        learner.model, learner.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    if learner.critic is not None:
        set_state_dict(
            learner.critic,
            learner.critic_optimizer,
            model_state_dict=state["critic"],
            optim_state_dict=state["critic_optim"],
        )
    learner.restore_counters(counters["version"], counters["optimizer_steps"])
    learner.kl_ctl.load_state_dict(counters["kl"])
    learner.generator.set_state(torch.tensor(counters["generator"], dtype=torch.uint8))
