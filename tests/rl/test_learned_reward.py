"""RL from a learned reward: the mix of verifier and reward-model scores against hand-computed values;
the reward server on 127.0.0.1 gives the in-process model's scores, batched; a 2-step RL run against
the live server trains on the mixed reward with the verifier's logged beside it; a server that fails
(500s, or nothing listening) makes infrastructure failures, never a reward of 0."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from contextlib import contextmanager

import pytest
import torch
import uvicorn

from posttrain.config import ConfigError, load_config
from posttrain.models import load_tokenizer
from posttrain.orchestrator.rl import RLRun
from posttrain.orchestrator.rl.guard import AllEpisodesFailed
from posttrain.rollout import (
    LearnedReward,
    RemoteRewardScorer,
    RewardModelError,
    make_learned_reward,
    make_reward_app,
)
from posttrain.telemetry import RunDir, read_metrics
from posttrain.train import new_reward_model, tokenizer_fingerprint
from posttrain.types import Task, Trajectory, TrajectoryStatus


def _traj(reward: float, status=TrajectoryStatus.OK) -> Trajectory:
    return Trajectory(
        Task("t", "math", 0, []),
        [1, 2, 3],
        [0, 1, 1],
        [0.0] * 3,
        1,
        {"success": reward},
        reward,
        status=status,
    )


class FixedScorer:
    def __init__(self, values):
        self.values, self.seen = values, []

    async def score(self, sequences):
        self.seen.append(sequences)
        return list(self.values)


def test_mixed_reward_and_failed_scores_are_infrastructure_failures():
    trajs = [_traj(0.85), _traj(0.0), _traj(1.0, TrajectoryStatus.SANDBOX_ERROR)]
    scorer = FixedScorer([2.0, RewardModelError("server down")])
    asyncio.run(LearnedReward(scorer, verifier_weight=0.5, model_weight=0.25).apply(trajs))
    assert len(scorer.seen[0]) == 2  # the sandbox failure is not sent
    ok, failed, infra = trajs
    assert ok.reward == pytest.approx(0.5 * 0.85 + 0.25 * 2.0)  # 0.925
    assert ok.rewards == {"success": 0.85, "verifier": 0.85, "reward_model": 2.0}
    assert failed.status is TrajectoryStatus.REWARD_ERROR and failed.status.is_infra_failure
    assert failed.reward == 0.0 and "reward_model" not in failed.rewards
    assert failed.info["reward_error"] == "server down"
    assert infra.status is TrajectoryStatus.SANDBOX_ERROR and "verifier" not in infra.rewards


def test_the_length_penalty_is_per_generated_token():
    long, short = _traj(1.0), _traj(1.0)
    long.loss_mask = [0] + [1] * 40  # 40 generated tokens
    long.token_ids = list(range(41))
    scorer = FixedScorer([3.0, 2.0])
    asyncio.run(LearnedReward(scorer, length_penalty=0.05).apply([long, short]))
    assert long.reward == pytest.approx(1.0 + 3.0 - 0.05 * 40)  # 2.0: the longer reply loses its lead
    assert short.reward == pytest.approx(1.0 + 2.0 - 0.05 * 2)  # 2.9
    assert long.rewards["length_penalty"] == pytest.approx(-2.0)
    with pytest.raises(ConfigError, match="reward.length_penalty applies to a learned reward"):
        load_config(overrides=["reward.length_penalty=0.1"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _serving(app):
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the reward server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def reward_model():
    tok = load_tokenizer("tiny:llama")
    rm = new_reward_model("tiny:llama", pad_id=tok.pad_token_id)
    with torch.no_grad():
        rm.head.weight.copy_(torch.randn(rm.head.weight.shape, generator=torch.Generator().manual_seed(0)))
    return rm, tok


def _rl_cfg(tmp_path, url: str, steps: int):
    return load_config(
        None,
        [
            "model.spec=tiny:llama",
            "engine.num_kv_blocks=256",
            "engine.max_new_tokens=8",
            "envs.domains=[{name: math, difficulties: [0]}]",
            "batch.prompts_per_step=1",
            "batch.samples_per_prompt=2",
            f"orchestrator.steps={steps}",
            "curriculum.probe_every=0",
            "telemetry.progress=false",
            "telemetry.tensorboard=false",
            f"telemetry.run_dir={tmp_path}",
            f"reward.url={url}",
            "reward.verifier_weight=0.5",
            "reward.model_weight=2.0",
            "reward.batch_size=1",
        ],
    )


def test_two_step_rl_run_against_a_live_reward_server(tmp_path, reward_model):
    rm, tok = reward_model
    seqs = [[1, 5, 6, 7, 2], [1, 9, 2], [3, 4, 5, 6, 7, 8, 9]]
    with _serving(make_reward_app(rm, tok, max_batch=2)) as url:
        client = RemoteRewardScorer(url, batch_size=2)
        assert client.health()["tokenizer"] == tokenizer_fingerprint(tok)
        assert asyncio.run(client.score(seqs)) == pytest.approx(rm.score(seqs), rel=1e-5)  # 2 requests
        import httpx

        too_many = httpx.post(f"{url}/score", json={"token_ids": seqs})
        assert too_many.status_code == 413 and "at most 2" in too_many.json()["error"]
        bad = httpx.post(f"{url}/score", json={"token_ids": [[1, -4]]})
        assert bad.status_code == 400 and "token_ids[0]" in bad.json()["error"]

        run = RLRun(_rl_cfg(tmp_path, url, 2), RunDir.create(tmp_path, "rl"))
        scored: list[Trajectory] = []
        try:
            run.build()
            reward = run.reward
            assert reward is not None

            class Recording:
                async def apply(self, trajectories):
                    await reward.apply(trajectories)
                    scored.extend(trajectories)

            run.reward = Recording()
            summary = run.train()
        finally:
            run.close()
    assert summary["step"] == 2
    assert len(scored) == 4 and all(t.status is TrajectoryStatus.OK for t in scored)
    for t in scored:  # the server's score of the trajectory's own token ids, mixed with the verifier's
        assert t.rewards["reward_model"] == pytest.approx(rm.score([t.token_ids])[0], abs=1e-5)
        assert t.reward == pytest.approx(0.5 * t.rewards["verifier"] + 2.0 * t.rewards["reward_model"])
    rows = read_metrics(tmp_path / "rl" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r, ts in zip(rows, (scored[:2], scored[2:]), strict=True):
        assert r["reward/reward_model"] == pytest.approx(
            sum(t.rewards["reward_model"] for t in ts) / 2, abs=1e-5
        )
        assert r["reward/verifier"] == pytest.approx(sum(t.rewards["verifier"] for t in ts) / 2)
        assert "reward_component/math/verifier" in r and "reward_component/math/reward_model" in r
        assert r["rollout/reward_errors"] == 0.0 and "train/loss" in r


def test_a_failing_reward_server_is_an_infrastructure_failure(tmp_path, reward_model):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    _, tok = reward_model
    broken = FastAPI()

    @broken.get("/health")
    async def health():
        return {"status": "ok", "tokenizer": tokenizer_fingerprint(tok)}

    @broken.post("/score")
    async def score():
        return JSONResponse({"error": "out of memory"}, status_code=500)

    with _serving(broken) as url:
        results = asyncio.run(RemoteRewardScorer(url, batch_size=2).score([[1, 2], [3, 4], [5, 6]]))
        assert all(isinstance(r, RewardModelError) and "answered 500" in str(r) for r in results)
        run = RLRun(_rl_cfg(tmp_path, url, 1), RunDir.create(tmp_path, "rl"))
        try:
            # every episode of the step failed: the run stops (exit 1 from the CLI) and says why
            with pytest.raises(
                AllEpisodesFailed, match="step 1: all 2 episodes were infrastructure failures"
            ):
                run.train()
        finally:
            run.close()
    row = read_metrics(tmp_path / "rl" / "metrics.jsonl")[0]
    assert row["rollout/reward_errors"] == 2.0 and row["counters/infra_failures"] == 2.0
    assert "train/loss" not in row  # nothing was trained on, nothing scored 0
    # nothing listening: a connection error per request, also an infrastructure failure
    dead = asyncio.run(RemoteRewardScorer(f"http://127.0.0.1:{_free_port()}", timeout_s=2).score([[1, 2]]))
    assert isinstance(dead[0], RewardModelError)
    with pytest.raises(RewardModelError, match="no reward server answers"):
        make_learned_reward(
            load_config(None, [f"reward.url=http://127.0.0.1:{_free_port()}", "reward.timeout_s=2"]).reward,
            tok,
        )


def test_local_reward_model_from_a_run_dir_checks_the_tokenizer(tmp_path, reward_model):
    rm, tok = reward_model
    rm.save(tmp_path / "run" / "reward_model", tok)
    cfg = load_config(None, [f"reward.model={tmp_path / 'run'}", "reward.batch_size=2"]).reward
    learned = make_learned_reward(cfg, tok)
    trajs = [_traj(1.0), _traj(0.0), _traj(0.5)]
    asyncio.run(learned.apply(trajs))
    assert [t.rewards["reward_model"] for t in trajs] == pytest.approx(rm.score([[1, 2, 3]] * 3), rel=1e-5)
    assert make_learned_reward(load_config(None, []).reward, tok) is None
    with pytest.raises(RewardModelError, match="neither a reward model folder"):
        make_learned_reward(load_config(None, [f"reward.model={tmp_path}"]).reward, tok)
