"""Learner ranks started and driven by the run (`orchestrator.rl.learner_group`, local processes over gloo):
a 2-step RL run with 2 context-parallel ranks and with 2 FSDP ranks logs the single-process run's step
metrics and ends with its weights, as local processes and as Ray actors, on a domain whose rewards vary
(the reference's advantages are not zero and its weights move by 10x the equality tolerance); a rank
that raises or dies gives an error naming it and leaves no process behind; bad sizes are config errors."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from posttrain.config import load_config
from posttrain.orchestrator.rl.learner_group import LearnerGroup, LearnerRankError
from posttrain.telemetry import read_metrics

from .test_loop import _cfg, _run, _untimed

# one sequence per row in every run: context parallelism turns shared-prompt rows off, and the layout
# figures (padding_frac, computed tokens) describe the rows. One row (<= 59 tokens) per micro-batch: the
# step's 6 rows are 6 micro-batches, 3 per FSDP rank (at the default 4096 tokens all 6 are one, which
# rank 0 runs while rank 1 runs a weight-0 repeat). Engine and learner in float32: under
# bfloat16 the ranks' rounding moves the learner's logprobs by up to 1.5e-3 (seen with 2 context-parallel
# ranks), the step-1 gradient's norm by 5e-4 of itself, and step 2 samples other completions
STEPS = [
    "orchestrator.steps=2",
    "curriculum.probe_every=0",
    "trainer.share_prompt_prefix=false",
    "batch.micro_batch_tokens=64",
    "engine.dtype=float32",
]
# FSDP ranks compute the old logprobs in a pass of their own: their reference does too
FSDP_REF = ["trainer.single_pass_old_logprobs=false"]


# the weights' equality tolerance (float32 learner, absolute)
ATOL = 1e-4


def start_weights(cfg) -> dict[str, torch.Tensor]:
    """The policy weights a run of `cfg` starts from: one process's Learner at the config's seed."""
    from posttrain.train import Learner

    one = {"data_parallel": 1, "tensor_parallel": 1, "context_parallel": 1}
    learner = Learner(
        cfg.model, cfg.trainer.model_copy(update=one), cfg.algorithm, seed=cfg.seed, batch_cfg=cfg.batch
    )
    return {k: v.detach().clone() for k, v in learner.weights().items()}


def assert_learned(rows: list[dict], start: dict, weights: dict) -> None:
    """Every step of the reference run had advantages that are not all zero, and every weight tensor
    moved from `start` by more than 10x the equality tolerance: a group that dropped a gradient
    all-reduce or a shard's update cannot match it by standing still."""
    adv = [r["train/advantage_abs_mean"] for r in rows]
    assert all(a > 0.1 for a in adv), adv
    assert start.keys() == weights.keys()
    moved = {k: (weights[k].float() - start[k].float()).abs().max().item() for k in start}
    assert min(moved.values()) > 10 * ATOL, min(moved.items(), key=lambda kv: kv[1])


@pytest.fixture(scope="module")
def single(tmp_path_factory, length_domain):
    """The single-process run's metrics and final weights on the length-paid domain, per extra config
    (cached); each one checked to have learned (`assert_learned`)."""
    runs: dict[tuple[str, ...], tuple] = {}

    def get(*sets: str) -> tuple:
        if sets not in runs:
            cfg = _cfg(tmp_path_factory.mktemp("single"), *STEPS, length_domain, *sets)
            start = start_weights(cfg)
            rl = _run(cfg, "single")
            weights = {k: v.clone() for k, v in rl.learner.weights().items()}
            runs[sets] = _untimed(read_metrics(rl.run_dir.metrics)), weights
            rl.close()
            assert_learned(runs[sets][0], start, weights)
        return runs[sets]

    return get


def _tol(key: str) -> float:
    # the engine-learner logprob mismatch (~1e-6 in float32) is a difference of two logprobs that agree
    # to ~1e-6 each: the ranks' float rounding (ring attention, sharded matmuls) moves it by about as much
    return 1e-5 if key.startswith("train/mismatch") else 1e-4


