"""Data-parallel FSDP2 learner ranks, tensor-parallel ones (full and LoRA) and a 2x2 mesh of both (2 or
4 gloo processes on this CPU) against the single-process Learner on the same samples: the same weights
after each step, the same metrics, the same LoRA adapters pushed, and sharded checkpoints written by 2
or 4 ranks that a single process loads and trains on from exactly there; the same for PPO with a critic
(FSDP, TP, 2x2), whose critic is sharded, stepped and checkpointed with the policy. The samples' rewards
vary within each group, and every reference step moves each trained tensor by 10x the tolerance."""

from __future__ import annotations

import random
import socket

import pytest
import torch
import torch.multiprocessing as mp

from posttrain.config import AlgorithmConfig, BatchConfig, ModelConfig, TrainerConfig
from posttrain.orchestrator.rl.weight_sync import lora_update
from posttrain.train import Learner, Sample
from posttrain.train.distributed import (
    DataParallel,
    ParallelPlan,
    init_local_gloo,
    load_sharded,
    parallelize_2d,
    save_sharded,
    shard_learner,
)
from posttrain.train.forward import causal_lm

# 4 micro-batches of 2 rows over 2 mini-batches: each rank gets some; odd splits get a weight-0 repeat
BATCH = BatchConfig(micro_batch_tokens=24, mini_batches=2)
METRICS = ("loss", "grad_norm", "entropy", "clipfrac", "approx_kl", "update_tokens")


