"""trainer.device: where the Learner puts its tensors (`learner_device`: cpu, cuda:N, cuda:(rank % GPUs)
on a learner rank), the config errors of a bad device string or a CUDA device on a machine without one
(exit 2 from `posttrain train` and `posttrain sft`), and placement.learner_gpus: the Ray rank actors'
bundles and its agreement with trainer.device. CUDA itself runs in scripts/gpu_smoke.py."""

from __future__ import annotations

import datetime

import pytest
import torch
from typer.testing import CliRunner

from posttrain.cli import app
from posttrain.config import ConfigError, load_config
from posttrain.orchestrator.rl import RLRun
from posttrain.orchestrator.rl.learner_group import rank_resources
from posttrain.train import learner_device
from posttrain.train.learner import group_rank

RAY_RANKS = ["placement.backend=ray", "placement.weight_sync=shared_file", "trainer.data_parallel=2"]


@pytest.fixture
def four_gpus(monkeypatch):
    """torch as a process that sees 4 GPUs would report them (no CUDA tensor is made)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_cpu_is_the_default_and_needs_no_cuda(no_cuda):
    assert load_config(None, []).trainer.device == "cpu"
    assert learner_device("cpu") == torch.device("cpu")
    assert learner_device("cpu", 3) == torch.device("cpu")


def test_rank_r_takes_cuda_r_mod_the_visible_gpus(four_gpus):
    assert [learner_device("cuda", r) for r in range(6)] == [
        torch.device("cuda", i) for i in (0, 1, 2, 3, 0, 1)
    ]
    assert learner_device("cuda") == torch.device("cuda", 0)  # a single learner, outside a rank group
    assert learner_device("cuda:2") == torch.device("cuda", 2)
    assert learner_device("cuda:2", 1) == torch.device("cuda", 2)  # an explicit index is kept


def test_a_gpu_index_this_process_does_not_see_is_refused(four_gpus):
    with pytest.raises(ValueError, match=r"trainer.device=cuda:4, but this process sees 4 GPU\(s\)"):
        learner_device("cuda:4")


def test_cuda_without_cuda_is_refused_naming_the_key(no_cuda):
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match=rf"trainer.device={device}, but torch.cuda.is_available\(\)"):
            learner_device(device)


def test_the_rank_of_an_initialised_group_picks_the_device(monkeypatch, four_gpus):
    import torch.distributed as dist

    from posttrain.orchestrator.rl.learner_group import free_port

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert group_rank() is None
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        assert group_rank() == 0
        monkeypatch.setenv("LOCAL_RANK", "3")  # a launcher's per-node rank wins over the group rank
        assert group_rank() == 3
        assert learner_device("cuda", group_rank()) == torch.device("cuda", 3)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cuda:-1", "CUDA", "cuda0", "mps"])
def test_a_bad_device_string_is_a_config_error(device):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"trainer.device={device}"])
    assert "trainer.device" in str(err.value)
    assert f"'{device}' is not a learner device: use cpu, cuda or cuda:N" in str(err.value)


def test_the_config_takes_cuda_and_the_run_checks_the_machine(four_gpus, monkeypatch):
    cfg = load_config(None, ["model.spec=tiny:llama", "trainer.device=cuda"])
    RLRun.check(cfg)  # 4 GPUs visible: accepted
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"trainer.device=cuda, but torch.cuda.is_available\(\) is false"):
        RLRun.check(cfg)
    # Ray rank actors check their own machine: this one may have no GPU
    RLRun.check(load_config(None, [*RAY_RANKS, "trainer.device=cuda", "placement.learner_gpus=1"]))


@pytest.mark.parametrize("command", ["train", "sft"])
def test_cli_exits_2_for_cuda_on_a_machine_without_it(no_cuda, tmp_path, command):
    sets = ["--set", "model.spec=tiny:llama", "--set", "trainer.device=cuda"]
    sets += ["--set", f"telemetry.run_dir={tmp_path}"]
    extra = ["--data", str(tmp_path / "none.jsonl")] if command == "sft" else []
    result = CliRunner().invoke(app, [command, *sets, *extra])
    assert result.exit_code == 2, result.output
    assert "trainer.device=cuda, but torch.cuda.is_available() is false" in result.output
    assert list(tmp_path.iterdir()) == []  # no run folder made


def test_rank_actor_bundles_carry_the_configured_cpus_and_gpus():
    cfg = load_config(
        None, [*RAY_RANKS, "placement.learner_cpus=4", "placement.learner_gpus=1", "trainer.device=cuda"]
    )
    assert rank_resources(cfg) == ({"CPU": 4.0, "GPU": 1.0}, {"num_cpus": 4.0, "num_gpus": 1.0})
    two = load_config(None, [*RAY_RANKS, "placement.learner_gpus=2", "trainer.device=cuda:1"])
    assert rank_resources(two) == ({"CPU": 1.0, "GPU": 2.0}, {"num_cpus": 1.0, "num_gpus": 2.0})
    assert rank_resources(load_config(None, RAY_RANKS)) == ({"CPU": 1.0}, {"num_cpus": 1.0, "num_gpus": 0.0})


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            [*RAY_RANKS, "placement.learner_gpus=1"],
            "placement.learner_gpus=1.0 with trainer.device=cpu: the learner ranks would not use their GPUs",
        ),
        (
            [*RAY_RANKS, "trainer.device=cuda"],
            "trainer.device=cuda with Ray learner ranks and placement.learner_gpus=0: Ray hides",
        ),
        (
            [*RAY_RANKS, "trainer.device=cuda:1", "placement.learner_gpus=1"],
            "trainer.device=cuda:1 in a Ray actor of placement.learner_gpus=1.0: the actor sees its 1 GPU(s)",
        ),
        (
            [*RAY_RANKS, "trainer.device=cuda", "placement.learner_gpus=0.5"],
            "placement.learner_gpus=0.5: NCCL runs one learner rank per GPU, not a share of one",
        ),
        (
            ["trainer.data_parallel=2", "trainer.device=cuda", "placement.learner_gpus=1"],
            "placement.learner_gpus=1.0 reserves GPUs for Ray learner rank actors: set placement.backend=ray",
        ),
        (
            ["placement.backend=ray", "placement.weight_sync=shared_file", "placement.learner_gpus=1"],
            "placement.learner_gpus=1.0 reserves GPUs for Ray learner rank actors",
        ),
        (
            ["trainer.data_parallel=2", "trainer.device=cuda:0"],
            "trainer.device=cuda:0 with 2 learner ranks: NCCL needs one GPU per rank; set trainer.device=cuda",
        ),
        ([*RAY_RANKS, "placement.learner_gpus=-1"], "'placement.learner_gpus': got -1"),
    ],
)
def test_gpu_counts_that_disagree_with_the_learner_device_are_config_errors(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert expected in str(err.value)


def test_local_ranks_and_a_single_learner_take_plain_cuda():
    assert load_config(None, ["trainer.data_parallel=2", "trainer.device=cuda"]).trainer.device == "cuda"
    assert load_config(None, ["trainer.device=cuda:1"]).trainer.device == "cuda:1"


def test_what_a_rank_sends_back_keeps_its_structure_and_cpu_tensors():
    """`on_cpu` (applied to rank 0's replies) rebuilds dicts, tuples and dataclasses; CPU tensors pass
    through as the same objects, so a CPU group's replies are exactly what they were."""
    from posttrain.orchestrator.rl.learner_group import on_cpu
    from posttrain.orchestrator.rl.weight_sync import WeightUpdate

    t, u = torch.arange(6.0).reshape(2, 3), torch.ones(3)
    update = WeightUpdate(3, "lora", {"m.lora_A": t, "m.lora_B": u}, {"m": 2.0}, ["m"])
    got = on_cpu({"update": update, "scores": (t, u), "n": 1.5, "names": ["a"]})
    assert got["update"] == update and got["update"] is not update
    assert got["update"].tensors["m.lora_A"] is t and got["scores"][1] is u
    assert isinstance(got["scores"], tuple) and got["n"] == 1.5 and got["names"] == ["a"]


@pytest.mark.slow
def test_ray_rank_actors_reserving_gpus_are_placed_and_check_their_own_cuda():
    """2 rank actors of placement.learner_gpus=1 on a cluster of 2 logical GPUs are placed (a bundle
    each) and each builds its Learner there: with no real CUDA in the actor, the rank's error names
    trainer.device, though the controller's config check let the run start."""
    ray = pytest.importorskip("ray")
    from posttrain.orchestrator.rl.learner_group import LearnerRankError, RayLearnerGroup

    cfg = load_config(
        None, [*RAY_RANKS, "model.spec=tiny:llama", "trainer.device=cuda", "placement.learner_gpus=1"]
    )
    RLRun.check(cfg)
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        with pytest.raises(LearnerRankError, match=r"trainer.device=cuda, but torch.cuda.is_available"):
            RayLearnerGroup(cfg)
    finally:
        ray.shutdown()
