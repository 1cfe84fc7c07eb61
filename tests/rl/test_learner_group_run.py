"""The run's other uses of a learner group. Resume: a 1-step run with 2 FSDP ranks or 2 tensor-parallel
ranks (a sharded learner folder) or 2 context-parallel ranks (rank 0's single-process folder), resumed by
a fresh group to step 2, logs the straight single-process run's metrics and ends with its weights. The
drift probe (score_tokens), the drift-steered KL coefficient (kl_ctl) and optimizer offload/reload
through 2 FSDP ranks log the single-process run's figures. PPO with a copied critic on 2 FSDP ranks,
2 tensor-parallel ranks, a 2x2 mesh, 2 context-parallel ranks, or 4 ranks in a dp x cp or cp x tp mesh, straight or
(FSDP, TP, dp x cp, cp x tp) resumed from a sharded checkpoint, logs the single-process run's metrics and ends
with its policy and critic. A LoRA run on 2 FSDP (or 2 TP) ranks pushes
only the adapters, and its engine holds the group's merged weights."""

from __future__ import annotations

import pytest
import torch

from posttrain.orchestrator.checkpoint import step_name
from posttrain.orchestrator.rl.learner_group import LearnerGroup
from posttrain.orchestrator.rl.state import LEARNER_DIR
from posttrain.telemetry import read_metrics

from .test_learner_group import ATOL, _assert_same, assert_learned, start_weights
from .test_loop import _cfg, _run, _untimed

# as in test_learner_group: one row per micro-batch (the FSDP ranks share the step's rows), engine and
# learner in float32 (bfloat16 rounding differs across ranks)
STEPS = [
    "curriculum.probe_every=0",
    "trainer.share_prompt_prefix=false",
    "trainer.single_pass_old_logprobs=false",
    "batch.micro_batch_tokens=64",
    "engine.dtype=float32",
]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, length_domain):
    cfg = _cfg(tmp_path_factory.mktemp("straight"), *STEPS, length_domain, "orchestrator.steps=2")
    start = start_weights(cfg)
    rl = _run(cfg, "straight")
    out = _untimed(read_metrics(rl.run_dir.metrics)), {k: v.clone() for k, v in rl.learner.weights().items()}
    rl.close()
    assert_learned(out[0], start, out[1])
    return out


@pytest.mark.parametrize(
    ("mode", "sharded"),
    [  # 18-45 s each on a quiet 2-core machine (up to 100 s under load): the FSDP one runs by default
        ("data_parallel", True),
        pytest.param("tensor_parallel", True, marks=pytest.mark.slow),
        pytest.param("context_parallel", False, marks=pytest.mark.slow),
    ],
)
def test_a_group_run_resumes_from_its_checkpoint_as_the_straight_run(
    straight, length_domain, tmp_path, mode, sharded
):
    rows, weights = straight
    sets = [*STEPS, length_domain, f"trainer.{mode}=2"]
    first = _run(_cfg(tmp_path, *sets, "orchestrator.steps=1"), "resumed")
    first.close()
    learner_dir = first.run_dir.checkpoints / step_name(1) / LEARNER_DIR
    assert (learner_dir / "learner_counters.json").is_file() == sharded
    again = _run(_cfg(tmp_path, *sets, "orchestrator.steps=2"), "resumed", resume=True)
    try:
        assert isinstance(again.learner, LearnerGroup)
        _assert_same(rows, weights, again)  # step 1 by the first group, step 2 by the resumed one
    finally:
        again.close()


def test_drift_probe_kl_steering_and_offload_through_fsdp_ranks(length_domain, tmp_path):
    sets = [
        *STEPS,
        length_domain,
        "orchestrator.steps=2",
        "curriculum.drift_every=1",
        "curriculum.drift_prompts=2",
        "orchestrator.offload_optimizer=true",
        "algorithm.kl_coef=0.05",
        "algorithm.kl_target=0.01",
        "algorithm.kl_control=drift",
    ]
    start = start_weights(_cfg(tmp_path, *sets))
    one = _run(_cfg(tmp_path, *sets), "one")
    rows, weights = _untimed(read_metrics(one.run_dir.metrics)), one.learner.weights()
    one.close()
    assert_learned(rows, start, weights)
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


