"""The run's other uses of a learner group. Resume: a 1-step run with 2 FSDP ranks or 2 tensor-parallel
ranks (a sharded learner folder) or 2 context-parallel ranks (rank 0's single-process folder), resumed by
a fresh group to step 2, logs the straight single-process run's metrics and ends with its weights. The
drift probe (score_tokens), the drift-steered KL coefficient (kl_ctl) and optimizer offload/reload
through 2 FSDP ranks log the single-process run's figures."""

from __future__ import annotations

import pytest

from posttrain.orchestrator.checkpoint import step_name
from posttrain.orchestrator.learner_group import LearnerGroup
from posttrain.orchestrator.state import LEARNER_DIR
from posttrain.telemetry import read_metrics

from .test_learner_group import _assert_same
from .test_loop import _cfg, _run, _untimed

STEPS = [
    "curriculum.probe_every=0",
    "trainer.share_prompt_prefix=false",
    "trainer.single_pass_old_logprobs=false",
]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    rl = _run(_cfg(tmp_path_factory.mktemp("straight"), *STEPS, "orchestrator.steps=2"), "straight")
    out = _untimed(read_metrics(rl.run_dir.metrics)), {k: v.clone() for k, v in rl.learner.weights().items()}
    rl.close()
    return out


@pytest.mark.parametrize(
    ("mode", "sharded"),
    [  # 18-45 s each on a quiet 2-core machine (up to 100 s under load): the FSDP one runs by default
        ("data_parallel", True),
        pytest.param("tensor_parallel", True, marks=pytest.mark.slow),
        pytest.param("context_parallel", False, marks=pytest.mark.slow),
    ],
)
def test_a_group_run_resumes_from_its_checkpoint_as_the_straight_run(straight, tmp_path, mode, sharded):
    rows, weights = straight
    first = _run(_cfg(tmp_path, *STEPS, f"trainer.{mode}=2", "orchestrator.steps=1"), "resumed")
    first.close()
    learner_dir = first.run_dir.checkpoints / step_name(1) / LEARNER_DIR
    assert (learner_dir / "learner_counters.json").is_file() == sharded
    again = _run(_cfg(tmp_path, *STEPS, f"trainer.{mode}=2", "orchestrator.steps=2"), "resumed", resume=True)
    try:
        assert isinstance(again.learner, LearnerGroup)
        _assert_same(rows, weights, again)  # step 1 by the first group, step 2 by the resumed one
    finally:
        again.close()


def test_drift_probe_kl_steering_and_offload_through_fsdp_ranks(tmp_path):
    sets = [
        *STEPS,
        "orchestrator.steps=2",
        "curriculum.drift_every=1",
        "curriculum.drift_prompts=2",
        "orchestrator.offload_optimizer=true",
        "algorithm.kl_coef=0.05",
        "algorithm.kl_target=0.01",
        "algorithm.kl_control=drift",
    ]
    one = _run(_cfg(tmp_path, *sets), "one")
    rows, weights = _untimed(read_metrics(one.run_dir.metrics)), one.learner.weights()
    one.close()
    group = _run(_cfg(tmp_path, *sets, "trainer.data_parallel=2"), "group")
    try:
        assert isinstance(group.learner, LearnerGroup)
        got = _untimed(read_metrics(group.run_dir.metrics))
        assert all("drift/kl_k3" in r and "drift/kl_coef" in r for r in got)
        assert rows[1]["drift/kl_coef"] != rows[0]["drift/kl_coef"]  # the probe steered it
        _assert_same(rows, weights, group)
        assert group.learner.kl_ctl.value == pytest.approx(rows[-1]["drift/kl_coef"], rel=1e-6)
    finally:
        group.close()
