"""The RL loop: one controller that samples tasks, collects rollout groups, updates the Learner, pushes
weights to the engine, logs, evaluates and checkpoints — in `sync` mode or `async` with bounded staleness.

It owns ordering, staleness accounting, task cursors and checkpoint/resume of the whole run; the math
belongs to `algos`/`train`, generation to `engine`, scoring to `envs`, the domain mix to `curriculum`.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from posttrain.config import RunConfig, save_config
from posttrain.orchestrator.checkpoint import latest_valid, save_checkpoint
from posttrain.rollout import EpisodeLimits, RolloutBatch, collect_groups, rollout_stats
from posttrain.telemetry import MetricsLogger, Progress, RunDir, read_metrics
from posttrain.types import Trajectory

RUN_STATE = "run_state.json"
LEARNER_DIR = "learner"


@dataclass
class PhaseLog:
    """The order in which phases ran (tested: the KV pool is freed before every update)."""

    events: list[str] = field(default_factory=list)

    def add(self, name: str) -> None:
        self.events.append(name)


class StopRequested(Exception):
    pass


class RLRun:
    """A whole post-training run. `RLRun(cfg, run_dir).train()`; `RLRun.resume(run_dir).train()`."""

    def __init__(self, cfg: RunConfig, run_dir: RunDir, *, show_progress: bool | None = None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.show_progress = cfg.telemetry.progress if show_progress is None else show_progress
        self.step = 0
        self.cursors: dict[str, int] = {}
        self.seen_prompts: dict[str, list[int]] = {}
        self.counters: dict[str, float] = {"infra_failures": 0.0, "dropped_stale": 0.0, "dropped_groups": 0.0}
        self.phases = PhaseLog()
        self._stop_signal: int | None = None
        self._loop = asyncio.new_event_loop()
        self._built = False
        self._in_async = False
        self._async_probe_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------ construction

    @staticmethod
    def check(cfg: RunConfig) -> None:
        """Cheap checks before any work: the model exists, every domain and difficulty is valid."""
        from posttrain.envs import get_domain
        from posttrain.models import resolve

        resolve(cfg.model.spec)
        if cfg.placement.backend != "local":
            raise ValueError(f"placement.backend='{cfg.placement.backend}' is not yet available; use 'local'")
        if cfg.placement.weight_sync != "in_process":
            raise ValueError(
                f"placement.weight_sync='{cfg.placement.weight_sync}' is not yet available; use 'in_process'"
            )
        for d in cfg.envs.domains:
            valid = get_domain(d.name, **d.options).difficulties
            bad = [lvl for lvl in d.difficulties if lvl not in valid]
            if bad:
                raise ValueError(f"envs.domains: '{d.name}' has no difficulty {bad[0]}; valid levels are {valid}")

    def build(self) -> None:
        """Load the model twice (learner, engine), the environments, sampler and sandbox."""
        if self._built:
            return
        self.check(self.cfg)
        from posttrain.curriculum import Arm, make_sampler
        from posttrain.engine import make_engine
        from posttrain.envs import get_domain
        from posttrain.models import load_policy, load_tokenizer
        from posttrain.train import Learner

        cfg = self.cfg
        random.seed(cfg.seed)
        np.random.seed(cfg.seed % (2**32))
        import torch

        torch.manual_seed(cfg.seed)
        self.tokenizer = load_tokenizer(cfg.model.spec)
        self.domains = {d.name: get_domain(d.name, **d.options) for d in cfg.envs.domains}
        arms = []
        for d in cfg.envs.domains:
            valid = self.domains[d.name].difficulties
            for lvl in d.difficulties:
                if lvl not in valid:
                    raise ValueError(f"envs.domains: '{d.name}' has no difficulty {lvl}; valid levels are {valid}")
                arms.append(Arm(d.name, lvl))
        self.arms = arms
        self.sampler = make_sampler(cfg.curriculum, arms, seed=cfg.seed)
        self.learner = Learner(cfg.model, cfg.trainer, cfg.algorithm, seed=cfg.seed)
        engine_model = load_policy(cfg.model.spec, dtype=cfg.engine.dtype, seed=cfg.seed)
        self.engine = make_engine(cfg.engine, engine_model, self.tokenizer)
        self._sync_weights(self.learner.weights())
        self.sandbox = self._make_sandbox()
        self.sampling = self._sampling_params(train=True)
        self.limits = EpisodeLimits(cfg.envs.max_turns, cfg.envs.max_episode_tokens, cfg.engine.max_new_tokens)
        self._built = True

    def _make_sandbox(self) -> Any:
        from posttrain.sandbox import make_sandbox

        return make_sandbox(self.cfg.sandbox)

    def _sampling_params(self, train: bool) -> Any:
        from posttrain.engine import SamplingParams

        e = self.cfg.engine
        stop_ids = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        if train:
            # the learner divides logits by algorithm.temperature, so sampling must use the same one
            return SamplingParams(
                temperature=self.cfg.algorithm.temperature, top_p=e.top_p, top_k=e.top_k, max_tokens=e.max_new_tokens, stop_token_ids=stop_ids
            )
        return SamplingParams(temperature=0.0, max_tokens=e.max_new_tokens, stop_token_ids=stop_ids)

    # ------------------------------------------------------------------ weights

    def _snapshot_weights(self) -> dict[str, Any]:
        """A copy that later learner updates cannot change (async hand-off to the rollout thread)."""
        return {k: v.detach().clone() for k, v in self.learner.weights().items()}

    def _sync_weights(self, weights: dict[str, Any]) -> float:
        t0 = time.perf_counter()
        self.engine.load_weights(weights, version=self.learner.version)
        self.phases.add("sync_weights")
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ tasks

    def _pick_tasks(self, step: int, n: int) -> list[tuple[Any, Any, Any, int]]:
        """(arm, domain, task, prompt index) for n groups: the sampler picks arms, then a prompt within each arm."""
        out = []
        for arm in self.sampler.sample(n):
            key = f"{arm.domain}:{arm.difficulty}"
            cursor = self.cursors.get(key, 0)
            seen = self.seen_prompts.get(key, [])[-8:]
            candidates = [str(cursor), str(cursor + 1)] + [str(i) for i in seen]
            chosen = int(self.sampler.choose_prompt(arm, candidates))
            if chosen >= cursor:
                self.cursors[key] = chosen + 1
                self.seen_prompts.setdefault(key, []).append(chosen)
            domain = self.domains[arm.domain]
            task = domain.task("train", arm.difficulty, chosen, seed=self.cfg.seed)
            out.append((arm, domain, task, chosen))
        return out

    def _rollout(self, picks: list[tuple[Any, Any, Any, int]], step: int, group_offset: int) -> RolloutBatch:
        coro = collect_groups(
            self.engine,
            self.tokenizer,
            [(d, t) for _, d, t, _ in picks],
            self.cfg.algorithm.group_size,
            self.sandbox,
            self.sampling,
            self.limits,
            policy_version=self.engine.version,
            run_seed=self.cfg.seed,
            step=step,
            group_offset=group_offset,
            share_prefill=self.cfg.engine.enable_prefix_caching and self.cfg.engine.backend != "hf",
        )
        return self._loop.run_until_complete(coro)

    def _collect_step(self, step: int) -> tuple[list[Trajectory], list[tuple[Any, Any, list[float]]], dict[str, float]]:
        """Rollouts for one step, with dynamic sampling (drop equal-reward groups, refill, bounded)."""
        cfg = self.cfg
        want = cfg.orchestrator.tasks_per_step
        kept: list[Trajectory] = []
        groups_for_sampler: list[tuple[Any, Any, list[float]]] = []
        every: list[Trajectory] = []
        wall = 0.0
        offset = 0
        rounds = cfg.algorithm.max_resample_rounds if cfg.algorithm.dynamic_sampling else 0
        dropped = total_groups = 0
        for round_ in range(rounds + 1):
            picks = self._pick_tasks(step, want if round_ == 0 else want - len({t.group_id for t in kept}))
            batch = self._rollout(picks, step, offset)
            first_gid = offset
            offset += len(picks)
            wall += batch.wall_s
            every.extend(batch.trajectories)
            by_group: dict[int, list[Trajectory]] = {}
            for t in batch.trajectories:
                if t.status.is_infra_failure:
                    self.counters["infra_failures"] += 1
                    continue
                by_group.setdefault(t.group_id, []).append(t)
            for gi, (arm, _, _, index) in enumerate(picks):
                members = by_group.get(first_gid + gi, [])
                if not members:
                    continue
                rewards = [t.reward for t in members]
                groups_for_sampler.append((arm, index, rewards))
                total_groups += 1
                if cfg.algorithm.dynamic_sampling and len(set(rewards)) == 1:
                    dropped += 1
                    continue
                kept.extend(members)
            if not cfg.algorithm.dynamic_sampling or len({t.group_id for t in kept}) >= want:
                break
        stats = rollout_stats(every, wall)
        if cfg.algorithm.dynamic_sampling and not kept:
            # every group was uninformative: train on nothing rather than on noise, but say so
            stats["rollout/empty_after_filter"] = 1.0
        stats["rollout/wall_s"] = wall
        stats["rollout/dropped_group_frac"] = dropped / total_groups if total_groups else 0.0
        self.counters["dropped_groups"] += dropped
        return kept, groups_for_sampler, stats

    def _feed_sampler(self, groups: list[tuple[Any, Any, list[float]]]) -> None:
        by_arm: dict[Any, list[list[float]]] = {}
        for arm, prompt_id, rewards in groups:
            by_arm.setdefault(arm, []).append(rewards)
            self.sampler.record_prompt(arm, str(prompt_id), rewards)
        for arm, group_rewards in by_arm.items():
            self.sampler.update(self.step, arm, group_rewards)

    # ------------------------------------------------------------------ one update

    def _update(self, trajectories: list[Trajectory]) -> dict[str, float]:
        from posttrain.train import Sample

        current = self.learner.version
        fresh = [t for t in trajectories if current - t.policy_version <= self.cfg.orchestrator.max_staleness]
        self.counters["dropped_stale"] += len(trajectories) - len(fresh)
        if not fresh:
            return {}
        samples = [
            Sample(
                token_ids=t.token_ids,
                loss_mask=t.loss_mask,
                behavior_logprobs=t.behavior_logprobs,
                reward=t.reward,
                group_id=t.group_id,
                policy_version=t.policy_version,
            )
            for t in fresh
        ]
        # colocated phases: nothing generates during the update unless async rollouts run ahead
        overlapped = self.cfg.orchestrator.mode == "async" and self.cfg.orchestrator.max_staleness > 0
        if self.cfg.orchestrator.free_kv_during_update and not overlapped:
            self.engine.release_kv_cache()
            self.phases.add("release_kv")
        if self.cfg.orchestrator.offload_optimizer:
            self.learner.reload_optimizer()
            self.phases.add("reload_optimizer")
        self.phases.add("update")
        metrics = self.learner.step(samples, current_version=current)
        if self.cfg.orchestrator.offload_optimizer:
            self.learner.offload_optimizer()
            self.phases.add("offload_optimizer")
        return {f"train/{k}" if "/" not in k else k: float(v) for k, v in metrics.items()}

    # ------------------------------------------------------------------ metrics

    def _reward_metrics(self, trajectories: list[Trajectory]) -> dict[str, float]:
        out: dict[str, float] = {}
        by_domain: dict[str, list[Trajectory]] = {}
        for t in trajectories:
            by_domain.setdefault(t.task.domain, []).append(t)
        all_r = [t.reward for t in trajectories]
        out["reward/mean"] = float(np.mean(all_r)) if all_r else 0.0
        for dom, ts in sorted(by_domain.items()):
            out[f"reward/{dom}"] = float(np.mean([t.reward for t in ts]))
            out[f"response_tokens/{dom}"] = float(np.mean([t.num_generated for t in ts]))
            for comp in sorted({k for t in ts for k in t.rewards}):
                out[f"reward_component/{dom}/{comp}"] = float(np.mean([t.rewards.get(comp, 0.0) for t in ts]))
        outcomes: dict[str, int] = {}
        for t in trajectories:
            for k, v in t.info.items():
                if k.startswith("sandbox_") and isinstance(v, int | float):
                    outcomes[k] = outcomes.get(k, 0) + int(v)
        for k, v in outcomes.items():
            out[f"sandbox/{k[len('sandbox_'):]}"] = float(v)
        return out

    def _step_metrics(
        self, trajs: list[Trajectory], stats: dict[str, float], train_metrics: dict[str, float],
        update_s: float, sync_s: float, wall_s: float, idle_s: float,
    ) -> dict[str, float]:
        return {
            **stats,
            **train_metrics,
            **self._reward_metrics(trajs),
            "timeline/generate_s": stats.get("rollout/wall_s", 0.0),
            "timeline/update_s": update_s,
            "timeline/weight_sync_s": sync_s,
            "timeline/step_s": wall_s,
            "timeline/idle_s": idle_s,
            "policy_version": float(self.learner.version),
        }

    # ------------------------------------------------------------------ probes (held-out)

    def _probe(self, step: int) -> dict[str, float]:
        from posttrain.orchestrator.evaluate import evaluate_engine

        n = self.cfg.curriculum.probe_size
        arms = self.sampler.probe_arms(step) or self.arms  # the sampler may skip arms its training groups measured
        results = evaluate_engine(
            self.engine, self.tokenizer, self.domains, arms, n, self.sandbox, self._sampling_params(False),
            self.limits, seed=self.cfg.seed, loop=self._loop,
        )
        out: dict[str, float] = {}
        for arm, scores in results.items():
            score = float(np.mean(scores)) if scores else 0.0
            if scores:
                self.sampler.record_probe(step, arm, score, n=len(scores))
            out[f"heldout/{arm.domain}:{arm.difficulty}"] = score
        doms: dict[str, list[float]] = {}
        for arm, scores in results.items():
            doms.setdefault(arm.domain, []).extend(scores)
        for d, s in doms.items():
            out[f"heldout/{d}"] = float(np.mean(s))
        return out

    # ------------------------------------------------------------------ checkpoint

    def save(self) -> Path:
        def write(tmp: Path) -> None:
            self.learner.save(tmp / LEARNER_DIR)
            state = {
                "step": self.step,
                "learner_version": self.learner.version,
                "engine_version": self.engine.version,
                "cursors": self.cursors,
                "seen_prompts": self.seen_prompts,
                "counters": self.counters,
                "sampler": self.sampler.state_dict(),
                "python_random": _py_random_state(),
                "numpy_random": _np_random_state(),
            }
            (tmp / RUN_STATE).write_text(json.dumps(state))

        path = save_checkpoint(self.run_dir.checkpoints, self.step, write, keep=self.cfg.orchestrator.keep_checkpoints)
        self.phases.add("checkpoint")
        return path

    def load(self) -> list[str]:
        """Restore the newest valid checkpoint; returns warnings about skipped corrupt ones."""
        self.build()
        path, warnings = latest_valid(self.run_dir.checkpoints)
        state = json.loads((path / RUN_STATE).read_text())
        from posttrain.train.state import read_learner_state

        _, learner_state = read_learner_state(path / LEARNER_DIR)
        self.learner.load_state_dict(learner_state)
        self.step = state["step"]
        self.cursors = state["cursors"]
        self.seen_prompts = {k: list(v) for k, v in state["seen_prompts"].items()}
        self.counters = state["counters"]
        self.sampler.load_state_dict(state["sampler"])
        _set_py_random_state(state["python_random"])
        _set_np_random_state(state["numpy_random"])
        self._sync_weights(self.learner.weights())
        # metrics after the checkpoint belong to the interrupted tail; the resumed run rewrites them
        if self.run_dir.metrics.exists():
            kept = [r for r in read_metrics(self.run_dir.metrics) if r.get("step", 0) <= self.step]
            self.run_dir.metrics.write_text("".join(json.dumps(r) + "\n" for r in kept))
        return warnings

    # ------------------------------------------------------------------ the loop

    def _install_signals(self) -> dict[int, Any]:
        previous = {}
        if threading.current_thread() is not threading.main_thread():
            return previous

        def handler(signum: int, frame: Any) -> None:
            self._stop_signal = signum

        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, handler)
        return previous

    def train(self) -> dict[str, Any]:
        """Run until `orchestrator.steps`; returns a summary. Exits early, checkpointed, on SIGINT/SIGTERM."""
        self.build()
        cfg = self.cfg
        if not self.run_dir.config.exists():
            save_config(cfg, self.run_dir.config)
        logger = MetricsLogger(
            self.run_dir.metrics if cfg.telemetry.jsonl else None, self.run_dir.tb if cfg.telemetry.tensorboard else None
        )
        previous = self._install_signals()
        last: dict[str, float] = {}
        try:
            with Progress(cfg.orchestrator.steps, "train", enabled=self.show_progress) as progress:
                progress.set_completed(self.step)
                if cfg.orchestrator.mode == "sync":
                    last = self._train_sync(logger, progress)
                else:
                    last = self._train_async(logger, progress)
        finally:
            logger.close()
            for sig, h in previous.items():
                signal.signal(sig, h)
        interrupted = self._stop_signal is not None
        return {"step": self.step, "interrupted": interrupted, "signal": self._stop_signal, "last": last}

    def _after_step(self, logger: MetricsLogger, progress: Progress, metrics: dict[str, float]) -> None:
        cfg = self.cfg
        self.step += 1
        metrics.update(self._async_probe_metrics)
        self._async_probe_metrics = {}
        if cfg.curriculum.probe_every and self.sampler.probe_due(self.step) and not self._in_async:
            t0 = time.perf_counter()
            metrics.update(self._probe(self.step))
            # cached prefix KV from the probe would make the next step's numerics depend on whether the
            # run was resumed here (a resumed engine starts cold); start every step from a cold cache
            self.engine.release_kv_cache()
            metrics["timeline/probe_s"] = time.perf_counter() - t0
        metrics.update({k: float(v) for k, v in self.sampler.signals().items()})
        metrics.update({f"counters/{k}": v for k, v in self.counters.items()})
        logger.log(self.step, metrics)
        every = cfg.orchestrator.checkpoint_every
        if (every and self.step % every == 0) or self.step == cfg.orchestrator.steps or self._stop_signal is not None:
            t0 = time.perf_counter()
            self.save()
            metrics["timeline/checkpoint_s"] = time.perf_counter() - t0
        figures = {"reward": metrics.get("reward/mean", 0.0)}
        for d in self.domains:
            if f"reward/{d}" in metrics:
                figures[d] = metrics[f"reward/{d}"]
        if "train/kl" in metrics:
            figures["kl"] = metrics["train/kl"]
        figures["tok/s"] = metrics.get("rollout/tokens_per_s", 0.0)
        progress.advance(1, figures)

    def _train_sync(self, logger: MetricsLogger, progress: Progress) -> dict[str, float]:
        metrics: dict[str, float] = {}
        while self.step < self.cfg.orchestrator.steps and self._stop_signal is None:
            t_step = time.perf_counter()
            self.phases.add("generate")
            trajs, groups, stats = self._collect_step(self.step)
            self._feed_sampler(groups)
            t0 = time.perf_counter()
            train_metrics = self._update(trajs)
            update_s = time.perf_counter() - t0
            sync_s = self._sync_weights(self.learner.weights())
            wall = time.perf_counter() - t_step
            idle = max(0.0, wall - stats.get("rollout/wall_s", 0.0) - update_s - sync_s)
            metrics = self._step_metrics(trajs, stats, train_metrics, update_s, sync_s, wall, idle)
            self._after_step(logger, progress, metrics)
        return metrics

    def _train_async(self, logger: MetricsLogger, progress: Progress) -> dict[str, float]:
        """Generation of step b may start once the learner has done b - k updates (k = max_staleness).

        Rollouts run in a producer thread (its own event loop); weights published by the learner
        are loaded into the engine by the producer between batches, so a batch has one policy
        version. k = 0 is the sync schedule exactly.
        """
        k = self.cfg.orchestrator.max_staleness
        total = self.cfg.orchestrator.steps
        cond = threading.Condition()
        state: dict[str, Any] = {"updates_done": self.step, "weights": None, "error": None}
        batches: dict[int, tuple[list[Trajectory], list, dict[str, float]]] = {}
        sampler_lock = threading.Lock()

        def producer() -> None:
            loop = asyncio.new_event_loop()
            try:
                for b in range(self.step, total):
                    with cond:
                        cond.wait_for(
                            lambda b=b: state["updates_done"] >= b - k or self._stop_signal is not None or state["error"]
                        )
                        if self._stop_signal is not None or state["error"]:
                            return
                        pending, state["weights"] = state["weights"], None
                    if pending is not None:
                        weights, version = pending
                        self.engine.load_weights(weights, version=version)
                    old_loop, self._loop = self._loop, loop
                    try:
                        with sampler_lock:
                            # in async mode probes run here, on the engine's own thread, between batches
                            if b > 0 and self.cfg.curriculum.probe_every and self.sampler.probe_due(b):
                                t0 = time.perf_counter()
                                probe = self._probe(b)
                                self.engine.release_kv_cache()
                                probe["timeline/probe_s"] = time.perf_counter() - t0
                                self._async_probe_metrics.update(probe)
                            result = self._collect_step(b)
                    finally:
                        self._loop = old_loop
                    with cond:
                        batches[b] = result
                        cond.notify_all()
            except BaseException as err:  # surface producer failures in the main thread
                with cond:
                    state["error"] = err
                    cond.notify_all()
            finally:
                loop.close()

        self._in_async = True
        thread = threading.Thread(target=producer, name="posttrain-rollout", daemon=True)
        thread.start()
        metrics: dict[str, float] = {}
        try:
            while self.step < total and self._stop_signal is None:
                t_step = time.perf_counter()
                with cond:
                    cond.wait_for(lambda: self.step in batches or state["error"] is not None or self._stop_signal is not None)
                    if state["error"] is not None:
                        raise state["error"]
                    if self._stop_signal is not None and self.step not in batches:
                        break
                    trajs, groups, stats = batches.pop(self.step)
                idle = time.perf_counter() - t_step
                with sampler_lock:
                    self._feed_sampler(groups)
                t0 = time.perf_counter()
                staleness = [self.learner.version - t.policy_version for t in trajs]
                train_metrics = self._update(trajs)
                update_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                snapshot = self._snapshot_weights()
                with cond:
                    state["weights"] = (snapshot, self.learner.version + 0)
                    state["updates_done"] += 1
                    cond.notify_all()
                self.phases.add("sync_weights")
                sync_s = time.perf_counter() - t0
                wall = time.perf_counter() - t_step
                metrics = self._step_metrics(trajs, stats, train_metrics, update_s, sync_s, wall, idle)
                metrics.update(
                    {
                        # the share of this batch's generation that ran while the learner was busy
                        "timeline/overlap": max(0.0, 1.0 - idle / stats["rollout/wall_s"]) if stats.get("rollout/wall_s") else 0.0,
                        "staleness/mean": float(np.mean(staleness)) if staleness else 0.0,
                        "staleness/max": float(max(staleness)) if staleness else 0.0,
                    }
                )
                with sampler_lock:
                    self._after_step(logger, progress, metrics)
        finally:
            with cond:
                if self._stop_signal is None and self.step < total:
                    self._stop_signal = -1
                cond.notify_all()
            thread.join()
            self._in_async = False
            if self._stop_signal == -1:
                self._stop_signal = None
        return metrics

    def close(self) -> None:
        if getattr(self, "sandbox", None) is not None:
            self._loop.run_until_complete(self.sandbox.close())
            self.sandbox = None
        self._loop.close()


def _py_random_state() -> list:
    v, state, gauss = random.getstate()
    return [v, list(state), gauss]


def _set_py_random_state(s: list) -> None:
    random.setstate((s[0], tuple(s[1]), s[2]))


def _np_random_state() -> list:
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)]


def _set_np_random_state(s: list) -> None:
    np.random.set_state((s[0], np.array(s[1], dtype=np.uint32), s[2], s[3], s[4]))
