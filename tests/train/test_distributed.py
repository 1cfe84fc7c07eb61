"""Data-parallel FSDP2 learner ranks and tensor-parallel ones (2 gloo processes on this CPU) against the
single-process Learner on the same samples: the same weights after each step (full and LoRA), the same
metrics, and a sharded checkpoint written by 2 ranks that a single process loads and trains on from
exactly there."""

from __future__ import annotations

import random
import socket

import pytest
import torch
import torch.multiprocessing as mp

from posttrain.config import AlgorithmConfig, BatchConfig, ModelConfig, TrainerConfig
from posttrain.train import Learner, Sample
from posttrain.train.distributed import (
    DataParallel,
    init_local_gloo,
    load_sharded,
    save_sharded,
    shard_learner,
)

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


def make_learner(lora: bool) -> Learner:
    model = ModelConfig(spec="tiny:llama", lora_rank=4 if lora else 0, lora_alpha=8.0)
    return Learner(model, TrainerConfig(lr=1e-3), AlgorithmConfig(), seed=0, batch_cfg=BATCH)


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


@pytest.mark.parametrize("lora", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["full", "lora"])
def test_two_fsdp_ranks_train_as_one_process_and_their_checkpoint_loads_on_one(tmp_path, lora):
    ckpt, out_path = str(tmp_path / "ckpt"), str(tmp_path / "rank0.pt")
    mp.start_processes(_worker, args=(_free_port(), lora, ckpt, out_path), nprocs=2, start_method="spawn")
    ranks = torch.load(out_path, weights_only=False)

    single = make_learner(lora)
    m1 = single.step(samples(1))
    _close(ranks["w1"], single.weights())
    for key in METRICS:
        assert ranks["m1"][key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
    m2 = single.step(samples(2))
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


def _tp_worker(rank: int, port: int, out_path: str) -> None:
    import torch.distributed as dist

    from posttrain.train.distributed import tensor_parallel_learner

    torch.set_num_threads(1)
    init_local_gloo(rank, 2, port, timeout_s=120)
    learner = make_learner(False)
    tensor_parallel_learner(learner)
    local_q = learner.model.model.layers[0].self_attn.q_proj.weight.to_local().shape
    m1 = learner.step(samples(1))
    m2 = learner.step(samples(2))
    w = learner.weights()
    if rank == 0:
        torch.save({"m1": m1, "m2": m2, "w": w, "local_q": tuple(local_q)}, out_path)
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_tensor_parallel_ranks_train_as_one_process(tmp_path):
    out_path = str(tmp_path / "rank0.pt")
    mp.start_processes(_tp_worker, args=(_free_port(), out_path), nprocs=2, start_method="spawn")
    ranks = torch.load(out_path, weights_only=False)
    single = make_learner(False)
    assert ranks["local_q"] == (32, 64)  # 4 heads of 16 dims split in 2: each rank holds 2 heads
    m1 = single.step(samples(1))
    m2 = single.step(samples(2))
    _close(ranks["w"], single.weights())
    for key in METRICS:
        assert ranks["m1"][key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
    assert ranks["m2"]["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-4)
