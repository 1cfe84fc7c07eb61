"""RLRun, a whole post-training run: build it (learner, engine, environments, sampler, sandbox), train it
in `sync` mode or `async` (`orchestrator.rl.schedule`, which drives the run as a `StepWork`), one step at
a time: collect, update, push weights, probe, log, checkpoint. Owns the run's lifecycle and counters;
task picking is `orchestrator.rl.tasks`'s, checkpoint contents (`RunState`) `orchestrator.rl.state`'s, and
the math belongs to `algos`/`train`. Talks to the learner through the Learner protocol."""

from __future__ import annotations

import asyncio
import random
import time
from typing import TYPE_CHECKING, Any

import numpy as np

import posttrain.orchestrator.rl.probes as probes
import posttrain.orchestrator.rl.state as state
from posttrain.config import RunConfig, save_config
from posttrain.orchestrator.checkpoint import keep_metrics_until
from posttrain.orchestrator.rl.groups import drop_stale, samples_from_groups
from posttrain.orchestrator.rl.guard import RunFailure, check_step
from posttrain.orchestrator.rl.metrics import PhaseLog, progress_figures, step_line, step_metrics
from posttrain.orchestrator.rl.replay import ReplayPool, replay_count
from posttrain.orchestrator.rl.retention import RetentionSuites
from posttrain.orchestrator.rl.schedule import AsyncPipeline, PreRow, train_sync
from posttrain.orchestrator.rl.tasks import Collected, StepFill, TaskSource
from posttrain.orchestrator.signals import stop_on_signals
from posttrain.rollout import EpisodeLimits, LearnedReward, RolloutBatch, collect_groups, make_learned_reward
from posttrain.telemetry import MetricsLogger, Progress, RunDir, WandbSink
from posttrain.telemetry.renders import save_renders
from posttrain.types import Group, Pick, Trajectory

if TYPE_CHECKING:
    from pathlib import Path

    from posttrain.curriculum import Arm, Sampler
    from posttrain.engine import Engine, SamplingParams
    from posttrain.envs import Domain


