"""Runs with `trainer.data_parallel=2` and `trainer.context_parallel=2`: 4 learner rank processes (a dp x
cp mesh, 2 dp groups of 2 context-parallel ranks) started by the learner group, on a domain paid by
completion length. Two steps log the single-process run's metrics and end with its weights, which moved
from the start by more than the tolerance; so does a 1-step run (a sharded learner folder) resumed by a
fresh group to step 2."""

from __future__ import annotations

import pytest

from posttrain.orchestrator.checkpoint import step_name
from posttrain.orchestrator.rl.learner_group import LearnerGroup
from posttrain.orchestrator.rl.state import LEARNER_DIR
from posttrain.telemetry import read_metrics
from posttrain.train import Learner

from .test_learner_group import _assert_same
from .test_loop import _cfg, _run, _untimed

SETS = [
    "curriculum.probe_every=0",
    "trainer.share_prompt_prefix=false",
    "trainer.single_pass_old_logprobs=false",  # FSDP ranks compute the old logprobs in a pass of their own
    # float32: under bfloat16 autocast the ring's blockwise attention rounds unlike one attention over the
    # row, and with non-zero advantages that moves the grad norm by ~5e-4 of itself
    "engine.dtype=float32",
    # several micro-batches a step, so both dp groups get rows (at the default 4096 one micro-batch holds
    # the whole step and the second group only runs a weight-0 repeat)
    "batch.micro_batch_tokens=64",
]
DP_CP = ["trainer.data_parallel=2", "trainer.context_parallel=2"]


@pytest.fixture(scope="module")
def single(tmp_path_factory, length_domain):
    """The single-process 2-step run's metrics and final weights; the weights moved from the start."""
    one = _run(_cfg(tmp_path_factory.mktemp("single"), *SETS, length_domain, "orchestrator.steps=2"), "one")
    rows = _untimed(read_metrics(one.run_dir.metrics))
    weights = {k: v.clone() for k, v in one.learner.weights().items()}
    cfg = one.cfg
    one.close()
    start = Learner(cfg.model, cfg.trainer, cfg.algorithm, seed=cfg.seed, batch_cfg=cfg.batch).weights()
    assert max((weights[k] - start[k]).abs().max().item() for k in start) > 1e-3
    assert all(r["train/advantage_abs_mean"] > 0 for r in rows)  # the length reward gives a signal
    return rows, weights


@pytest.mark.slow
def test_a_2x2_dp_cp_run_logs_the_single_process_run(single, tmp_path, length_domain):
    group = _run(_cfg(tmp_path, *SETS, length_domain, *DP_CP, "orchestrator.steps=2"), "dp_cp")
    try:
        assert isinstance(group.learner, LearnerGroup) and len(group.learner.procs) == 4
        _assert_same(*single, group)
    finally:
        group.close()


@pytest.mark.slow
def test_a_2x2_dp_cp_run_resumes_from_its_sharded_checkpoint(single, tmp_path, length_domain):
    first = _run(_cfg(tmp_path, *SETS, length_domain, *DP_CP, "orchestrator.steps=1"), "resumed")
    first.close()
    assert (first.run_dir.checkpoints / step_name(1) / LEARNER_DIR / "learner_counters.json").is_file()
    again = _run(_cfg(tmp_path, *SETS, length_domain, *DP_CP, "orchestrator.steps=2"), "resumed", resume=True)
    try:
        _assert_same(*single, again)  # step 1 by the first group, step 2 by the resumed one
    finally:
        again.close()
