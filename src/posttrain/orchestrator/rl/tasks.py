"""Where a run's tasks come from: the curriculum sampler picks arms, the task cursors pick prompts within
them, and a step's rollouts are collected with dynamic sampling (drop uninformative groups, refill,
bounded). Also holds, in async mode, the sampler feedback the rollout thread has not delivered yet.
Does not generate (the rollout layer does) nor decide the domain mix (the curriculum does)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from posttrain.rollout import RolloutBatch, rollout_stats
from posttrain.types import Trajectory

if TYPE_CHECKING:
    from posttrain.config import RunConfig
    from posttrain.curriculum import Arm, Sampler
    from posttrain.envs import Domain
    from posttrain.types import Task

# (arm, domain, task, prompt index): one group to roll out
Pick = tuple["Arm", "Domain", "Task", int]
# (arm, prompt index, the group's rewards, its generated tokens): what the sampler is told of one group
GroupFeedback = tuple["Arm", int, list[float], int]
# copies of the sampler's state, the task cursors and the prompts seen, as a checkpoint stores them
SamplerView = tuple[dict[str, Any], dict[str, int], dict[str, list[int]]]


class TaskSource:
    """The sampler, the task cursors and the held-back sampler feedback, behind one lock.

    In async mode the rollout thread picks from the sampler and moves the cursors while the learner
    thread checkpoints them, so every access goes through `lock` (reentrant: `feed_unfed` holds it
    around `feed`)."""

    def __init__(self, sampler: Sampler, domains: dict[str, Domain], arms: list[Arm], seed: int) -> None:
        self.sampler = sampler
        self.domains = domains
        self.arms = arms
        self.seed = seed
        self.cursors: dict[str, int] = {}
        self.seen_prompts: dict[str, list[int]] = {}
        self.lock = threading.RLock()
        # async mode: groups of batches the learner has trained on that the sampler has not been fed yet (it
        # is fed batch j just before it picks batch j + max_staleness + 1); saved in checkpoints
        self.unfed: dict[int, list[GroupFeedback]] = {}
        # async mode: the sampler and task cursors as the rollout thread left them before picking the batch of a
        # periodic checkpoint's step (it may have picked on since); what a checkpoint writes instead of the live ones
        self.checkpoint_view: SamplerView | None = None

    def pick(self, n: int, progress: float) -> list[Pick]:
        """n groups: the sampler picks arms (at schedule position `progress`), then a prompt within each arm
        among the next two unseen ones and the last eight seen."""
        out = []
        with self.lock:
            self.sampler.set_progress(progress)
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
                task = domain.task("train", arm.difficulty, chosen, seed=self.seed)
                out.append((arm, domain, task, chosen))
        return out

    def feed(self, groups: list[GroupFeedback], step: int) -> None:
        """Tell the sampler the rewards of batch `step`'s groups (every group, dropped ones included)."""
        by_arm: dict[Any, list[list[float]]] = {}
        tokens: dict[Any, int] = {}
        with self.lock:
            for arm, prompt_id, rewards, generated in groups:
                by_arm.setdefault(arm, []).append(rewards)
                tokens[arm] = tokens.get(arm, 0) + generated
                self.sampler.record_prompt(arm, str(prompt_id), rewards)
            for arm, group_rewards in by_arm.items():
                # the groups' generated tokens let a cost-aware sampler split tokens rather than groups
                self.sampler.update(step, arm, group_rewards, tokens=tokens[arm] or None)

    def hold(self, step: int, groups: list[GroupFeedback]) -> None:
        """Async mode: keep batch `step`'s feedback until the learner has trained on it."""
        with self.lock:
            self.unfed[step] = groups

    def feed_unfed(self, before: int) -> None:
        """Async mode: feed the sampler the held-back batches j < before, in order."""
        with self.lock:
            for j in sorted(j for j in self.unfed if j < before):
                self.feed(self.unfed.pop(j), j)

    def view(self) -> SamplerView:
        """Copies of the sampler's state and the task cursors (the caller holds the lock)."""
        return (
            self.sampler.state_dict(),
            dict(self.cursors),
            {k: list(v) for k, v in self.seen_prompts.items()},
        )

    def signals(self) -> dict[str, float]:
        """The sampler's signals (weights, learnability, forgetting) as floats, for the metrics row."""
        with self.lock:
            return {k: float(v) for k, v in self.sampler.signals().items()}


