"""A Learner with trainer.context_parallel=2 in 2 gloo processes (every sequence split zigzag, attention
round the ring) against the single-process Learner on the same samples: the same logprobs, the same
gradients and metrics of an RL step (with a KL term against the reference, an entropy bonus and rewards
that vary within each group), within 1e-4 (the gradients: of each tensor's largest entry); and the
refusals of what it does not support."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from posttrain.config import AlgorithmConfig, BatchConfig, ModelConfig, TrainerConfig
from posttrain.orchestrator.rl.learner_group import free_port
from posttrain.train import Learner, Sample
from posttrain.train.distributed import init_local_gloo

# rows of 9..23 tokens; a micro-batch holds at most 24 padded cells, so most rows go alone, and the row
# whose loss is on its last 3 tokens alone leaves rank 1 (chunks 1 and 2 of 4) without a target
BATCH = BatchConfig(micro_batch_tokens=24)
ALGO = AlgorithmConfig(kl_coef=0.1, entropy_coef=0.01)
METRICS = ("loss", "grad_norm", "entropy", "kl", "kl_loss", "approx_kl", "update_tokens")


# trainer.packing: one micro-batch of these, packed into rows of 23: [23], [14, 8, one padding cell], [12, 11]
PACKED_LENGTHS = [23, 8, 12, 11, 14]
PACKED_BATCH = BatchConfig(micro_batch_tokens=80)


def lengths_for(learner: Learner) -> tuple[int, ...]:
    """The row lengths of the samples a test runs through `learner`: packed or padded."""
    return tuple(PACKED_LENGTHS) if learner.trainer_cfg.packing else (23, 9, 17, 12, 21)


def samples(seed: int, lengths: tuple[int, ...] = (23, 9, 17, 12, 21)) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i, length in enumerate(lengths):
        ids = [rng.randrange(1000) for _ in range(length)]
        prompt = length - 3 if i == 0 else rng.randint(2, length // 2)
        mask = [0] * prompt + [1] * (length - prompt)
        blp = [-rng.uniform(5, 9) if m else 0.0 for m in mask]
        out.append(Sample(ids, mask, blp, reward=float(i % 2), group_id=i // 3))
    return out


def make_learner(cp: int, checkpointing: bool = False, packing: bool = False) -> Learner:
    trainer = TrainerConfig(
        lr=1e-3, context_parallel=cp, gradient_checkpointing=checkpointing, packing=packing
    )
    batch = PACKED_BATCH if packing else BATCH
    return Learner(ModelConfig(spec="tiny:llama"), trainer, ALGO, seed=0, batch_cfg=batch)


def run(learner: Learner) -> dict:
    lengths = lengths_for(learner)
    lp = learner.compute_logprobs(samples(1, lengths))
    learner.step(samples(2, lengths))
    # the policy has moved off its reference: a KL term and its gradient
    metrics = learner.step(samples(3, lengths))
    # one mini-batch: the gradients left are the second step's (clipped)
    grads = {n: p.grad.detach().clone() for n, p in learner.model.named_parameters() if p.grad is not None}
    lp_after = learner.compute_logprobs(samples(1, lengths))
    return {"lp": lp, "metrics": metrics, "grads": grads, "lp_after": lp_after}


def _rank(rank: int, port: int, job: Callable[[], dict], out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    init_local_gloo(rank, 2, port, timeout_s=120)
    torch.save(job(), f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def on_two_ranks(job: Callable[[], dict], out_dir: Path) -> list[dict]:
    """What `job` returns in each of 2 forked gloo processes (one process group), rank 0's first."""
    mp.start_processes(_rank, args=(free_port(), job, str(out_dir)), nprocs=2, start_method="fork")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize(
    ("checkpointing", "packing"),
    [(False, False), pytest.param(True, False, marks=pytest.mark.slow), (False, True)],
    ids=["plain", "checkpointing", "packed"],
)
def test_two_context_parallel_ranks_equal_the_single_process_learner(tmp_path, checkpointing, packing):
    ranks = on_two_ranks(lambda: run(make_learner(2, checkpointing, packing)), tmp_path)
    single = run(make_learner(1, checkpointing, packing))
    assert single["lp"].abs().sum() > 0
    for got in ranks:  # every rank holds the whole matrices and the same summed gradients
        assert (got["lp"] - single["lp"]).abs().max() < 1e-4
        assert (got["lp_after"] - single["lp_after"]).abs().max() < 1e-4
        assert got["grads"].keys() == single["grads"].keys() and len(single["grads"]) > 10
        for name, g in single["grads"].items():
            # the gradients are small (2e-5 to 7e-3 per tensor, q_proj the least): each within 1e-4 of
            # its own largest entry (3.4e-5 of it seen), not of 1e-4 absolute, which a halved one would pass
            scale = g.abs().max()
            assert scale > 0, name
            assert (got["grads"][name] - g).abs().max() < 1e-4 * scale, name
        for key in METRICS:
            assert got["metrics"][key] == pytest.approx(single["metrics"][key], rel=1e-4, abs=1e-6), key
    assert single["metrics"]["kl"] > 0 and single["metrics"]["kl_loss"] != 0
    # the rewards vary within each group: the gradients are not the KL and entropy terms' alone
    assert single["metrics"]["advantage_abs_mean"] > 0.1
    assert (ranks[0]["lp_after"] - ranks[0]["lp"]).abs().max() > 1e-3  # the updates moved the policy


def test_context_parallel_needs_a_process_group_of_its_size():
    with pytest.raises(RuntimeError, match=r"trainer.context_parallel=2 needs torch.distributed initialised"):
        make_learner(2)


def test_the_packed_case_packs_two_sequences_into_a_row_with_padding():
    from posttrain.train.batch import pack_rows, plan_micro_batches

    (plan,) = plan_micro_batches(PACKED_LENGTHS, PACKED_BATCH.micro_batch_tokens, True)  # one micro-batch
    assert sorted(plan) == [0, 1, 2, 3, 4]
    _, pos, seg, offsets = pack_rows(torch.zeros(5, 23, dtype=torch.long), PACKED_LENGTHS)
    assert seg.tolist() == [[0] * 23, [4] * 14 + [1] * 8 + [-1], [2] * 12 + [3] * 11]
    assert pos[1].tolist() == [*range(14), *range(8), 0] and offsets.tolist() == [0, 37, 46, 58, 23]


def test_context_parallel_refuses_dynamic_ntk():
    model = ModelConfig(spec="tiny:llama", rope_scaling={"type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="does not support dynamic NTK"):
        Learner(model, TrainerConfig(context_parallel=2), AlgorithmConfig(), batch_cfg=BATCH)