# PPO: GAE advantages from a copied critic (the policy's decoder under a zero value head), in float32
# (STEPS): under bfloat16 the tensor-parallel split's rounding moves the critic's grad norm by 8e-4 of
# itself, and the step-1 weights it pushes sample other step-2 completions
CRITIC = [
    *STEPS,
    "trainer.critic=copy",
    "trainer.critic_lr=1e-3",
    "algorithm.advantage=gae",
]


@pytest.fixture(scope="module")
def critic_sets(length_domain) -> list[str]:
    return [*CRITIC, length_domain]


def _critic_state(rl, step: int) -> dict:
    """The whole critic of `rl`'s checkpoint at `step`, read by one process (sharded or not; context-
    parallel ranks' rank 0 writes the single-process Learner's folder)."""
    from posttrain.train import Learner
    from posttrain.train.distributed import load_sharded
    from posttrain.train.state import read_learner_state

    folder = rl.run_dir.checkpoints / step_name(step) / LEARNER_DIR
    if not (folder / "learner_counters.json").is_file():
        return read_learner_state(folder)[1]["critic"]
    cfg = rl.cfg
    learner = Learner(
        cfg.model,
        cfg.trainer.model_copy(update={"data_parallel": 1, "tensor_parallel": 1, "context_parallel": 1}),
        cfg.algorithm,
        seed=cfg.seed,
        batch_cfg=cfg.batch,
    )
    load_sharded(learner, folder)
    return {k: v.detach().clone() for k, v in learner.critic.state_dict().items()}


def _start_critic(cfg) -> dict:
    """The critic a run of `cfg` starts from: one process's Learner at the config's seed."""
    from posttrain.train import Learner

    learner = Learner(cfg.model, cfg.trainer, cfg.algorithm, seed=cfg.seed, batch_cfg=cfg.batch)
    return {k: v.detach().clone() for k, v in learner.critic.state_dict().items()}


@pytest.fixture(scope="module")
def straight_critic(tmp_path_factory, critic_sets):
    cfg = _cfg(tmp_path_factory.mktemp("straight_critic"), *critic_sets, "orchestrator.steps=2")
    start, start_critic = start_weights(cfg), _start_critic(cfg)
    rl = _run(cfg, "straight")
    rows = _untimed(read_metrics(rl.run_dir.metrics))
    weights = {k: v.clone() for k, v in rl.learner.weights().items()}
    critic = {k: v.detach().clone() for k, v in rl.learner.critic.state_dict().items()}
    rl.close()
    assert_learned(rows, start, weights)
    # every critic tensor moved by 5x the critic's equality tolerance (ATOL): its decoder by 7.4e-4 in
    # the 2 steps, its value head (off zero) by 2e-3
    moved = {k: (critic[k] - start_critic[k]).abs().max().item() for k in critic}
    assert min(moved.values()) > 5 * ATOL, sorted(moved.items(), key=lambda kv: kv[1])[:3]
    return rows, weights, critic


def _assert_same_critic(critic: dict, rl) -> None:
    got = _critic_state(rl, 2)
    assert got.keys() == critic.keys()
    for k in critic:
        assert torch.allclose(got[k], critic[k], atol=ATOL, rtol=0), (k, (got[k] - critic[k]).abs().max())


@pytest.mark.parametrize(
    ("ranks", "sets"),
    [
        (2, ["trainer.data_parallel=2"]),
        pytest.param(2, ["trainer.tensor_parallel=2"], marks=pytest.mark.slow),
        pytest.param(4, ["trainer.data_parallel=2", "trainer.tensor_parallel=2"], marks=pytest.mark.slow),
        pytest.param(2, ["trainer.context_parallel=2"], marks=pytest.mark.slow),
        pytest.param(4, ["trainer.data_parallel=2", "trainer.context_parallel=2"], marks=pytest.mark.slow),
        pytest.param(4, ["trainer.context_parallel=2", "trainer.tensor_parallel=2"], marks=pytest.mark.slow),
    ],
    ids=["fsdp", "tp", "2x2", "cp", "dp2xcp2", "cp2xtp2"],
)
def test_a_critic_on_sharded_ranks_runs_ppo_as_one_process(
    straight_critic, critic_sets, tmp_path, ranks, sets
):
    rows, weights, critic = straight_critic
    assert all(r["train/value_loss"] > 0 for r in rows)
    rl = _run(_cfg(tmp_path, *critic_sets, *sets, "orchestrator.steps=2"), "group")
    try:
        assert isinstance(rl.learner, LearnerGroup) and len(rl.learner.procs) == ranks
        _assert_same(rows, weights, rl)
        _assert_same_critic(critic, rl)
    finally:
        rl.close()


