"""Context parallelism composed with FSDP2 on the Learner: a dp x cp mesh of 4 gloo ranks
(`parallelize_dp_cp`, 2 dp groups of 2 context-parallel ranks) against one process. Logprobs before and
after two RL steps (KL to the reference, entropy bonus), both steps' metrics and the final weights within
1e-4 on every rank, and the ranks' sharded checkpoint read by one process holds those weights."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from posttrain.config import AlgorithmConfig, BatchConfig, ModelConfig, TrainerConfig
from posttrain.orchestrator.rl.learner_group import free_port
from posttrain.train import Learner, build_batch
from posttrain.train.distributed import init_local_gloo, load_sharded, parallelize_dp_cp, save_sharded

from .test_context_parallel import METRICS, PACKED_BATCH, lengths_for, samples

# rows of 9..23 tokens, at most 24 padded cells a micro-batch: 5 micro-batches, so one dp group runs a
# weight-0 repeat, and the row whose loss sits on its last 3 tokens leaves a cp rank without a target
BATCH = BatchConfig(micro_batch_tokens=24)
ALGO = AlgorithmConfig(kl_coef=0.1, entropy_coef=0.01)


def make_learner(dp: int, cp: int, tp: int = 1, packing: bool = False) -> Learner:
    # FSDP ranks compute the old logprobs in a pass of their own: so does the single process here
    trainer = TrainerConfig(
        lr=1e-3,
        data_parallel=dp,
        context_parallel=cp,
        tensor_parallel=tp,
        single_pass_old_logprobs=False,
        packing=packing,
    )
    batch = PACKED_BATCH if packing else BATCH
    return Learner(ModelConfig(spec="tiny:llama"), trainer, ALGO, seed=0, batch_cfg=batch)


def run(learner: Learner) -> dict:
    lengths = lengths_for(learner)
    lp = learner.compute_logprobs(samples(1, lengths))
    first = learner.step(samples(2, lengths))
    # the policy has moved off its reference: a KL term and its gradient
    second = learner.step(samples(3, lengths))
    weights = {k: v.detach().clone() for k, v in learner.weights().items()}
    lp_after = learner.compute_logprobs(samples(1, lengths))
    return {"lp": lp, "metrics": [first, second], "weights": weights, "lp_after": lp_after}


def _worker(
    rank: int, port: int, out_dir: str, shape: tuple[int, int, int] = (2, 2, 1), packing: bool = False
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    init_local_gloo(rank, 4, port, timeout_s=180)
    learner = make_learner(*shape, packing=packing)
    mesh = parallelize_dp_cp(learner, *shape)
    got = run(learner)
    names = ("dp", "cp") if shape[2] == 1 else ("cp", "tp")
    got["coords"] = tuple(mesh[n].get_local_rank() for n in names)
    save_sharded(learner, f"{out_dir}/ckpt")
    torch.save(got, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("shape", "packing"),
    [((2, 2, 1), False), ((1, 2, 2), False), pytest.param((2, 2, 1), True, marks=pytest.mark.slow)],
    ids=["dp2xcp2", "cp2xtp2", "dp2xcp2-packed"],
)
def test_a_mesh_of_four_learners_equals_the_single_process_learner(tmp_path, shape, packing):
    """dp x cp, and cp x tp (each cp rank's ring carrying its tp share of the heads, FSDP over the cp
    ranks, the decoder layers' weights 2-D DTensors); dp x cp with packed rows (one micro-batch: one dp
    group runs a weight-0 repeat)."""
    mp.start_processes(
        _worker, args=(free_port(), str(tmp_path), shape, packing), nprocs=4, start_method="fork"
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    assert sorted(r["coords"] for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    single = run(make_learner(1, 1, packing=packing))
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


CRITIC_ALGO = AlgorithmConfig(advantage="gae", entropy_coef=0.01)
CRITIC_METRICS = ("loss", "value_loss", "vf_clipfrac", "critic_grad_norm", "grad_norm", "advantage_abs_mean")


def make_critic_learner(dp: int, cp: int, tp: int = 1) -> Learner:
    trainer = TrainerConfig(
        lr=1e-3,
        critic_lr=5e-3,
        critic="copy",
        data_parallel=dp,
        context_parallel=cp,
        tensor_parallel=tp,
        single_pass_old_logprobs=False,
    )
    return Learner(ModelConfig(spec="tiny:llama"), trainer, CRITIC_ALGO, seed=0, batch_cfg=BATCH)


def critic_weights(learner: Learner) -> dict[str, torch.Tensor]:
    """The critic's whole weights (gathered from their shards: a collective on every rank)."""
    from posttrain.train.distributed import _whole

    assert learner.critic is not None
    return {n: _whole(p.detach()).clone() for n, p in learner.critic.named_parameters()}