def samples(seed: int, n: int = 8) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(6, 12)
        ids = [rng.randrange(1000) for _ in range(length)]
        mask = [0] * 3 + [1] * (length - 3)
        blp = [-rng.uniform(5, 9) if m else 0.0 for m in mask]
        out.append(Sample(ids, mask, blp, reward=float(i % 3 == 0), group_id=i // 4, policy_version=0))
    return out


def make_learner(lora: bool, max_grad_norm: float = 1.0) -> Learner:
    model = ModelConfig(spec="tiny:llama", lora_rank=4 if lora else 0, lora_alpha=8.0)
    trainer = TrainerConfig(lr=1e-3, max_grad_norm=max_grad_norm)
    return Learner(model, trainer, AlgorithmConfig(), seed=0, batch_cfg=BATCH)


def _worker(rank: int, port: int, lora: bool, ckpt: str, out_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    init_local_gloo(rank, 2, port, timeout_s=120)
    learner = make_learner(lora)
    shard_learner(learner)
    m1 = learner.step(samples(1))
    save_sharded(learner, ckpt)
    w1 = learner.weights()
    m2 = learner.step(samples(2))
    w2 = learner.weights()
    if rank == 0:
        torch.save({"m1": m1, "m2": m2, "w1": w1, "w2": w2}, out_path)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _close(a: dict, b: dict, atol: float = 2e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), atol=atol, rtol=0), (k, (a[k] - b[k]).abs().max())


def weights(learner: Learner) -> dict[str, torch.Tensor]:
    """A copy of the policy's weights (a replicated tensor-parallel one is the live parameter)."""
    return {k: v.clone() for k, v in learner.weights().items()}


def _moved(start: dict, after: dict, atol: float = 2e-5, lora: bool = False) -> None:
    """Every trained tensor of `after` is more than 10x `atol` from `start` (under LoRA: the adapted
    projections, the adapters merged in), so ranks that drop a gradient all-reduce or a shard's update
    cannot equal the reference within `atol` by standing still."""
    keys = [k for k in start if not lora or k.endswith("_proj.weight")]
    moved = {k: (after[k].float() - start[k].float()).abs().max().item() for k in keys}
    assert len(moved) >= 14 and min(moved.values()) > 10 * atol, min(moved.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize("lora", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["full", "lora"])
def test_two_fsdp_ranks_train_as_one_process_and_their_checkpoint_loads_on_one(tmp_path, lora):
    ckpt, out_path = str(tmp_path / "ckpt"), str(tmp_path / "rank0.pt")
    mp.start_processes(_worker, args=(_free_port(), lora, ckpt, out_path), nprocs=2, start_method="spawn")
    ranks = torch.load(out_path, weights_only=False)

    single = make_learner(lora)
    start = weights(single)
    m1 = single.step(samples(1))
    assert m1["advantage_abs_mean"] > 0.1  # the rewards vary within each group
    _moved(start, single.weights(), lora=lora)
    _close(ranks["w1"], single.weights())
    for key in METRICS:
        assert ranks["m1"][key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
    w1 = weights(single)
    m2 = single.step(samples(2))
    _moved(w1, single.weights(), lora=lora)
    _close(ranks["w2"], single.weights())
    assert ranks["m2"]["loss"] == pytest.approx(m2["loss"], rel=1e-4, abs=1e-6)

    resumed = make_learner(lora)  # one process, from the 2 ranks' shards
    load_sharded(resumed, ckpt)
    assert (resumed.version, resumed.optimizer_steps) == (single.version - 1, single.optimizer_steps - 2)
    _close(resumed.weights(), ranks["w1"], atol=0.0)  # shards put back together exactly
    resumed.step(samples(2))  # optimizer moments and counters came along: the second step matches
    _close(resumed.weights(), ranks["w2"])


def test_share_pads_with_weight_zero_repeats_so_ranks_run_as_many():
    dp0, dp1 = DataParallel(0, 2), DataParallel(1, 2)
    assert dp0.share(["a", "b", "c"]) == [("a", 2.0), ("c", 2.0)]
    assert dp1.share(["a", "b", "c"]) == [("b", 2.0), ("a", 0.0)]
    assert DataParallel(2, 3).share(["a"]) == [("a", 0.0)] and dp0.share([]) == []


def test_shard_learner_needs_a_process_group():
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        shard_learner(make_learner(False))


def test_a_plan_picks_its_layout_from_the_sizes():
    def kind(**sizes: int) -> str:
        return ParallelPlan.of(TrainerConfig(**sizes)).kind

    assert kind() == "none" and kind(context_parallel=2) == "cp"
    assert kind(data_parallel=2) == "fsdp" and kind(tensor_parallel=2) == "tp"
    assert kind(data_parallel=2, tensor_parallel=2) == "dp_tp"
    assert kind(data_parallel=2, context_parallel=2) == "dp_cp"
    assert kind(tensor_parallel=2, context_parallel=2) == "dp_cp"
    assert ParallelPlan(layout="fsdp").kind == "fsdp"  # one rank's FSDP: the layout, not the sizes
    with pytest.raises(ValueError, match="unknown parallel layout 'pp'"):
        ParallelPlan(layout="pp")


def test_a_learner_is_split_once_by_its_own_replan():
    """`shard_learner` is `learner.replan(...)`: the Learner records its places and plan; a second split
    is refused before anything is touched."""
    import torch.distributed as dist

    init_local_gloo(0, 1, _free_port(), timeout_s=30)
    try:
        learner = make_learner(False)
        assert learner.plan == ParallelPlan() and learner.dp is None
        place = shard_learner(learner)
        assert learner.dp is place and (place.rank, place.world) == (0, 1)
        assert learner.plan.kind == "fsdp" and learner.tp is None and learner.cp is None
        optimizer = learner.optimizer
        with pytest.raises(ValueError, match="this learner is already split .*a learner is split once"):
            learner.replan(ParallelPlan(layout="tp"))
        assert learner.optimizer is optimizer and learner.dp is place
    finally:
        dist.destroy_process_group()


def _tp_worker(rank: int, port: int, lora: bool, out_path: str) -> None:
    import torch.distributed as dist

    from posttrain.train.distributed import tensor_parallel_learner

    torch.set_num_threads(1)
    init_local_gloo(rank, 2, port, timeout_s=120)
    learner = make_learner(lora)
    tensor_parallel_learner(learner)
    attn = causal_lm(learner.model).model.layers[0].self_attn
    if lora:
        shapes = {
            "q_B": tuple(attn.q_proj.lora_B["default"].weight.to_local().shape),
            "q_A": tuple(attn.q_proj.lora_A["default"].weight.shape),
            "o_A": tuple(attn.o_proj.lora_A["default"].weight.to_local().shape),
            "o_B": tuple(attn.o_proj.lora_B["default"].weight.shape),
        }
    else:
        shapes = {"q": tuple(attn.q_proj.weight.to_local().shape)}
    m1 = learner.step(samples(1))
    m2 = learner.step(samples(2))
    w = learner.weights()
    adapters = lora_update(learner.model, version=2).tensors if lora else {}
    if rank == 0:
        torch.save({"m1": m1, "m2": m2, "w": w, "adapters": adapters, "shapes": shapes}, out_path)
    dist.destroy_process_group()


TP_SHAPES = {
    False: {"q": (32, 64)},  # 4 heads of 16 dims split in 2: each rank holds 2 heads
    # rank 4 over hidden 64: q_proj's B split by output rows, o_proj's A by input columns; the others whole
    True: {"q_B": (32, 4), "q_A": (4, 64), "o_A": (4, 32), "o_B": (64, 4)},
}


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_tensor_parallel_ranks_train_as_one_process_and_push_the_whole_adapters(tmp_path, lora):
    out_path = str(tmp_path / "rank0.pt")
    mp.start_processes(_tp_worker, args=(_free_port(), lora, out_path), nprocs=2, start_method="spawn")
    ranks = torch.load(out_path, weights_only=False)
    assert ranks["shapes"] == TP_SHAPES[lora]
    single = make_learner(lora)
    start = weights(single)
    m1 = single.step(samples(1))
    m2 = single.step(samples(2))
    assert min(m1["advantage_abs_mean"], m2["advantage_abs_mean"]) > 0.1
    _moved(start, single.weights(), lora=lora)
    _close(ranks["w"], single.weights())  # LoRA merged; float32, 2e-5 absolute
    for key in METRICS:
        assert ranks["m1"][key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
        assert ranks["m2"][key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
    if lora:  # the weight sync pushes the whole adapters one process would
        _close(ranks["adapters"], lora_update(single.model, 2).tensors)


# the clip bites on both steps (the tiny model's norms are about 0.15 full, 0.025 LoRA): the whole-model
# norm decides
CLIP = {False: 0.1, True: 0.02}


def _mesh_worker(rank: int, port: int, lora: bool, ckpt: str, out_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    init_local_gloo(rank, 4, port, timeout_s=120)
    learner = make_learner(lora, max_grad_norm=CLIP[lora])
    mesh = parallelize_2d(learner, dp=2, tp=2)
    q = causal_lm(learner.model).model.layers[0].self_attn.q_proj
    q = q.base_layer.weight if lora else q.weight
    m1 = learner.step(samples(1))
    save_sharded(learner, ckpt)
    w1 = learner.weights()
    m2 = learner.step(samples(2))
    w2 = learner.weights()
    adapters = lora_update(learner.model, version=2).tensors if lora else {}
    if rank == 0:
        out = {"m1": m1, "m2": m2, "w1": w1, "w2": w2, "local_q": tuple(q.to_local().shape)}
        out["adapters"] = adapters
        torch.save(
            out | {"mesh": tuple(mesh.shape), "dp": learner.dp.world, "tp": learner.tp.world}, out_path
        )
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_2x2_mesh_of_fsdp_and_tensor_parallel_trains_as_one_process_and_its_checkpoint_loads_on_one(
    tmp_path, lora
):
    ckpt, out_path = str(tmp_path / "ckpt"), str(tmp_path / "rank0.pt")
    args = (_free_port(), lora, ckpt, out_path)
    mp.start_processes(_mesh_worker, args=args, nprocs=4, start_method="spawn")
    ranks = torch.load(out_path, weights_only=False)
    assert (ranks["mesh"], ranks["dp"], ranks["tp"]) == ((2, 2), 2, 2)
    assert ranks["local_q"] == (16, 64)  # q_proj [64, 64]: split in 2 by heads, then in 2 by FSDP

    single = make_learner(lora, max_grad_norm=CLIP[lora])
    start = weights(single)
    m1 = single.step(samples(1))
    assert m1["advantage_abs_mean"] > 0.1
    _moved(start, single.weights(), lora=lora)
    _close(ranks["w1"], single.weights())  # float32, 2e-5 absolute (2e-6 seen)
    for key in METRICS:
        assert ranks["m1"][key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
    w1 = weights(single)
    m2 = single.step(samples(2))
    assert min(m1["grad_norm"], m2["grad_norm"]) > CLIP[lora]  # the clip took effect on both steps
    _moved(w1, single.weights(), lora=lora)
    _close(ranks["w2"], single.weights())
    for key in METRICS:
        assert ranks["m2"][key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
    if lora:  # the weight sync pushes the whole adapters one process would
        _close(ranks["adapters"], lora_update(single.model, 2).tensors)

    resumed = make_learner(lora, max_grad_norm=CLIP[lora])  # one process, from the 4 ranks' shards
    load_sharded(resumed, ckpt)
    assert (resumed.version, resumed.optimizer_steps) == (single.version - 1, single.optimizer_steps - 2)
    _close(resumed.weights(), ranks["w1"], atol=0.0)
    resumed.step(samples(2))
    _close(resumed.weights(), ranks["w2"])


def test_a_mesh_that_is_not_the_world_size_is_refused(tmp_path):
    import torch.distributed as dist

    init_local_gloo(0, 1, _free_port(), timeout_s=30)
    try:
        with pytest.raises(
            ValueError, match=r"dp=2 x tp=2 mesh needs dp\*tp=4 ranks; torch.distributed has 1"
        ):
            parallelize_2d(make_learner(False), dp=2, tp=2)
        with pytest.raises(ValueError, match=r"a dp=0 x tp=1 mesh"):
            parallelize_2d(make_learner(False), dp=0, tp=1)
    finally:
        dist.destroy_process_group()


CRITIC_METRICS = (*METRICS, "value_loss", "critic_grad_norm", "vf_clipfrac", "value_mean")


def make_ppo_learner() -> Learner:
    """PPO with GAE and a copied critic (the policy's decoder under a zero value head)."""
    model = ModelConfig(spec="tiny:llama")
    trainer = TrainerConfig(lr=1e-3, critic="copy", critic_lr=1e-3)
    return Learner(model, trainer, AlgorithmConfig(advantage="gae"), seed=0, batch_cfg=BATCH)


def critic_weights(learner: Learner) -> dict[str, torch.Tensor]:
    """The whole critic (shards and splits gathered; every rank must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True)
    return {k: v.detach().clone() for k, v in get_model_state_dict(learner.critic, options=opts).items()}


def _critic_worker(rank: int, port: int, mode: str, ckpt: str, out_path: str) -> None:
    import torch.distributed as dist

    from posttrain.train.distributed import tensor_parallel_learner

    world = 4 if mode == "2d" else 2
    torch.set_num_threads(1)
    init_local_gloo(rank, world, port, timeout_s=120)
    learner = make_ppo_learner()
    if mode == "fsdp":
        shard_learner(learner)
    elif mode == "tp":
        tensor_parallel_learner(learner)
    else:
        parallelize_2d(learner, dp=2, tp=2)
    m1 = learner.step(samples(1))
    save_sharded(learner, ckpt)
    w1, c1 = weights(learner), critic_weights(learner)
    m2 = learner.step(samples(2))
    w2, c2 = weights(learner), critic_weights(learner)
    if rank == 0:
        torch.save({"m1": m1, "m2": m2, "w1": w1, "c1": c1, "w2": w2, "c2": c2}, out_path)
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "mode", ["fsdp", pytest.param("tp", marks=pytest.mark.slow), pytest.param("2d", marks=pytest.mark.slow)]
)
def test_a_critic_on_sharded_ranks_trains_as_one_process_and_its_checkpoint_loads_on_one(tmp_path, mode):
    ckpt, out_path = str(tmp_path / "ckpt"), str(tmp_path / "rank0.pt")
    args = (_free_port(), mode, ckpt, out_path)
    mp.start_processes(_critic_worker, args=args, nprocs=4 if mode == "2d" else 2, start_method="spawn")
    ranks = torch.load(out_path, weights_only=False)

    single = make_ppo_learner()
    start, start_critic = weights(single), critic_weights(single)
    m1 = single.step(samples(1))
    assert m1["value_loss"] > 0 and m1["critic_grad_norm"] > 0  # the critic trained
    assert m1["advantage_abs_mean"] > 0.1
    _moved(start, single.weights())
    _moved(start_critic, critic_weights(single))
    _close(ranks["w1"], single.weights())
    _close(ranks["c1"], critic_weights(single))
    w1, c1 = weights(single), critic_weights(single)
    m2 = single.step(samples(2))
    assert m2["value_mean"] != 0.0  # the head moved off zero: step 2's values come from the trained critic
    assert m2["advantage_abs_mean"] > 0.1
    _moved(w1, single.weights(), atol=1e-4)
    _moved(c1, critic_weights(single), atol=1e-4)
    # step 2's advantages come from the critic's values, which carry the ranks' rounding (split matmuls):
    # 1e-4 absolute (4.4e-5 seen under tensor parallelism, 2e-5 under FSDP alone)
    _close(ranks["w2"], single.weights(), atol=1e-4)
    _close(ranks["c2"], critic_weights(single), atol=1e-4)
    for key in CRITIC_METRICS:
        assert ranks["m1"][key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
        assert ranks["m2"][key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key

    resumed = make_ppo_learner()  # one process, from the ranks' shards: critic and its optimizer too
    load_sharded(resumed, ckpt)
    _close(critic_weights(resumed), ranks["c1"], atol=0.0)
    resumed.step(samples(2))
    _close(resumed.weights(), ranks["w2"], atol=1e-4)
    _close(critic_weights(resumed), ranks["c2"], atol=1e-4)


def test_a_sharded_checkpoint_and_a_learner_that_disagree_on_the_critic_are_refused(tmp_path):
    import torch.distributed as dist

    init_local_gloo(0, 1, _free_port(), timeout_s=30)
    try:
        learner = make_ppo_learner()
        shard_learner(learner)
        save_sharded(learner, tmp_path / "ckpt")
    finally:
        dist.destroy_process_group()
    with pytest.raises(ValueError, match="disagree on having a critic .* the checkpoint has$"):
        load_sharded(make_learner(False), tmp_path / "ckpt")