@pytest.mark.parametrize(
    "ranks",
    [
        ["trainer.data_parallel=2"],
        pytest.param(["trainer.tensor_parallel=2"], marks=pytest.mark.slow),
        pytest.param(["trainer.context_parallel=2"], marks=pytest.mark.slow),
        pytest.param(["trainer.data_parallel=2", "trainer.context_parallel=2"], marks=pytest.mark.slow),
        pytest.param(["trainer.context_parallel=2", "trainer.tensor_parallel=2"], marks=pytest.mark.slow),
    ],
    ids=["fsdp", "tp", "cp", "dp2xcp2", "cp2xtp2"],
)
def test_a_group_run_with_a_critic_resumes_from_its_sharded_checkpoint(
    straight_critic, critic_sets, tmp_path, ranks
):
    rows, weights, critic = straight_critic
    first = _run(_cfg(tmp_path, *critic_sets, *ranks, "orchestrator.steps=1"), "resumed")
    first.close()
    learner_dir = first.run_dir.checkpoints / step_name(1) / LEARNER_DIR
    # context-parallel ranks hold whole copies and rank 0 writes the one-process folder; FSDP and TP shard
    sharded = ranks != ["trainer.context_parallel=2"]
    assert (learner_dir / "learner_counters.json").is_file() == sharded, sorted(
        p.name for p in learner_dir.iterdir()
    )
    sets = [*critic_sets, *ranks, "orchestrator.steps=2"]
    again = _run(_cfg(tmp_path, *sets), "resumed", resume=True)
    try:
        _assert_same(rows, weights, again)  # step 1 by the first group, step 2 by the resumed one
        _assert_same_critic(critic, again)
    finally:
        again.close()


@pytest.mark.parametrize(
    "mode", ["data_parallel", pytest.param("tensor_parallel", marks=pytest.mark.slow)], ids=["fsdp", "tp"]
)
def test_a_lora_group_pushes_only_its_adapters_and_the_engine_holds_its_merged_weights(
    length_domain, tmp_path, mode
):
    import posttrain.orchestrator.rl.weight_sync as ws
    from posttrain.engine import make_engine
    from posttrain.models import load_policy

    sets = [
        *STEPS,
        "model.lora_rank=4",
        "model.lora_alpha=8",
        "placement.weight_sync=shared_file",
        f"placement.weight_sync_dir={tmp_path / 'w'}",
        f"trainer.{mode}=2",
        "orchestrator.steps=1",
        length_domain,  # rewards that vary: the step moves the adapters
    ]
    rl = _run(_cfg(tmp_path, *sets), "lora")
    try:
        assert isinstance(rl.learner, LearnerGroup) and rl.learner.lora
        pushed = rl.weight_transport.read()  # the step's push, as the engine read it
        assert pushed.kind == "lora" and pushed.version == 1 == rl.weight_receiver.version
        modules = set(pushed.scaling)  # every adapted module: its A and B, nothing else
        assert pushed.tensors.keys() == {m + s for m in modules for s in (ws.LORA_A, ws.LORA_B)}
        assert len(modules) == 2 * 7  # 2 layers x q, k, v, o, gate, up, down
        merged = rl.learner.weights()
        sent = read_metrics(rl.run_dir.metrics)[-1]["timeline/weight_sync_bytes"]
        adapter_bytes = sum(t.numel() * t.element_size() for t in pushed.tensors.values())
        assert sent == pushed.nbytes == adapter_bytes < ws.full_update(merged, 1).nbytes / 10
        cfg = rl.cfg  # an engine given the group's merged weights whole holds what the adapters made
        whole = make_engine(
            cfg.engine, load_policy(cfg.model.spec, dtype="float32", seed=cfg.seed), rl.tokenizer
        )
        initial = [{k: v.clone() for k, v in layer.items()} for layer in whole.runner.layers]
        whole.load_weights(merged, version=1)
        moved = 0
        for got, want, before in zip(rl.engine.runner.layers, whole.runner.layers, initial, strict=True):
            assert got.keys() == want.keys()
            for k in want:
                assert torch.allclose(got[k], want[k], atol=1e-6, rtol=0), k
                moved += not torch.allclose(got[k], before[k], atol=1e-6, rtol=0)
        assert moved  # the step changed the engine's weights: the adapters were merged in
    finally:
        rl.close()