def run_critic(learner: Learner) -> dict:
    values = [learner.compute_values(build_batch(samples(1), learner.device))]
    metrics = [learner.step(samples(seed)) for seed in (2, 3)]
    values.append(learner.compute_values(build_batch(samples(1), learner.device)))
    weights = {k: v.detach().clone() for k, v in learner.weights().items()}
    return {"values": values, "metrics": metrics, "weights": weights, "critic": critic_weights(learner)}


def _critic_worker(rank: int, port: int, out_dir: str, shape: tuple[int, int, int]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    init_local_gloo(rank, 4, port, timeout_s=180)
    learner = make_critic_learner(*shape)
    parallelize_dp_cp(learner, *shape)
    got = run_critic(learner)
    save_sharded(learner, f"{out_dir}/ckpt")
    torch.save(got, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("shape", [(2, 2, 1), (1, 2, 2)], ids=["dp2xcp2", "cp2xtp2"])
def test_a_critic_in_a_mesh_of_four_equals_the_single_process_learner_and_resumes(tmp_path, shape):
    """PPO with GAE and a critic copied from the policy, its decoder layers (split over tp as the
    policy's) and root sharded over the dp x cp ranks as the policy's: values before and after two steps, the steps' metrics (value loss among
    them), the policy's and the critic's weights within 1e-4 on every rank; the ranks' sharded checkpoint
    read by one process holds both, and its next step is the uninterrupted learner's."""
    mp.start_processes(
        _critic_worker, args=(free_port(), str(tmp_path), shape), nprocs=4, start_method="fork"
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    single_learner = make_critic_learner(1, 1)
    start = critic_weights(single_learner)
    single = run_critic(single_learner)
    assert single["values"][1].abs().max() > 1e-3  # the head starts at zero; after two steps it is not
    assert all(m["value_loss"] > 0 and m["advantage_abs_mean"] > 0.1 for m in single["metrics"])
    assert max((single["critic"][k] - w).abs().max().item() for k, w in start.items()) > 1e-3
    for got in ranks:
        for mine, theirs in zip(got["values"], single["values"], strict=True):
            assert (mine - theirs).abs().max() < 1e-4
        for mine, theirs in zip(got["metrics"], single["metrics"], strict=True):
            for key in CRITIC_METRICS:
                assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
        for part in ("weights", "critic"):
            assert got[part].keys() == single[part].keys()
            for k, w in single[part].items():
                assert (got[part][k] - w).abs().max() < 1e-4, (part, k)
    back = make_critic_learner(1, 1)  # the mesh's checkpoint, read by one process
    load_sharded(back, tmp_path / "ckpt")
    assert back.version == 2 and back.optimizer_steps == 2
    for k, w in critic_weights(back).items():
        assert (w - single["critic"][k]).abs().max() < 1e-4, k
    resumed, uninterrupted = back.step(samples(4)), single_learner.step(samples(4))
    for key in CRITIC_METRICS:
        assert resumed[key] == pytest.approx(uninterrupted[key], rel=1e-4, abs=1e-6), key
    after = critic_weights(single_learner)
    for k, w in critic_weights(back).items():  # the update after it too: the Adam moments came back
        assert (w - after[k]).abs().max() < 1e-4, k