class RLRun:
    """A whole post-training run. `RLRun(cfg, run_dir).train()`; to resume, `load()` first."""

    def __init__(self, cfg: RunConfig, run_dir: RunDir, *, show_progress: bool | None = None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.show_progress = cfg.telemetry.progress if show_progress is None else show_progress
        self.step = 0
        self.counters: dict[str, float] = dict(state.COUNTERS)
        self.phases = PhaseLog()
        self.stop_signal: int | None = None  # the SIGINT/SIGTERM that asked the run to stop
        self.stop_reason: str | None = None  # a guard that stopped the run (curriculum.retention_stop)
        # drives rollouts and probes (async mode: the rollout thread passes its own to collect and probe)
        self.loop = asyncio.new_event_loop()
        self.sandbox: Any = None
        self.reward: LearnedReward | None = None  # the learned reward of cfg.reward, if any
        self.drift: Any = None  # orchestrator.rl.drift.DriftProbe when curriculum.drift_every is set
        self.retention: RetentionSuites | None = None  # curriculum.retention's suites
        self.replay: ReplayPool | None = None  # algorithm.replay_fraction's general data
        self.logger: MetricsLogger | None = None  # train()'s, while it runs
        self._built = False

    # ------------------------------------------------------------------ construction

    @staticmethod
    def check(cfg: RunConfig) -> None:
        """Cheap checks before any work: the model exists, every domain and difficulty is valid."""
        from posttrain.envs import get_domain
        from posttrain.models import resolve

        resolve(cfg.model.spec)
        if cfg.curriculum.retention and cfg.orchestrator.mode != "sync":
            raise ValueError(
                "curriculum.retention is scored between steps on the engine: it needs orchestrator.mode=sync"
            )
        RetentionSuites.check_config(cfg)
        if cfg.trainer.learner_ranks == 1 or cfg.placement.backend != "ray":  # a learner on this machine
            from posttrain.train import learner_device

            learner_device(cfg.trainer.device)
        a = cfg.algorithm
        if cfg.curriculum.retention_replay_gain > 0 and not cfg.curriculum.retention:
            raise ValueError(
                "curriculum.retention_replay_gain is set but curriculum.retention is empty: the gain reads "
                "the retention suites' deltas"
            )
        if a.kl_control == "drift" and not (cfg.curriculum.drift_every and a.kl_target and a.kl_coef > 0):
            raise ValueError(
                "algorithm.kl_control='drift' needs curriculum.drift_every > 0 (the probe it reads), "
                "algorithm.kl_target and algorithm.kl_coef > 0 (the coefficient it steers)"
            )
        sync, backend = cfg.placement.weight_sync, cfg.placement.backend
        if sync == "broadcast" and backend != "ray":
            raise ValueError(
                "placement.weight_sync='broadcast' sends to rollout engines in other processes: it needs "
                "placement.backend='ray' (the local backend takes 'in_process' or 'shared_file')"
            )
        if backend == "ray" and sync == "in_process":
            raise ValueError(
                "placement.backend='ray' runs the rollout engines in other processes: set "
                "placement.weight_sync='shared_file' or 'broadcast'"
            )
        for d in cfg.envs.domains:
            valid = get_domain(d.name, **d.options).difficulties
            bad = [lvl for lvl in d.difficulties if lvl not in valid]
            if bad:
                raise ValueError(
                    f"envs.domains: '{d.name}' has no difficulty {bad[0]}; valid levels are {valid}"
                )

    def build(self) -> None:
        """Load the model twice (learner, engine), the environments, sampler and sandbox."""
        if self._built:
            return
        self.check(self.cfg)
        from posttrain.curriculum import Arm, make_sampler
        from posttrain.engine import make_engine
        from posttrain.envs import get_domain
        from posttrain.longctx.rope import apply_rope_scaling
        from posttrain.models import load_policy, load_tokenizer
        from posttrain.train import Learner

        cfg = self.cfg
        random.seed(cfg.seed)
        np.random.seed(cfg.seed % (2**32))
        import torch

        torch.manual_seed(cfg.seed)
        self.tokenizer = load_tokenizer(cfg.model.spec)
        domains = {d.name: get_domain(d.name, **d.options) for d in cfg.envs.domains}
        arms = []
        for d in cfg.envs.domains:
            valid = domains[d.name].difficulties
            for lvl in d.difficulties:
                if lvl not in valid:
                    raise ValueError(
                        f"envs.domains: '{d.name}' has no difficulty {lvl}; valid levels are {valid}"
                    )
                arms.append(Arm(d.name, lvl))
        sampler = make_sampler(
            cfg.curriculum, arms, seed=cfg.seed, domain_weights={d.name: d.weight for d in cfg.envs.domains}
        )
        self.tasks = TaskSource(sampler, domains, arms, cfg.seed)
        if cfg.trainer.learner_ranks > 1:  # ranks in processes of their own, driven from here
            from posttrain.orchestrator.rl.learner_group import start_learner_group

            self.learner = start_learner_group(cfg)
        else:
            self.learner = Learner(cfg.model, cfg.trainer, cfg.algorithm, seed=cfg.seed, batch_cfg=cfg.batch)
        from posttrain.models.vision import ImageStore  # written on first put: text policies write none

        self.learner.attach_image_store(ImageStore(self.run_dir.path / "images"))
        engine_model = apply_rope_scaling(
            load_policy(cfg.model.spec, dtype=cfg.engine.dtype, seed=cfg.seed), cfg.model.rope_scaling
        )
        if cfg.placement.backend == "ray":
            from posttrain.orchestrator.rl.placement import RayEngines

            del engine_model  # each actor loads its own
            self.make_weight_sync()
            folder = None if self.weight_transport is None else str(self.weight_transport.dir)
            self.engine = RayEngines(cfg, folder)  # no folder: weights travel by broadcast
        else:
            self.engine: Engine = make_engine(cfg.engine, engine_model, self.tokenizer)
            self.make_weight_sync()
        self.sync_weights(self.learner.weights())
        if cfg.curriculum.drift_every:  # the reference's completions, while engine and learner hold it
            from posttrain.orchestrator.rl.drift import DriftProbe

            self.drift = DriftProbe.build(
                self.engine,
                self.tokenizer,
                self.learner,
                n_prompts=cfg.curriculum.drift_prompts,
                max_tokens=cfg.curriculum.drift_tokens,
                seed=cfg.seed,
                loop=self.loop,
            )
            self.engine.release_kv_cache()  # every step starts from a cold cache, resumed or not
        if cfg.algorithm.replay_fraction > 0 or cfg.curriculum.retention_replay_gain > 0:
            self.replay = ReplayPool.build(
                self.engine,
                self.tokenizer,
                max_tokens=cfg.algorithm.replay_tokens,
                seed=cfg.seed,
                loop=self.loop,
            )
            self.engine.release_kv_cache()
        self.sandbox = self.make_sandbox()
        self.reward = make_learned_reward(cfg.reward, self.tokenizer, ray_address=cfg.placement.ray_address)
        self.sampling = self.sampling_params(train=True)
        self.limits = EpisodeLimits(
            cfg.envs.max_turns, cfg.envs.max_episode_tokens, cfg.engine.max_new_tokens
        )
        self.retention = RetentionSuites.from_config(cfg)
        if self.retention is not None:  # the initial policy's scores, stored with the run
            tokens = self.retention.load_or_score_base(
                self.run_dir.path / "retention_base.json", *self._retention_args()
            )
            self.counters["probe_tokens"] += tokens
            self.engine.release_kv_cache()
        self._built = True

    # the task source's parts, as callers (and tests swapping the sampler) address them
    @property
    def sampler(self) -> Sampler:
        return self.tasks.sampler

    @sampler.setter
    def sampler(self, sampler: Sampler) -> None:
        self.tasks.sampler = sampler

    @property
    def arms(self) -> list[Arm]:
        return self.tasks.arms

    @arms.setter
    def arms(self, arms: list[Arm]) -> None:
        self.tasks.arms = arms

    @property
    def domains(self) -> dict[str, Domain]:
        return self.tasks.domains

    def make_sandbox(self) -> Any:
        """The run's sandbox: the config's backend with its per-job limits (a test hook). Sandbox actors
        (`sandbox.mode: ray`) join the Ray cluster of the engines, or the one at placement.ray_address."""
        from posttrain.sandbox import make_sandbox

        return make_sandbox(self.cfg.sandbox, ray_address=self.cfg.placement.ray_address)

    def sampling_params(self, train: bool) -> SamplingParams:
        """Training rollouts sample at algorithm.temperature; probes decode greedily."""
        from posttrain.engine import SamplingParams

        e = self.cfg.engine
        stop_ids = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        if train:
            # the learner divides logits by algorithm.temperature, so sampling must use the same one
            return SamplingParams(
                temperature=self.cfg.algorithm.temperature,
                top_p=e.top_p,
                top_k=e.top_k,
                max_tokens=e.max_new_tokens,
                stop_token_ids=stop_ids,
            )
        return SamplingParams(temperature=0.0, max_tokens=e.max_new_tokens, stop_token_ids=stop_ids)

    # ------------------------------------------------------------------ weights

    def snapshot_weights(self) -> dict[str, Any]:
        """A copy that later learner updates cannot change (async hand-off to the rollout thread)."""
        return {k: v.detach().clone() for k, v in self.learner.weights().items()}

    def make_weight_sync(self) -> None:
        """The transport of placement.weight_sync: in-process hands the tensors over; shared_file pushes
        them through placement.weight_sync_dir (default: a fresh folder in /dev/shm, removed at close)
        and loads them back as an engine in another process would, version-checked and verified."""
        import posttrain.orchestrator.rl.weight_sync as ws

        placement = self.cfg.placement
        self.sync_bytes = 0
        self.weight_dir_owned: str | None = None
        self.weight_transport: ws.SharedFile | None = None
        if placement.weight_sync != "shared_file":
            return
        directory = placement.weight_sync_dir
        if directory is None:
            import os
            import tempfile

            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            directory = self.weight_dir_owned = tempfile.mkdtemp(prefix="posttrain-weights-", dir=shm)
        self.weight_transport = ws.SharedFile(directory)
        self.weight_transport.reset()
        base = None
        self.weight_receiver: ws.Receiver | None = None
        if self.cfg.placement.backend == "ray":  # each engine actor reads the folder itself
            return
        if self.learner.lora:  # adapters travel alone; the receiver keeps the base weights they adapt
            base = self.learner.lora_base()
        self.weight_receiver = ws.Receiver(self.engine, base=base)

    def image_store(self) -> Any:
        """The store the learner reads trajectories' images from (None for text policies)."""
        return self.learner.image_store

    def restore_learner(self, folder: Path) -> None:
        """The learner's state as saved in a checkpoint's `folder`."""
        restore = getattr(self.learner, "restore", None)
        if callable(restore):  # a learner group: every rank reads the folder itself
            restore(folder)
        else:
            from posttrain.train.state import read_learner_state

            _, learner_state = read_learner_state(folder)
            self.learner.load_state_dict(learner_state)

    def rewind_weight_sync(self) -> None:
        """Forget pushed versions (a resume goes back to the checkpoint's, which may be older)."""
        if self.weight_transport is not None:
            self.weight_transport.reset()
            if self.weight_receiver is not None:
                self.weight_receiver.version = None
        elif self.cfg.placement.weight_sync == "broadcast":
            self.engine.rewind_weights()  # type: ignore[attr-defined]

    def sync_weights(self, weights: dict[str, Any]) -> float:
        """Load the learner's `weights` into the engine (`push_weights`); returns the seconds it took."""
        t0 = time.perf_counter()
        self.push_weights(weights)
        self.phases.add("sync_weights")
        return time.perf_counter() - t0

    def push_weights(self, weights: dict[str, Any], version: int | None = None) -> None:
        """`weights` of policy `version` (default: the learner's current ones) into the engine through the
        configured transport. Under LoRA with shared_file or broadcast, the learner's adapters travel
        instead of the merged weights when they are the learner's current ones."""
        import posttrain.orchestrator.rl.weight_sync as ws

        own = version is None
        version = self.learner.version if version is None else version
        broadcast = self.cfg.placement.weight_sync == "broadcast"
        if self.weight_transport is None and not broadcast:
            self.engine.load_weights(weights, version=version)
            self.sync_bytes = sum(t.numel() * t.element_size() for t in weights.values())
            return
        pushed = self.engine.pushed if broadcast else self.weight_transport.latest()  # type: ignore
        if pushed == version:  # the learner did not step: nothing new to send
            self.sync_bytes = 0
            return
        if own and self.learner.lora:  # adapters only (a learner group gathers them from its ranks)
            update = self.learner.lora_update(version)
        else:
            update = ws.full_update(weights, version)
        if broadcast:
            self.engine.broadcast_weights(update)  # type: ignore[attr-defined]
            self.sync_bytes = update.nbytes
            return
        self.weight_transport.push(update)
        if self.weight_receiver is None:  # engines in other processes read the push themselves
            self.engine.pull_weights(update.version)  # type: ignore[attr-defined]
        else:
            self.weight_transport.pull(self.weight_receiver)
        self.sync_bytes = update.nbytes

    # ------------------------------------------------------------------ one step

    def rollout(
        self,
        picks: list[Pick],
        step: int,
        group_offset: int,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> RolloutBatch:
        """The groups of `picks`, `batch.samples_per_prompt` episodes each, with the engine's current weights,
        scored by the learned reward of `reward.*` too when one is configured; run on `loop` (default: the
        run's own)."""
        coro = collect_groups(
            self.engine,
            self.tokenizer,
            picks,
            self.cfg.batch.samples_per_prompt,
            self.sandbox,
            self.sampling,
            self.limits,
            policy_version=self.engine.version,
            run_seed=self.cfg.seed,
            step=step,
            group_offset=group_offset,
            share_prefill=self.engine.caches_prefixes,
            reward=self.reward,
        )
        return (loop or self.loop).run_until_complete(coro)

    def collect_step(
        self, step: int, spent: float | None = None, loop: asyncio.AbstractEventLoop | None = None
    ) -> Collected:
        """Batch `step`'s groups, rolled out round by round as `tasks.StepFill` asks (dynamic sampling);
        `spent`: the tokens the schedule reads (default tokens_spent(); the async rollout thread passes its
        own count, and its own event `loop`)."""
        fill = StepFill(self.cfg, self.tasks, self.progress(step, spent))
        while (picks := fill.next_picks()) is not None:
            if loop is None:
                fill.add(self.rollout(picks, step, fill.offset))
            else:
                fill.add(self.rollout(picks, step, fill.offset, loop))
        batch = fill.result()
        t = self.cfg.telemetry
        if t.renders_every and step % t.renders_every == 0:
            save_renders(self.run_dir.renders, step, batch.trajectories, t.renders_per_step)
        return batch

    @property
    def policy_version(self) -> int:
        """The learner's policy version (its updates so far)."""
        return self.learner.version

    def weights(self) -> dict[str, Any]:
        """The learner's current weights (full, merged)."""
        return self.learner.weights()

    def check_step(self, batch: Collected) -> None:
        """The step guard on the batch of step `self.step` + 1 (orchestrator.rl.guard): raises
        guard.RewardFunctionError or guard.AllEpisodesFailed to stop the run, warns on stderr when many
        episodes were infrastructure failures."""
        o = self.cfg.orchestrator
        try:
            check_step(
                batch.health,
                self.step + 1,
                int(self.counters.get("reward_fn_errors", 0.0)),
                o.max_reward_fn_errors,
                o.infra_warn_share,
            )
        except RunFailure:
            if self.logger is not None:  # metrics.jsonl shows the step that stopped the run
                counters = dict(self.counters)
                for key in ("infra_failures", "reward_fn_errors"):
                    counters[key] += batch.stats.get(f"rollout/{key}", 0.0)
                self.logger.log(
                    self.step + 1, {**batch.stats, **{f"counters/{k}": v for k, v in counters.items()}}
                )
            raise

    def update(self, groups: list[Group]) -> dict[str, float]:
        """One learner step on the groups' members within max_staleness versions (the others are counted)."""
        current = self.learner.version
        fresh, stale = drop_stale(groups, current, self.cfg.orchestrator.max_staleness)
        self.counters["dropped_stale"] += stale
        if not fresh:
            return {}
        samples = samples_from_groups(fresh, self.image_store())
        # colocated phases: nothing generates during the update unless async rollouts run ahead
        o = self.cfg.orchestrator
        overlapped = o.mode == "async" and o.max_staleness > 0
        if o.free_kv_during_update and not overlapped:
            self.engine.release_kv_cache()
            self.phases.add("release_kv")
        if self.cfg.placement.offload_engine_weights:  # sync mode (validated): the next push restores them
            self.engine.release_weights()  # type: ignore[attr-defined]
            self.phases.add("release_weights")
        if o.offload_optimizer:
            self.learner.reload_optimizer()
            self.phases.add("reload_optimizer")
        self.phases.add("update")
        replay = None
        if self.replay is not None:
            fraction = self.replay_fraction()
            replay = self.replay.pick(replay_count(len(samples), fraction), self.step) or None
        metrics = self.learner.step(samples, current_version=current, replay=replay)
        if self.replay is not None:
            metrics["replay_fraction"] = fraction
        if o.offload_optimizer:
            self.learner.offload_optimizer()
            self.phases.add("offload_optimizer")
        return {f"train/{k}" if "/" not in k else k: float(v) for k, v in metrics.items()}

    def replay_fraction(self) -> float:
        """algorithm.replay_fraction, raised by falling retention suites (curriculum.retention_replay_gain;
        without a gain the sampler, which an async rollout thread may be updating, is not read)."""
        base, gain = self.cfg.algorithm.replay_fraction, self.cfg.curriculum.retention_replay_gain
        return self.sampler.replay_fraction(base, gain) if gain > 0 else base

    def _retention_args(self) -> tuple[Any, ...]:
        return (
            self.engine,
            self.tokenizer,
            self.sandbox,
            self.sampling_params(False),
            self.limits,
            self.loop,
        )

    def probe_if_due(self, step: int, loop: asyncio.AbstractEventLoop | None = None) -> dict[str, float]:
        """The held-out probe of `step` when the sampler wants one (`orchestrator.rl.probes`), else {}; run
        on `loop` (default: the run's own)."""
        c = self.cfg.curriculum
        return probes.probe_if_due(
            self.engine,
            self.tokenizer,
            self.tasks,
            self.sandbox,
            self.sampling_params(False),
            self.limits,
            step=step,
            probe_every=c.probe_every,
            size=c.probe_size,
            seed=self.cfg.seed,
            loop=loop or self.loop,
        )

    def step_metrics(
        self,
        trajs: list[Trajectory],
        stats: dict[str, float],
        train_metrics: dict[str, float],
        update_s: float,
        sync_s: float,
        wall_s: float,
        idle_s: float,
    ) -> dict[str, float]:
        return {
            **step_metrics(
                trajs,
                stats,
                train_metrics,
                update_s=update_s,
                sync_s=sync_s,
                wall_s=wall_s,
                idle_s=idle_s,
                policy_version=self.learner.version,
            ),
            "timeline/weight_sync_bytes": float(self.sync_bytes),
        }

    def after_step(
        self,
        logger: MetricsLogger,
        progress: Progress,
        metrics: dict[str, float],
        pre: PreRow | None = None,
        *,
        probe_here: bool = True,
    ) -> None:
        """Count, probe, log, checkpoint. The row of step s carries the probe run before batch s and the
        sampler's signals after it. `pre` = (probe metrics, signals, the sampler and cursors as they were
        then, or None) from the async rollout thread, which ran that probe; without it the probe runs here
        unless `probe_here` is False (the rollout thread still runs, so no probe is due from here)."""
        cfg = self.cfg
        self.step += 1
        # counted here, from the batch's stats, not where the batch was collected: in async mode that is the
        # rollout thread, running ahead, and the logged counters would depend on how far ahead it was
        for counter, key in (
            ("rollout_tokens", "generated_tokens"),
            ("infra_failures", "infra_failures"),
            ("reward_fn_errors", "reward_fn_errors"),
            ("dropped_groups", "dropped_groups"),
            ("dropped_singleton_groups", "dropped_singleton_groups"),
        ):
            self.counters[counter] += metrics.get(f"rollout/{key}", 0.0)
        if pre is not None:
            probe, signals, self.tasks.checkpoint_view = pre
        else:
            probe = self.probe_if_due(self.step) if probe_here else {}
            signals = self.tasks.signals()
        self.counters["probe_tokens"] += probe.get("heldout/generated_tokens", 0.0)
        metrics.update(probe)
        if self.drift is not None and self.step % cfg.curriculum.drift_every == 0:
            drift = self.drift.measure(self.learner)
            if cfg.algorithm.kl_control == "drift":  # hold the drift near algorithm.kl_target
                samples = (
                    cfg.curriculum.drift_every * cfg.batch.prompts_per_step * cfg.batch.samples_per_prompt
                )
                self.learner.kl_ctl.update(drift["drift/kl_k3"], samples)
                drift["drift/kl_coef"] = float(self.learner.kl_ctl.value)
            metrics.update(drift)
        if self.retention is not None and self.step % cfg.curriculum.retention_every == 0:
            scores, tokens = self.retention.score(*self._retention_args())
            self.counters["probe_tokens"] += tokens
            self.engine.release_kv_cache()  # the next step starts from a cold cache, as after a probe
            figures = self.retention.metrics(scores)
            metrics.update(figures)
            for key in self.retention.base or {}:  # the curriculum's forgetting term reads them
                if f"retention_delta/{key}" in figures:
                    self.sampler.record_retention(
                        key, figures[f"retention_delta/{key}"], figures[f"retention_delta/{key}_se"]
                    )
            signals = self.tasks.signals()  # with the suites heard (sync mode: nothing else moved it)
            if cfg.curriculum.retention_stop is not None:
                self.stop_reason = self.retention.fell(figures, cfg.curriculum.retention_stop)
                if self.stop_reason is not None:
                    state.keep_best_before(self.run_dir.checkpoints, self.step)
        metrics.update(signals)
        metrics.update({f"counters/{k}": v for k, v in self.counters.items()})
        logger.log(self.step, metrics)
        every = cfg.orchestrator.checkpoint_every
        last_step = self.step == cfg.orchestrator.steps or self.budget_spent()
        stopping = self.stop_signal is not None or self.stop_reason is not None
        if (every and self.step % every == 0) or last_step or stopping:
            t0 = time.perf_counter()
            self.save()
            metrics["timeline/checkpoint_s"] = time.perf_counter() - t0
        self.tasks.checkpoint_view = None
        progress.advance(
            1,
            progress_figures(metrics, list(self.domains)),
            line=step_line(self.step, cfg.orchestrator.steps, metrics),
        )

    # ------------------------------------------------------------------ checkpoint

    def run_state(self) -> state.RunState:
        """What a checkpoint of the run at this step holds beside the learner. In async mode the sampler and
        cursors are the ones the rollout thread set aside for this step when it did (`checkpoint_view`),
        and the held-back feedback is that of the batches trained on."""
        tasks = self.tasks
        with tasks.lock:  # async mode: the rollout thread may be picking
            sampler, cursors, seen = tasks.checkpoint_view or tasks.view()
            return state.RunState(
                step=self.step,
                learner_version=self.learner.version,
                engine_version=self.engine.version,
                cursors=cursors,
                seen_prompts=seen,
                counters=self.counters,
                sampler=sampler,
                sampler_pending=[(j, groups) for j, groups in sorted(tasks.unfed.items()) if j < self.step],
                python_random=state.py_random_state(),
                numpy_random=state.np_random_state(),
            )

    def save(self) -> Path:
        """Checkpoint the whole run at this step (keeping orchestrator.keep_checkpoints); returns the path."""
        path = state.save_run(
            self.run_dir.checkpoints, self.run_state(), self.learner, self.cfg.orchestrator.keep_checkpoints
        )
        self.phases.add("checkpoint")
        return path

    def load(self) -> list[str]:
        """Build the run and restore the newest valid checkpoint, so it goes on as the run that wrote it;
        returns warnings about skipped corrupt ones."""
        self.build()
        path, saved, warnings = state.latest_run_state(self.run_dir.checkpoints)
        self.restore_learner(path / state.LEARNER_DIR)
        self.restore(state.RunState.from_json(saved, self.tasks.arms))
        return warnings

    def restore(self, saved: state.RunState) -> None:
        """Take over `saved` (the learner restored already): step, cursors, counters, the sampler and the
        feedback held back from it, the RNGs; the engine gets the learner's weights; config.yaml and the
        metrics say the run goes on from here."""
        self.step = saved.step
        tasks = self.tasks
        tasks.cursors = saved.cursors
        tasks.seen_prompts = saved.seen_prompts
        self.counters = saved.counters
        tasks.sampler.load_state_dict(saved.sampler)
        for j, groups in saved.sampler_pending:  # async checkpoints: feed what was held back
            tasks.feed(groups, j)
        state.set_py_random_state(saved.python_random)
        state.set_np_random_state(saved.numpy_random)
        self.rewind_weight_sync()
        self.sync_weights(self.learner.weights())
        # the run goes on with this config (a resume may override settings): config.yaml says so
        save_config(self.cfg, self.run_dir.config)
        keep_metrics_until(self.run_dir.metrics, self.step)

    # ------------------------------------------------------------------ budget

    def progress(self, step: int, spent: float | None = None) -> float:
        """The run's spent share for the sampler's schedule: step / orchestrator.steps, or the generated
        tokens' share of orchestrator.token_budget when that is further along; capped at 1. `spent`: the
        tokens to read (default tokens_spent(); the async rollout thread passes its own count)."""
        o = self.cfg.orchestrator
        done = step / o.steps if o.steps > 0 else 0.0
        if o.token_budget:
            done = max(done, (self.tokens_spent() if spent is None else spent) / o.token_budget)
        return min(1.0, max(0.0, done))

    def tokens_spent(self) -> float:
        """Tokens generated so far, training rollouts and retention probes: what the token budget counts."""
        return self.counters["rollout_tokens"] + self.counters["probe_tokens"]

    def budget_spent(self, spent: float | None = None) -> bool:
        """True once orchestrator.token_budget is set and the generated tokens (rollouts + probes; `spent`
        if given) reach it."""
        budget = self.cfg.orchestrator.token_budget
        return budget is not None and (self.tokens_spent() if spent is None else spent) >= budget

    # ------------------------------------------------------------------ the loop

    def _wandb_sink(self) -> WandbSink | None:
        """The run's W&B sink; a resumed run continues the W&B run whose id the run dir keeps."""
        tel = self.cfg.telemetry
        if tel.wandb == "off":
            return None
        id_file = self.run_dir.path / "wandb_id"
        resume_id = id_file.read_text().strip() if id_file.is_file() else None
        sink = WandbSink(
            tel.wandb_project,
            self.run_dir.path.name,
            self.run_dir.path,
            mode=tel.wandb,
            config=self.cfg.model_dump(mode="json"),
            resume_id=resume_id,
        )
        id_file.write_text(sink.id + "\n")
        return sink

    def _record_stop(self, signum: int) -> None:
        self.stop_signal = signum

    def train(self) -> dict[str, Any]:
        """Run until `orchestrator.steps` or the token budget; returns a summary. Exits early,
        checkpointed, on SIGINT/SIGTERM."""
        self.build()
        cfg = self.cfg
        if not self.run_dir.config.exists():
            save_config(cfg, self.run_dir.config)
        logger = MetricsLogger(
            self.run_dir.metrics if cfg.telemetry.jsonl else None,
            self.run_dir.tb if cfg.telemetry.tensorboard else None,
            wandb=self._wandb_sink(),
        )
        self.logger = logger
        last: dict[str, float] = {}
        with stop_on_signals(self._record_stop):
            try:
                with Progress(
                    cfg.orchestrator.steps, "train", enabled=self.show_progress, lines=None
                ) as progress:
                    progress.set_completed(self.step)
                    if cfg.orchestrator.mode == "sync":
                        last = train_sync(self, logger, progress)
                    else:
                        last = AsyncPipeline(self).train(logger, progress)
            finally:
                logger.close()
        return {
            "step": self.step,
            "interrupted": self.stop_signal is not None,
            "signal": self.stop_signal,
            "stopped": self.stop_reason,
            "last": last,
            "budget_spent": self.budget_spent(),
            "generated_tokens": self.tokens_spent(),
        }

    def close(self) -> None:
        for role in ("engine", "learner"):  # a Ray engine set, a learner group
            close_role = getattr(getattr(self, role, None), "close", None)
            if callable(close_role):
                close_role()
        if getattr(self, "weight_dir_owned", None):
            import shutil

            shutil.rmtree(self.weight_dir_owned, ignore_errors=True)
            self.weight_dir_owned = None
        # reward actors go before the sandbox, whose pool may have started the Ray cluster they are in
        scorer = getattr(self.reward, "scorer", None)
        if callable(getattr(scorer, "close", None)):
            scorer.close()
        if self.sandbox is not None:
            self.loop.run_until_complete(self.sandbox.close())
            self.sandbox = None
        self.loop.close()
