"""Context parallelism composed with FSDP2 on the Learner: a dp x cp mesh of 4 gloo ranks
(`parallelize_dp_cp`, 2 dp groups of 2 context-parallel ranks) against one process. Logprobs before and
after two RL steps (KL to the reference, entropy bonus), both steps' metrics and the final weights within
1e-4 on every rank, and the ranks' sharded checkpoint read by one process holds those weights."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from posttrain.config import AlgorithmConfig, BatchConfig, ModelConfig, TrainerConfig
from posttrain.orchestrator.learner_group import free_port
from posttrain.train import Learner
from posttrain.train.distributed import init_local_gloo, load_sharded, parallelize_dp_cp, save_sharded

from .test_context_parallel import METRICS, samples

# rows of 9..23 tokens, at most 24 padded cells a micro-batch: 5 micro-batches, so one dp group runs a
# weight-0 repeat, and the row whose loss sits on its last 3 tokens leaves a cp rank without a target
BATCH = BatchConfig(micro_batch_tokens=24)
ALGO = AlgorithmConfig(kl_coef=0.1, entropy_coef=0.01)


def make_learner(dp: int, cp: int) -> Learner:
    # FSDP ranks compute the old logprobs in a pass of their own: so does the single process here
    trainer = TrainerConfig(lr=1e-3, data_parallel=dp, context_parallel=cp, single_pass_old_logprobs=False)
    return Learner(ModelConfig(spec="tiny:llama"), trainer, ALGO, seed=0, batch_cfg=BATCH)


def run(learner: Learner) -> dict:
    lp = learner.compute_logprobs(samples(1))
    first = learner.step(samples(2))
    second = learner.step(samples(3))  # the policy has moved off its reference: a KL term and its gradient
    weights = {k: v.detach().clone() for k, v in learner.weights().items()}
    lp_after = learner.compute_logprobs(samples(1))
    return {"lp": lp, "metrics": [first, second], "weights": weights, "lp_after": lp_after}


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    init_local_gloo(rank, 4, port, timeout_s=180)
    learner = make_learner(2, 2)
    mesh = parallelize_dp_cp(learner, 2, 2)
    got = run(learner)
    got["coords"] = (mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank())
    save_sharded(learner, f"{out_dir}/ckpt")
    torch.save(got, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def test_a_2x2_dp_cp_mesh_of_learners_equals_the_single_process_learner(tmp_path):
    mp.start_processes(_worker, args=(free_port(), str(tmp_path)), nprocs=4, start_method="fork")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    assert sorted(r["coords"] for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    single = run(make_learner(1, 1))
    start = make_learner(1, 1).weights()
    assert single["lp"].abs().sum() > 0
    assert single["metrics"][1]["kl"] > 0 and single["metrics"][1]["kl_loss"] != 0
    moved = max((single["weights"][k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-3  # far past the tolerance: equal weights below are not the unmoved start
    for got in ranks:  # every rank: the whole logprobs, one process's metrics, the full weights
        assert (got["lp"] - single["lp"]).abs().max() < 1e-4
        assert (got["lp_after"] - single["lp_after"]).abs().max() < 1e-4
        for mine, theirs in zip(got["metrics"], single["metrics"], strict=True):
            for key in METRICS:
                assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
        assert got["weights"].keys() == single["weights"].keys()
        for k, w in single["weights"].items():
            assert (got["weights"][k] - w).abs().max() < 1e-4, k
    back = make_learner(1, 1)  # the sharded checkpoint, read by one process
    load_sharded(back, tmp_path / "ckpt")
    assert back.version == 2 and back.optimizer_steps == 2
    for k, w in back.weights().items():
        assert (w - single["weights"][k]).abs().max() < 1e-4, k


def test_a_dp_cp_mesh_needs_a_process_group():
    with pytest.raises(RuntimeError, match="parallelize_dp_cp needs torch.distributed initialised"):
        parallelize_dp_cp(make_learner(2, 2), 2, 2)