Rollout = Callable[[list[Pick], int, int], RolloutBatch]  # (picks, step, group offset) -> batch


def collect_step(
    cfg: RunConfig, tasks: TaskSource, rollout: Rollout, step: int, progress: float
) -> tuple[list[Trajectory], list[GroupFeedback], dict[str, float]]:
    """Rollouts for one step: (trajectories to train on, feedback for the sampler, stats).

    With dynamic sampling (algorithm.dynamic_sampling, or a sampler that filters groups: dapo_filter_only)
    groups whose rewards are all equal are dropped and refilled, for at most algorithm.max_resample_rounds
    more rounds. A group that infrastructure failures left with one member (no baseline) is dropped and
    counted, unless the advantage estimator needs no group. Groups of two or more scored members whose
    rewards are all equal (zero advantage under a group baseline) are counted with their generated tokens,
    kept or dropped."""
    from posttrain.algos import uses_group_baseline

    filtering = cfg.algorithm.dynamic_sampling or tasks.sampler.filters_groups
    lone_ok = not uses_group_baseline(cfg.algorithm.advantage)
    want = cfg.batch.prompts_per_step
    kept: list[Trajectory] = []
    groups_for_sampler: list[GroupFeedback] = []
    every: list[Trajectory] = []
    wall = 0.0
    offset = 0
    rounds = cfg.algorithm.max_resample_rounds if filtering else 0
    dropped = total_groups = singletons = zero_groups = zero_tokens = 0
    for round_ in range(rounds + 1):
        picks = tasks.pick(want if round_ == 0 else want - len({t.group_id for t in kept}), progress)
        batch = rollout(picks, step, offset)
        first_gid = offset
        offset += len(picks)
        wall += batch.wall_s
        every.extend(batch.trajectories)
        by_group: dict[int, list[Trajectory]] = {}
        for t in batch.trajectories:
            if t.status.is_infra_failure:  # counted by rollout_stats; the run adds them to its counters
                continue
            by_group.setdefault(t.group_id, []).append(t)
        for gi, (arm, _, _, index) in enumerate(picks):
            members = by_group.get(first_gid + gi, [])
            if not members:
                continue
            rewards = [t.reward for t in members]
            groups_for_sampler.append((arm, index, rewards, sum(t.num_generated for t in members)))
            total_groups += 1
            if len(members) == 1 < cfg.batch.samples_per_prompt and not lone_ok:
                singletons += 1  # its advantage would be its raw score: no group to compare with
                continue
            if len(members) > 1 and len(set(rewards)) == 1:  # every member's group advantage is 0
                zero_groups += 1
                zero_tokens += sum(t.num_generated for t in members)
            if filtering and len(set(rewards)) == 1:
                dropped += 1
                continue
            kept.extend(members)
        if not filtering or len({t.group_id for t in kept}) >= want:
            break
    stats = rollout_stats(every, wall)
    if filtering and not kept:
        # every group was uninformative: train on nothing rather than on noise, but say so
        stats["rollout/empty_after_filter"] = 1.0
    stats["rollout/wall_s"] = wall
    stats["rollout/dropped_group_frac"] = dropped / total_groups if total_groups else 0.0
    stats["rollout/dropped_groups"] = float(dropped)
    stats["rollout/dropped_singleton_groups"] = float(singletons)
    stats["rollout/zero_advantage_groups"] = float(zero_groups)  # all rewards equal, refills included
    stats["rollout/zero_advantage_tokens"] = float(zero_tokens)
    return kept, groups_for_sampler, stats
