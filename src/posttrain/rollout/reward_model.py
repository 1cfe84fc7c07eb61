"""Learned rewards for rollouts: a reward model scores each finished trajectory's token ids, in process
(`LocalRewardScorer`), in Ray actors (`RayRewardScorer`, `reward.ray_actors`) or behind an HTTP reward
server (`make_reward_app`, served by `posttrain rm serve`; `RemoteRewardScorer`, its async batched
client), and `LearnedReward` mixes the score with the environment's verifier reward, keeping both in
`Trajectory.rewards` ("verifier", "reward_model").

A sequence the reward model cannot score (server down, timeout, bad answer) marks its trajectory
`REWARD_ERROR`, an infrastructure failure: excluded from training and counted, never scored 0. The
model and its forward are `train`'s; the scores are read on the engine's exact token ids.
"""

from __future__ import annotations

import asyncio
import math
import os
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from posttrain.algos import mix_rewards
from posttrain.sandbox.ray_pool import MAX_RESTARTS, ActorGroup
from posttrain.types import Trajectory, TrajectoryStatus


class RewardModelError(RuntimeError):
    """A reward model or server that cannot be used; the message names it and why."""


class RewardScorer(Protocol):
    """Scores token sequences; a sequence that could not be scored gets the exception that says why."""

    async def score(self, sequences: list[list[int]]) -> list[float | Exception]: ...


def _chunks(n: int, size: int) -> list[range]:
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


class LocalRewardScorer:
    """A `train.RewardModel` in this process, `batch_size` sequences per forward (in a worker thread)."""

    def __init__(self, model: Any, batch_size: int = 16) -> None:
        self.model, self.batch_size = model, batch_size
        self._lock = asyncio.Lock()

    async def score(self, sequences: list[list[int]]) -> list[float | Exception]:
        out: list[float | Exception] = [0.0] * len(sequences)
        for rows in _chunks(len(sequences), self.batch_size):
            try:
                scores = await asyncio.to_thread(self.model.score, [sequences[i] for i in rows])
                for i, s in zip(rows, scores, strict=True):
                    out[i] = s
            except Exception as err:  # noqa: BLE001 - a forward that fails is infrastructure
                for i in rows:
                    out[i] = RewardModelError(f"reward model forward failed: {type(err).__name__}: {err}")
        return out


class RewardWorker:
    """A `train.RewardModel` inside a Ray actor, loaded from `folder`, scoring with `threads` torch threads."""

    def __init__(self, folder: str, threads: int) -> None:
        import torch

        from posttrain.train import load_reward_model

        torch.set_num_threads(max(1, threads))
        self.model = load_reward_model(folder)

    def score(self, sequences: list[list[int]]) -> list[float]:
        return self.model.score(sequences)

    def pid(self) -> int:
        return os.getpid()


class RayRewardScorer:
    """`n` `RewardWorker` actors of `cpus` CPUs each (an `ActorGroup`, PACK): `batch_size` sequences per
    call, each to the actor with the fewest calls in flight. A call whose actor died is sent again, to
    another actor when there is one (Ray restarts the dead one, up to `MAX_RESTARTS` times); past that, or
    when the forward raised, its sequences fail. The actors join the Ray cluster this process is
    connected to, else the one at `ray_address`, else a local one (stopped by `close`)."""

    def __init__(
        self, folder: str, n: int, cpus: float, batch_size: int = 16, ray_address: str | None = None
    ) -> None:
        self.batch_size = batch_size
        self.group = ActorGroup(
            RewardWorker,
            (folder, math.ceil(cpus)),
            n,
            cpus,
            what="reward.ray_actors",
            strategy="PACK",
            ray_address=ray_address,
        )
        self.group.ray.get([a.pid.remote() for a in self.actors], timeout=600)
        self.in_flight = [0] * n

    @property
    def actors(self) -> list[Any]:
        return self.group.handles

    async def _call(self, batch: list[list[int]]) -> list[float]:
        from ray.exceptions import RayActorError

        failed: set[int] = set()
        for attempt in range(MAX_RESTARTS + 1):
            live = [i for i in range(len(self.actors)) if i not in failed] or list(range(len(self.actors)))
            i = min(live, key=lambda j: self.in_flight[j])
            self.in_flight[i] += 1
            try:
                return await self.actors[i].score.remote(batch)
            except RayActorError as err:
                if attempt == MAX_RESTARTS:
                    raise RewardModelError(
                        f"reward actors failed {attempt + 1} times: {type(err).__name__}: {str(err)[:300]}"
                    ) from None
                failed.add(i)
            finally:
                self.in_flight[i] -= 1
        raise AssertionError("unreachable")

    async def score(self, sequences: list[list[int]]) -> list[float | Exception]:
        out: list[float | Exception] = [0.0] * len(sequences)
        chunks = _chunks(len(sequences), self.batch_size)
        results = await asyncio.gather(
            *(self._call([sequences[i] for i in rows]) for rows in chunks), return_exceptions=True
        )
        for rows, res in zip(chunks, results, strict=True):
            for k, i in enumerate(rows):
                if isinstance(res, RewardModelError):
                    out[i] = res
                elif isinstance(res, BaseException):  # the forward raised inside the actor
                    out[i] = RewardModelError(f"reward model forward failed: {type(res).__name__}: {res}")
                else:
                    out[i] = res[k]
        return out

    def close(self) -> None:
        self.group.close()


