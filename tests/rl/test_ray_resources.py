"""GPUs per Ray actor: `placement.engine_gpus` goes into each engine actor's placement-group bundle and
its actor options, and must agree with `engine.device` (Ray shows an actor only the GPUs it reserves).
The slow test schedules actors through `ActorGroup` (engines, learner ranks, sandbox and reward
actors all start through it) on a local cluster of logical GPUs (no CUDA)."""

from __future__ import annotations

import pytest

from posttrain.config import ConfigError, load_config
from posttrain.orchestrator.rl.placement import engine_resources
from posttrain.sandbox.ray_pool import actor_resources

RAY = ["placement.backend=ray", "placement.weight_sync=shared_file"]


def test_engine_bundles_and_options_carry_the_configured_cpus_and_gpus():
    cfg = load_config(
        None, [*RAY, "placement.engine_cpus=4", "placement.engine_gpus=1", "engine.device=cuda"]
    )
    assert engine_resources(cfg) == ({"CPU": 4.0, "GPU": 1.0}, {"num_cpus": 4.0, "num_gpus": 1.0})
    half = load_config(None, [*RAY, "placement.engine_gpus=0.5", "engine.device=cuda:0"])
    assert engine_resources(half) == ({"CPU": 1.0, "GPU": 0.5}, {"num_cpus": 1.0, "num_gpus": 0.5})


def test_a_cpu_engine_bundle_names_no_gpu():
    assert engine_resources(load_config(None, RAY)) == ({"CPU": 1.0}, {"num_cpus": 1.0, "num_gpus": 0.0})
    assert actor_resources(2.0, 0.0) == ({"CPU": 2.0}, {"num_cpus": 2.0, "num_gpus": 0.0})


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            [*RAY, "placement.engine_gpus=1"],
            "placement.engine_gpus=1.0 with engine.device=cpu: the engine would not use its GPU",
        ),
        (
            [*RAY, "engine.device=cuda"],
            "engine.device=cuda with placement.backend=ray and placement.engine_gpus=0: Ray hides",
        ),
        (
            [*RAY, "engine.device=cuda:1", "placement.engine_gpus=1"],
            "engine.device=cuda:1 in a Ray actor of placement.engine_gpus=1.0: the actor sees its 1 GPU(s)",
        ),
        (
            ["placement.engine_gpus=1", "engine.device=cuda"],
            "placement.engine_gpus=1.0 reserves GPUs for Ray engine actors: set placement.backend=ray",
        ),
        ([*RAY, "placement.engine_gpus=-1"], "'placement.engine_gpus': got -1"),
    ],
)
def test_gpu_counts_that_disagree_with_the_device_are_config_errors(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert expected in str(err.value)


def test_two_gpu_engines_on_one_actor_each_may_use_cuda_1():
    cfg = load_config(None, [*RAY, "placement.engine_gpus=2", "engine.device=cuda:1"])
    assert engine_resources(cfg)[0] == {"CPU": 1.0, "GPU": 2.0}


@pytest.mark.slow
def test_engine_actors_reserve_distinct_logical_gpus():
    """Two actors of engine_resources (1 CPU, 1 GPU) on a cluster of 2 logical GPUs get one GPU each,
    different ones, visible to each as its only CUDA device; a third finds no room: a clear error."""
    ray = pytest.importorskip("ray")
    from posttrain.sandbox.ray_pool import ActorGroup

    class GpuReporter:  # defined here: Ray ships it by value (workers cannot import the test module)
        def ids(self) -> tuple[list, str | None]:
            import os

            import ray

            return ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES")

    cfg = load_config(None, [*RAY, "placement.engine_gpus=1", "engine.device=cuda"])
    p = cfg.placement
    assert engine_resources(cfg)[0] == {"CPU": 1.0, "GPU": 1.0}
    ray.init(num_cpus=3, num_gpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        group = ActorGroup(
            GpuReporter, (), 2, p.engine_cpus, gpus=p.engine_gpus, what="engines", strategy="PACK"
        )
        got = ray.get([a.ids.remote() for a in group.handles], timeout=120)
        ids = [g[0] for g in got]
        assert sorted(len(i) for i in ids) == [1, 1]
        assert ids[0] != ids[1]
        assert sorted(str(i[0]) for i in ids) == ["0", "1"]
        assert [g[1] for g in got] == [str(i[0]) for i in ids]  # each sees only its own GPU
        with pytest.raises(
            RuntimeError,
            match=r"engines: the Ray cluster has no room for 1 actors of \{'CPU': 1.0, 'GPU': 1.0\}",
        ):
            ActorGroup(GpuReporter, (), 1, 1.0, gpus=1.0, what="engines", strategy="PACK", ready_timeout_s=2)
        group.close()
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_a_group_that_finds_no_room_stops_the_local_cluster_it_started():
    """With no cluster connected, `ActorGroup` starts a local one; when its placement group never fits
    (a GPU on a machine of none) the error names the bundle and that cluster is shut down with it."""
    ray = pytest.importorskip("ray")
    from posttrain.sandbox.ray_pool import ActorGroup

    class Idle:
        pass

    assert not ray.is_initialized()
    try:
        with pytest.raises(
            RuntimeError,
            match=r"rewards: the Ray cluster has no room for 1 actors of \{'CPU': 1.0, 'GPU': 1.0\}",
        ):
            ActorGroup(Idle, (), 1, 1.0, gpus=1.0, what="rewards", strategy="PACK", ready_timeout_s=2)
        assert not ray.is_initialized()
    finally:
        ray.shutdown()


def test_the_multi_node_example_in_the_docs_is_a_valid_config(tmp_path):
    """docs/scale-out.md's Multi-node YAML loads, and its bundles fill the nodes the way the text says:
    8 engines use a GPU node's 16 CPUs, the learner and sandbox actors the CPU node's 64."""
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "scale-out.md").read_text()
    section = doc.split("## Multi-node", 1)[1]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "multinode.yaml").write_text(block)
    cfg = load_config(tmp_path / "multinode.yaml")
    p, s = cfg.placement, cfg.sandbox
    assert engine_resources(cfg) == ({"CPU": 2.0, "GPU": 1.0}, {"num_cpus": 2.0, "num_gpus": 1.0})
    assert (p.num_engines, cfg.trainer.learner_ranks, s.ray_actors) == (16, 2, 4)
    assert 8 * p.engine_cpus == 16 and p.learner_cpus > 16  # a learner bundle fits no GPU node
    assert cfg.trainer.learner_ranks * p.learner_cpus + s.ray_actors * s.ray_actor_cpus == 64
