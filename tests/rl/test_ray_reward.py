"""`reward.ray_actors`: the learned reward model in Ray actors. Their scores equal the in-process
scorer's exactly (Python floats, the same torch thread count), an actor killed before a call loses no
score, dead actors make `REWARD_ERROR` (never 0), a 1-step run logs the in-process run's metrics, and
bad values exit 2 naming the key. Slow (but the config test): Ray clusters start here."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from typer.testing import CliRunner

from posttrain.cli import app
from posttrain.config import load_config
from posttrain.models import load_tokenizer
from posttrain.orchestrator.rl import RLRun
from posttrain.rollout import LocalRewardScorer, make_learned_reward
from posttrain.rollout.reward_model import RayRewardScorer
from posttrain.telemetry import RunDir, read_metrics
from posttrain.train import load_reward_model, new_reward_model
from posttrain.types import TrajectoryStatus

from .test_learned_reward import _traj
from .test_loop import _untimed

SEQUENCES = [[1, 2, 3], [5, 9, 11, 4, 8], [7], [3, 3, 3, 3], [10, 20], [4, 6, 8, 10, 12, 14], [2, 1]]


@pytest.fixture(scope="module")
def reward_folder(tmp_path_factory):
    tok = load_tokenizer("tiny:llama")
    rm = new_reward_model("tiny:llama", pad_id=tok.pad_token_id)
    with torch.no_grad():
        rm.head.weight.copy_(torch.randn(rm.head.weight.shape, generator=torch.Generator().manual_seed(0)))
    return rm.save(tmp_path_factory.mktemp("rm") / "reward_model", tok), tok


def _pid_once_back(ray, actor, timeout_s: float = 120.0) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(actor.pid.remote(), timeout=timeout_s)
        except ray.exceptions.ActorUnavailableError:  # still restarting
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.slow
def test_reward_actors_score_as_the_in_process_model_and_survive_a_killed_actor(reward_folder):
    ray = pytest.importorskip("ray")
    folder, tok = reward_folder
    torch.set_num_threads(1)  # the actors' thread count (ray_actor_cpus 0.5, rounded up)
    local = LocalRewardScorer(load_reward_model(folder), batch_size=2)
    cfg = load_config(None, [f"reward.model={folder}", "reward.batch_size=2", "reward.ray_actors=2"])
    cfg.reward.ray_actor_cpus = 0.5
    learned = make_learned_reward(cfg.reward, tok)
    scorer = learned.scorer
    assert isinstance(scorer, RayRewardScorer) and scorer.group.started_ray
    try:
        want = asyncio.run(local.score(SEQUENCES))
        got = asyncio.run(scorer.score(SEQUENCES))
        assert got == want and all(type(v) is float for v in got)
        pid = ray.get(scorer.actors[0].pid.remote())
        scorer.group.kill(0)
        assert asyncio.run(scorer.score(SEQUENCES)) == want  # nothing lost to the dead actor
        assert _pid_once_back(ray, scorer.actors[0]) != pid  # Ray restarted it
        for actor in scorer.actors:
            ray.kill(actor, no_restart=True)
        trajs = [_traj(1.0), _traj(0.0)]
        asyncio.run(learned.apply(trajs))
        assert [t.status for t in trajs] == [TrajectoryStatus.REWARD_ERROR] * 2
        assert "reward actors failed 4 times" in trajs[0].info["reward_error"]
        assert "reward_model" not in trajs[0].rewards and trajs[0].reward == 1.0
    finally:
        scorer.close()
    assert not ray.is_initialized()


def _reward_run(tmp_path, name: str, folder, *extra: str):
    cfg = load_config(
        None,
        [
            "model.spec=tiny:llama",
            "engine.num_kv_blocks=256",
            "engine.max_new_tokens=8",
            "envs.domains=[{name: math, difficulties: [0]}]",
            "batch.prompts_per_step=2",
            "batch.samples_per_prompt=2",
            "orchestrator.steps=1",
            "curriculum.probe_every=0",
            "telemetry.progress=false",
            "telemetry.tensorboard=false",
            f"telemetry.run_dir={tmp_path}",
            f"reward.model={folder}",
            "reward.model_weight=2.0",
            "reward.batch_size=1",
            *extra,
        ],
    )
    run_dir = RunDir.create(cfg.telemetry.run_dir, name)
    rl = RLRun(cfg, run_dir)
    rl.train()
    kind = type(rl.reward.scorer)
    rl.close()
    return read_metrics(run_dir.metrics), kind


@pytest.mark.slow
def test_a_run_scored_by_reward_actors_logs_the_in_process_runs_metrics(tmp_path, reward_folder):
    ray = pytest.importorskip("ray")
    folder, _ = reward_folder
    torch.set_num_threads(1)
    local, local_kind = _reward_run(tmp_path, "local", folder)
    actors, actor_kind = _reward_run(
        tmp_path, "actors", folder, "reward.ray_actors=2", "reward.ray_actor_cpus=0.5"
    )
    assert local_kind is LocalRewardScorer and actor_kind is RayRewardScorer
    assert "reward_component/math/reward_model" in actors[0] and actors[0]["rollout/infra_failures"] == 0
    assert _untimed(actors) == _untimed(local)
    assert not ray.is_initialized()


def test_bad_reward_actor_values_exit_2_naming_the_key():
    runner = CliRunner()
    for sets, message in [
        (["reward.ray_actors=2"], "reward.ray_actors runs reward.model in Ray actors: set reward.model"),
        (["reward.ray_actors=-1"], "'reward.ray_actors': got -1: Input should be greater than or equal to 0"),
        (["reward.ray_actor_cpus=0"], "'reward.ray_actor_cpus': got 0: Input should be greater than 0"),
    ]:
        out = runner.invoke(app, ["config", "show", *(f"--set={s}" for s in sets)])
        assert out.exit_code == 2 and message in out.output, out.output