class RemoteRewardScorer:
    """Client of a reward server (`make_reward_app`): `POST {url}/score` with `{"token_ids": [[...]]}` in
    requests of `batch_size` sequences, at most `max_concurrent` in flight, each bounded by `timeout_s`.
    A request that fails (connection, timeout, non-200, malformed reply) fails only its sequences."""

    def __init__(
        self, url: str, batch_size: int = 16, max_concurrent: int = 4, timeout_s: float = 60.0
    ) -> None:
        self.url, self.batch_size, self.timeout_s = url.rstrip("/"), batch_size, timeout_s
        self.max_concurrent = max_concurrent

    def health(self) -> dict[str, Any]:
        """The server's /health reply; raises RewardModelError when it does not answer."""
        try:
            r = httpx.get(f"{self.url}/health", timeout=self.timeout_s)
            r.raise_for_status()
            return r.json()
        except (httpx.HTTPError, ValueError) as err:
            raise RewardModelError(f"reward.url={self.url}: no reward server answers ({err})") from None

    async def _request(
        self, client: httpx.AsyncClient, gate: asyncio.Semaphore, batch: list[list[int]]
    ) -> list[float]:
        async with gate:
            r = await client.post(f"{self.url}/score", json={"token_ids": batch})
        if r.status_code != 200:
            raise RewardModelError(f"reward server {self.url} answered {r.status_code}: {r.text[:200]}")
        scores = r.json().get("scores")
        if not isinstance(scores, list) or len(scores) != len(batch):
            raise RewardModelError(
                f"reward server {self.url} sent {scores!r:.100} for {len(batch)} sequences"
            )
        values = [float(s) for s in scores]
        if not all(math.isfinite(v) for v in values):
            raise RewardModelError(f"reward server {self.url} sent a score that is not a finite number")
        return values

    async def score(self, sequences: list[list[int]]) -> list[float | Exception]:
        out: list[float | Exception] = [0.0] * len(sequences)
        chunks = _chunks(len(sequences), self.batch_size)
        gate = asyncio.Semaphore(self.max_concurrent)
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            results = await asyncio.gather(
                *(self._request(client, gate, [sequences[i] for i in rows]) for rows in chunks),
                return_exceptions=True,
            )
        for rows, res in zip(chunks, results, strict=True):
            for k, i in enumerate(rows):
                if isinstance(res, BaseException):
                    err = (
                        res
                        if isinstance(res, RewardModelError)
                        else RewardModelError(f"reward server {self.url}: {type(res).__name__}: {res}")
                    )
                    out[i] = err
                else:
                    out[i] = res[k]
        return out


@dataclass
class LearnedReward:
    """Scores trajectories with `scorer` and sets reward = verifier_weight x verifier + model_weight x score
    - length_penalty x (tokens the policy generated: the loss-mask tokens), a guard against a reward model
    that pays for length; each part is kept in `rewards`."""

    scorer: RewardScorer
    verifier_weight: float = 1.0
    model_weight: float = 1.0
    length_penalty: float = 0.0

    async def apply(self, trajectories: list[Trajectory]) -> None:
        """Score the scored trajectories in place (infrastructure failures are left as they are)."""
        todo = [t for t in trajectories if t.status.is_scored]
        if not todo:
            return
        results = await self.scorer.score([t.token_ids for t in todo])
        for t, res in zip(todo, results, strict=True):
            if isinstance(res, Exception):
                t.status = TrajectoryStatus.REWARD_ERROR
                t.info["reward_error"] = str(res)
                continue
            t.rewards["verifier"] = t.reward
            t.rewards["reward_model"] = float(res)
            t.reward = mix_rewards(t.reward, float(res), self.verifier_weight, self.model_weight)
            if self.length_penalty:
                t.rewards["length_penalty"] = -self.length_penalty * sum(t.loss_mask)
                t.reward += t.rewards["length_penalty"]