def _assert_same(rows: list[dict], weights: dict, rl) -> None:
    """`rl`'s step metrics and final weights are the reference's."""
    got = _untimed(read_metrics(rl.run_dir.metrics))
    assert [r["step"] for r in got] == [1, 2]
    for a, b in zip(rows, got, strict=True):
        assert set(a) ^ set(b) == set()
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=_tol(k)), k
    final = rl.learner.weights()
    assert final.keys() == weights.keys()
    for k in weights:
        assert torch.allclose(final[k].float(), weights[k].float(), atol=ATOL, rtol=0), k


def _same_run(single, length_domain, tmp_path, mode: str, *sets: str) -> None:
    rows, weights = single(*sets)
    rl = _run(_cfg(tmp_path, *STEPS, length_domain, *sets, f"trainer.{mode}=2"), mode)
    try:
        assert isinstance(rl.learner, LearnerGroup)
        procs = list(rl.learner.procs)
        _assert_same(rows, weights, rl)
    finally:
        rl.close()
    assert procs and not any(p.is_alive() for p in procs)


def test_two_context_parallel_ranks_run_as_one_process(single, length_domain, tmp_path):
    _same_run(single, length_domain, tmp_path, "context_parallel")


def test_two_fsdp_ranks_run_as_one_process(single, length_domain, tmp_path):
    _same_run(single, length_domain, tmp_path, "data_parallel", *FSDP_REF)


@pytest.mark.slow
def test_a_2x2_mesh_of_ranks_runs_as_one_process(single, length_domain, tmp_path):
    """Four ranks: FSDP over 2 groups of 2 tensor-parallel ranks (`parallelize_2d`)."""
    rows, weights = single(*FSDP_REF)
    mesh = ["trainer.data_parallel=2", "trainer.tensor_parallel=2"]
    rl = _run(_cfg(tmp_path, *STEPS, length_domain, *FSDP_REF, *mesh), "2d")
    try:
        assert isinstance(rl.learner, LearnerGroup) and len(rl.learner.procs) == 4
        _assert_same(rows, weights, rl)
    finally:
        rl.close()


def _pids_gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


def test_a_rank_that_raises_is_named_and_every_rank_ends(tmp_path):
    group = LearnerGroup(_cfg(tmp_path, "trainer.context_parallel=2"))
    pids = [p.pid for p in group.procs]
    # context-parallel ranks: only rank 0 writes the state, so only rank 0 raises
    with pytest.raises(LearnerRankError, match=r"learner rank 0 failed: FileNotFoundError") as err:
        group.save("/proc/no-such-place/learner")
    assert err.value.rank == 0
    assert _pids_gone(pids)
    with pytest.raises(RuntimeError, match="closed"):
        group.weights()


def test_a_rank_that_dies_is_named_and_every_rank_ends(tmp_path):
    group = LearnerGroup(_cfg(tmp_path, "trainer.data_parallel=2"))
    pids = [p.pid for p in group.procs]
    try:
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(LearnerRankError, match=r"learner rank 1 failed: exited with code -9"):
            group.weights()
    finally:
        group.close()
    assert _pids_gone(pids)


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["trainer.data_parallel=2", "placement.learner_ranks=3"], "placement.learner_ranks=3 but"),
        (["trainer.context_parallel=2", "placement.learner_cpus=0"], "learner_cpus"),
    ],
)
def test_bad_learner_rank_configs_are_refused(tmp_path, sets, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [f"telemetry.run_dir={tmp_path}", *sets])


@pytest.mark.slow
def test_ray_rank_actors_run_as_one_process(single, length_domain, tmp_path):
    """Two FSDP ranks as Ray actors on a local 2-CPU cluster, beside one engine actor."""
    ray = pytest.importorskip("ray")
    from posttrain.orchestrator.rl.learner_group import RayLearnerGroup

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        ray_sets = ["placement.backend=ray", "placement.weight_sync=shared_file", "placement.engine_cpus=1"]
        rows, weights = single(*FSDP_REF)
        rl = _run(
            _cfg(
                tmp_path,
                *STEPS,
                length_domain,
                *FSDP_REF,
                *ray_sets,
                "placement.learner_cpus=0.5",
                "trainer.data_parallel=2",
            ),
            "ray",
        )
        try:
            assert isinstance(rl.learner, RayLearnerGroup)
            _assert_same(rows, weights, rl)
        finally:
            rl.close()
        assert not rl.learner.actors and rl.learner.pg is None
    finally:
        ray.shutdown()
