"""The step schedules: `train_sync` (generate, then update, one step at a time) and `AsyncPipeline`, where
generation runs up to k = orchestrator.max_staleness batches ahead of the learner in a rollout thread,
with a weight hand-off that makes the run independent of which thread is faster. Owns ordering and the
threads' hand-offs; each step's work (collect, update, publish, probe, log, checkpoint) is a `StepWork`'s
(the run's), which the schedules drive and never reach past."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from posttrain.config import RunConfig
    from posttrain.orchestrator.rl.metrics import PhaseLog
    from posttrain.orchestrator.rl.tasks import Collected, SamplerView, TaskSource
    from posttrain.telemetry import MetricsLogger, Progress
    from posttrain.types import Group

# before batch b: (probe metrics, sampler signals, the sampler and cursors for a checkpoint at b, or None)
PreRow = tuple[dict[str, float], dict[str, float], "SamplerView | None"]


class StepWork(Protocol):
    """A run as its schedule drives it (`RLRun` is one). A step is: `collect_step` (batch b's groups,
    on the caller's event loop), `check_step` (the step guard: raises guard.RunFailure to stop the run),
    `update` (one learner step on them), `sync_weights` / `push_weights` (publish weights to the engine),
    `after_step` (count, probe, log, checkpoint). The schedule reads the run's progress and the task
    source, and reaches nothing else of the run."""

    cfg: RunConfig
    tasks: TaskSource
    phases: PhaseLog
    step: int  # steps done
    stop_signal: int | None  # a SIGINT/SIGTERM asked the run to stop
    stop_reason: str | None  # a guard stopped the run

    @property
    def policy_version(self) -> int: ...

    def collect_step(
        self, step: int, spent: float | None = None, loop: asyncio.AbstractEventLoop | None = None
    ) -> Collected: ...

    def check_step(self, batch: Collected) -> None: ...

    def update(self, groups: list[Group]) -> dict[str, float]: ...

    def sync_weights(self, weights: dict[str, Any]) -> float: ...

    def push_weights(self, weights: dict[str, Any], version: int | None = None) -> None: ...

    def weights(self) -> dict[str, Any]: ...

    def snapshot_weights(self) -> dict[str, Any]: ...

    def probe_if_due(self, step: int, loop: asyncio.AbstractEventLoop | None = None) -> dict[str, float]: ...

    def step_metrics(
        self,
        trajs: list[Any],
        stats: dict[str, float],
        train_metrics: dict[str, float],
        update_s: float,
        sync_s: float,
        wall_s: float,
        idle_s: float,
    ) -> dict[str, float]: ...

    def after_step(
        self,
        logger: MetricsLogger,
        progress: Progress,
        metrics: dict[str, float],
        pre: PreRow | None = None,
        *,
        probe_here: bool = True,
    ) -> None: ...

    def budget_spent(self, spent: float | None = None) -> bool: ...

    def tokens_spent(self) -> float: ...


def train_sync(run: StepWork, logger: MetricsLogger, progress: Progress) -> dict[str, float]:
    """The sync schedule: generate, feed the sampler, update, push the weights, one step at a time, until
    orchestrator.steps, a stop signal, a guard's stop or the token budget; returns the last row's metrics."""
    metrics: dict[str, float] = {}
    while (
        run.step < run.cfg.orchestrator.steps
        and run.stop_signal is None
        and run.stop_reason is None
        and not run.budget_spent()
    ):
        t_step = time.perf_counter()
        run.phases.add("generate")
        batch = run.collect_step(run.step)
        run.check_step(batch)
        run.tasks.feed(batch.feedback, run.step)
        t0 = time.perf_counter()
        train_metrics = run.update(batch.groups)
        update_s = time.perf_counter() - t0
        sync_s = run.sync_weights(run.weights())
        wall = time.perf_counter() - t_step
        stats = batch.stats
        idle = max(0.0, wall - stats.get("rollout/wall_s", 0.0) - update_s - sync_s)
        metrics = run.step_metrics(batch.trajectories, stats, train_metrics, update_s, sync_s, wall, idle)
        run.after_step(logger, progress, metrics)
    return metrics


class AsyncPipeline:
    """One async training run from `run.step` to orchestrator.steps: `AsyncPipeline(run).train(logger, progress)`.

    Batch b (counted from 0):
    - weights: with async_lag 'fixed' (the default), the learner's weights after w(b) steps, where
      w(b) = max(b - k, c) and c is the latest periodic checkpoint step (a multiple of
      checkpoint_every) at or before b, or the run's start: every batch is k steps stale once the
      pipeline is full, and the pipeline restarts at each periodic checkpoint, so a run resumed from
      one is the run that went on (one batch's generation no longer overlaps an update there). The
      run does not depend on which thread is faster. With 'latest', the newest weights published
      once the learner has done b - k steps: fresher, but which ones depends on timing. The learner
      hands weights over one snapshot at a time.
    - sampler: before it picks b, it is fed the groups of batches < w(b) ('latest': < b - k), in order
      (the learner has trained on them). The rollout thread feeds them itself, so timing cannot add
      or remove one. At a periodic checkpoint's step it also copies the sampler and the task cursors
      for the checkpoint, before it picks on.
    - probes: before b when due, with b's weights; the row of step b carries them and the sampler's
      signals after them, as in sync mode. The last row's probe runs after the thread has ended,
      with the final weights.
    - schedule and budget: read the tokens of batches < b and of the probes up to b, which the rollout
      thread counts itself; it stops before the batch at which the learner's budget check stops.
    k = 0 is the sync schedule exactly: the same weights and the same rows. With 'fixed', a run resumed
    from a periodic checkpoint is the run that went on, bit for bit; one resumed from a checkpoint
    written mid-interval (on a signal) continues, held-back sampler feedback included, but not
    bit-exactly.
    """

    def __init__(self, run: StepWork) -> None:
        o = run.cfg.orchestrator
        self.run = run
        self.k = o.max_staleness
        self.fixed = o.async_lag == "fixed"
        self.total = o.steps
        self.every = o.checkpoint_every
        self.start = run.step
        self.cond = threading.Condition()
        # everything below is shared by the two threads: read and written under `cond`
        self.done = self.start  # the steps the learner has done
        # (weights, version, steps the learner had done) on their way from the learner to the rollout thread
        self.slot: tuple[dict[str, Any], int, int] | None = None
        self.error: BaseException | None = None
        self.ended = False  # the rollout thread has returned
        self.stopping = False  # the learner stopped first (budget, signal, error): stop generating
        self.pres: dict[int, PreRow] = {}
        self.batches: dict[int, Collected] = {}
        self.running = False  # the rollout thread was started and not joined yet
        self.thread: threading.Thread | None = None

    def halted(self) -> bool:
        return self.run.stop_signal is not None or self.stopping or self.error is not None

    def weights_step(self, b: int) -> int:
        """w(b): the learner steps behind batch b's weights."""
        if not self.fixed:
            return b - self.k
        restart = max(self.start, b // self.every * self.every) if self.every else self.start
        return max(b - self.k, restart)

    def weights_ready(self, need: int, exact: bool) -> bool:
        if exact:
            return self.slot is not None and self.slot[2] == need
        return self.done >= need

    # ------------------------------------------------------------------ the rollout thread

    def produce(self) -> None:
        """The rollout thread: for each batch, take its weights, feed the sampler, probe, collect."""
        run, cond = self.run, self.cond
        loop = asyncio.new_event_loop()
        spent = run.tokens_spent()
        loaded = self.start  # the learner steps behind the engine's weights
        try:
            for b in range(self.start, self.total):
                need = self.weights_step(b)
                exact = self.fixed and need > loaded
                with cond:
                    cond.wait_for(
                        lambda need=need, exact=exact: self.halted() or self.weights_ready(need, exact)
                    )
                    if self.halted():
                        return
                    pending = self.slot if exact or not self.fixed else None
                    if pending is not None:
                        self.slot = None
                        cond.notify_all()
                if pending is not None:
                    run.push_weights(pending[0], version=pending[1])
                    loaded = pending[2]
                run.tasks.feed_unfed(before=need)
                if b > self.start:  # the row of step b; start's was logged before the run began
                    probe = run.probe_if_due(b, loop)
                    spent += probe.get("heldout/generated_tokens", 0.0)
                    signals = run.tasks.signals()
                    with run.tasks.lock:
                        view = run.tasks.view() if self.fixed and self.every and b % self.every == 0 else None
                    with cond:
                        self.pres[b] = (probe, signals, view)
                        cond.notify_all()
                if run.budget_spent(spent):  # the learner's check stops before this batch too
                    return
                batch = run.collect_step(b, spent, loop)
                run.tasks.hold(b, batch.feedback)
                spent += batch.stats.get("rollout/generated_tokens", 0.0)
                with cond:
                    self.batches[b] = batch
                    cond.notify_all()
        except BaseException as err:  # surface producer failures in the main thread
            with cond:
                self.error = err
        finally:
            loop.close()
            with cond:
                self.ended = True
                cond.notify_all()

    def finish(self, trained: int) -> None:
        """Stop and join the rollout thread; feed the sampler what the learner trained on and hand the
        engine the final weights, as the sync schedule leaves them."""
        run = self.run
        with self.cond:
            if not self.ended:
                self.stopping = True
            self.cond.notify_all()
        assert self.thread is not None
        self.thread.join()
        self.running = False
        with run.tasks.lock:
            run.tasks.feed_unfed(before=trained)
            run.tasks.unfed.clear()  # batches generated but not trained on
        if self.error is None:
            run.sync_weights(run.weights())

    # ------------------------------------------------------------------ the learner (calling) thread

    def train(self, logger: MetricsLogger, progress: Progress) -> dict[str, float]:
        """Train on the rollout thread's batches in order until orchestrator.steps, a stop signal or the
        token budget; returns the last row's metrics."""
        run, cond, total, k = self.run, self.cond, self.total, self.k
        self.running = True
        self.thread = threading.Thread(target=self.produce, name="posttrain-rollout", daemon=True)
        self.thread.start()
        metrics: dict[str, float] = {}
        try:
            while run.step < total and run.stop_signal is None and not run.budget_spent():
                t_step = time.perf_counter()
                with cond:
                    cond.wait_for(lambda: run.step in self.batches or self.halted() or self.ended)
                    if self.error is not None:
                        raise self.error
                    if run.step not in self.batches:  # stopped, or the budget ran out before this batch
                        break
                    batch = self.batches.pop(run.step)
                run.check_step(batch)
                trajs, stats = batch.trajectories, batch.stats
                waited = time.perf_counter() - t_step  # for this batch; idle adds the waits below
                idle = waited
                t0 = time.perf_counter()
                staleness = [run.policy_version - t.policy_version for t in trajs]
                train_metrics = run.update(batch.groups)
                update_s = time.perf_counter() - t0
                done = run.step + 1
                # a batch still to come is generated with these weights ('latest': may be)
                needed = (
                    any(self.weights_step(b) == done for b in range(done, min(total, done + k + 1)))
                    if self.fixed
                    else done < total
                )
                t0 = time.perf_counter()
                if self.fixed and needed:  # the rollout thread has not taken the previous snapshot yet
                    with cond:
                        cond.wait_for(lambda: self.slot is None or self.halted() or self.ended)
                idle += time.perf_counter() - t0
                t0 = time.perf_counter()
                snapshot = (
                    run.snapshot_weights() if needed else None
                )  # outside the lock: a copy of every weight
                with cond:
                    if snapshot is not None and not self.ended:
                        self.slot = (snapshot, run.policy_version, done)
                    self.done = done
                    cond.notify_all()
                run.phases.add("sync_weights")
                sync_s = time.perf_counter() - t0
                pre = None
                if done < total:  # the probe and signals of the next row, from the rollout thread
                    t0 = time.perf_counter()
                    with cond:
                        cond.wait_for(lambda done=done: done in self.pres or self.halted() or self.ended)
                        pre = self.pres.pop(done, None)
                    idle += time.perf_counter() - t0
                wall = time.perf_counter() - t_step
                metrics = run.step_metrics(trajs, stats, train_metrics, update_s, sync_s, wall, idle)
                metrics.update(
                    {
                        # the share of this batch's generation that ran while the learner was busy
                        "timeline/overlap": max(0.0, 1.0 - waited / stats["rollout/wall_s"])
                        if stats.get("rollout/wall_s")
                        else 0.0,
                        "staleness/mean": float(np.mean(staleness)) if staleness else 0.0,
                        "staleness/max": float(max(staleness)) if staleness else 0.0,
                    }
                )
                if done == total:
                    self.finish(trained=done)  # the last row probes here, with the final weights
                run.after_step(logger, progress, metrics, pre, probe_here=not self.running)
        finally:
            if self.running:
                self.finish(trained=run.step)
        return metrics