def make_learned_reward(
    reward_cfg: Any, tokenizer: Any, ray_address: str | None = None
) -> LearnedReward | None:
    """The `reward` config section's learned reward (None when it names neither a model nor a server).
    Checks that the reward model reads the policy's token ids (same tokenizer fingerprint). Reward actors
    (`reward.ray_actors`) join this process's Ray cluster, else the one at `ray_address`, else a local one."""
    from posttrain.train import tokenizer_fingerprint

    if reward_cfg.model is None and reward_cfg.url is None:
        return None
    want = tokenizer_fingerprint(tokenizer)
    scorer: RewardScorer
    if reward_cfg.url is not None:
        remote = RemoteRewardScorer(
            reward_cfg.url, reward_cfg.batch_size, reward_cfg.max_concurrent_requests, reward_cfg.timeout_s
        )
        got = remote.health().get("tokenizer")
        where = f"reward.url={reward_cfg.url}"
        scorer = remote
    else:
        from posttrain.models import load_tokenizer
        from posttrain.train import load_reward_model

        folder = reward_model_path(reward_cfg.model)
        got = tokenizer_fingerprint(load_tokenizer(str(folder)))
        where = f"reward.model={reward_cfg.model}"
    if got != want:
        raise RewardModelError(
            f"{where}: the reward model's tokenizer (fingerprint {got}) is not the policy's ({want}); it must "
            "score the policy's token ids (train it from the same model family)"
        )
    if reward_cfg.url is None and reward_cfg.ray_actors:
        scorer = RayRewardScorer(
            str(folder), reward_cfg.ray_actors, reward_cfg.ray_actor_cpus, reward_cfg.batch_size, ray_address
        )
    elif reward_cfg.url is None:
        scorer = LocalRewardScorer(load_reward_model(folder), reward_cfg.batch_size)
    return LearnedReward(
        scorer, reward_cfg.verifier_weight, reward_cfg.model_weight, reward_cfg.length_penalty
    )


def reward_model_path(path: str) -> Any:
    """The HF folder of a `posttrain rm train` run dir (its reward_model/) or `path` itself."""
    from pathlib import Path

    p = Path(path)
    for folder in (p / "reward_model", p):
        if (folder / "config.json").is_file():
            return folder
    raise RewardModelError(
        f"{path}: neither a reward model folder (config.json) nor a `posttrain rm train` run dir (reward_model/)"
    )


# ------------------------------------------------------------------------------------------------
# the reward server


def make_reward_app(model: Any, tokenizer: Any, name: str = "reward-model", max_batch: int = 256) -> Any:
    """A FastAPI app over a `train.RewardModel`: `GET /health` -> {status, model, tokenizer (fingerprint),
    max_batch}; `POST /score` {"token_ids": [[int, ...], ...]} -> {"scores": [float, ...]} (400 naming
    what is malformed, 413 over `max_batch` sequences). One forward runs at a time, in a worker thread."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    from posttrain.train import tokenizer_fingerprint

    app = FastAPI(title="posttrain reward model")
    fingerprint = tokenizer_fingerprint(tokenizer)
    vocab = len(tokenizer)
    lock = asyncio.Lock()

    def bad(code: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=code)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": name, "tokenizer": fingerprint, "max_batch": max_batch}

    async def score(request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError:
            return bad(400, 'the body must be JSON: {"token_ids": [[int, ...], ...]}')
        seqs = body.get("token_ids") if isinstance(body, dict) else None
        if not isinstance(seqs, list) or not all(isinstance(s, list) and s for s in seqs):
            return bad(400, "'token_ids' must be a list of non-empty lists of token ids")
        if len(seqs) > max_batch:
            return bad(413, f"{len(seqs)} sequences in one request; at most {max_batch}")
        for i, s in enumerate(seqs):
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in s):
                return bad(400, f"token_ids[{i}] holds a value that is not a token id in [0, {vocab})")
        async with lock:
            scores = await asyncio.to_thread(model.score, seqs)
        return {"scores": scores}

    # the annotation as the class itself: FastAPI cannot resolve the postponed string of a local import
    score.__annotations__["request"] = Request
    app.post("/score")(score)
    return app
