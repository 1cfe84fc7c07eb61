"""Where a run's tasks come from: the curriculum sampler picks arms, the task cursors pick prompts within
them, and a step's groups are gathered with dynamic sampling (`StepFill`: drop uninformative groups,
refill, bounded), told the rollouts its caller ran. Also holds, in async mode, the sampler feedback the
rollout thread has not delivered yet. Does not generate (the rollout layer does) nor decide the domain
mix (the curriculum does)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from posttrain.curriculum import GroupFeedback
from posttrain.orchestrator.rl.guard import StepHealth
from posttrain.rollout import RolloutBatch, rollout_stats
from posttrain.types import Group, Pick, Trajectory

if TYPE_CHECKING:
    from posttrain.config import RunConfig
    from posttrain.curriculum import Arm, Sampler
    from posttrain.envs import Domain

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
                out.append(Pick(arm, domain, task, chosen))
        return out

    def feed(self, groups: list[GroupFeedback], step: int) -> None:
        """Tell the sampler the rewards of batch `step`'s groups (every group, dropped ones included; a
        feedback may come as a plain (arm, prompt, rewards, tokens) tuple)."""
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


@dataclass
class Collected:
    """A step's gathered groups: `groups` to train on (in pick order, refills after), `feedback` for the
    sampler (every group with a scored member, dropped ones included), the rollout `stats`, and the
    `health` of every episode rolled out (what the step guard judges)."""

    groups: list[Group]
    feedback: list[GroupFeedback]
    stats: dict[str, float]
    health: StepHealth = field(default_factory=StepHealth)

    @property
    def trajectories(self) -> list[Trajectory]:
        """The scored members of the groups to train on, group by group."""
        return [t for g in self.groups for t in g.scored]


class StepFill:
    """One step's groups with dynamic sampling; the caller runs the rollouts:

        fill = StepFill(cfg, tasks, progress)
        while (picks := fill.next_picks()) is not None:
            fill.add(rollout(picks, step, fill.offset))
        collected = fill.result()

    With dynamic sampling (algorithm.dynamic_sampling, or a sampler that filters groups: dapo_filter_only)
    groups whose rewards are all equal are dropped and refilled, for at most algorithm.max_resample_rounds
    more rounds. A group that infrastructure failures left with one member (no baseline) is dropped and
    counted, unless the advantage estimator needs no group. Groups of two or more scored members whose
    rewards are all equal (zero advantage under a group baseline) are counted with their generated tokens,
    kept or dropped."""

    def __init__(self, cfg: RunConfig, tasks: TaskSource, progress: float) -> None:
        from posttrain.algos import uses_group_baseline

        self.tasks = tasks
        self.progress = progress
        self.filtering = cfg.algorithm.dynamic_sampling or tasks.sampler.filters_groups
        self.lone_ok = not uses_group_baseline(cfg.algorithm.advantage)
        self.group_size = cfg.batch.samples_per_prompt
        self.want = cfg.batch.prompts_per_step
        self.rounds_left = (cfg.algorithm.max_resample_rounds if self.filtering else 0) + 1
        self.offset = 0  # the group id of the next round's first group
        self.kept: list[Group] = []
        self.feedback: list[GroupFeedback] = []
        self.every: list[Trajectory] = []
        self.wall = 0.0
        self.dropped = self.total_groups = self.singletons = self.zero_groups = self.zero_tokens = 0
        self.done = False

    def next_picks(self) -> list[Pick] | None:
        """The next round's picks (the first round: batch.prompts_per_step; refills: what is missing), or
        None when the step has its groups or its rounds are spent."""
        if self.done or self.rounds_left == 0:
            return None
        self.rounds_left -= 1
        return self.tasks.pick(self.want - len(self.kept), self.progress)

    def add(self, batch: RolloutBatch) -> None:
        """Sort one round's groups: fed to the sampler, counted, kept or dropped."""
        self.offset += len(batch.groups)
        self.wall += batch.wall_s
        self.every.extend(batch.trajectories)
        for group in batch.groups:
            members = group.scored  # failures are counted by rollout_stats, judged by the step guard
            if not members:
                continue
            feedback = GroupFeedback.of(group)
            self.feedback.append(feedback)
            self.total_groups += 1
            if len(members) == 1 < self.group_size and not self.lone_ok:
                self.singletons += 1  # its advantage would be its raw score: no group to compare with
                continue
            all_equal = len(set(feedback.rewards)) == 1
            if len(members) > 1 and all_equal:  # every member's group advantage is 0
                self.zero_groups += 1
                self.zero_tokens += feedback.generated_tokens
            if self.filtering and all_equal:
                self.dropped += 1
                continue
            self.kept.append(group)
        self.done = not self.filtering or len(self.kept) >= self.want

    def result(self) -> Collected:
        """The kept groups, the sampler's feedback and the step's rollout stats."""
        stats = rollout_stats(self.every, self.wall)
        if self.filtering and not self.kept:
            # every group was uninformative: train on nothing rather than on noise, but say so
            stats["rollout/empty_after_filter"] = 1.0
        stats["rollout/wall_s"] = self.wall
        stats["rollout/dropped_group_frac"] = self.dropped / self.total_groups if self.total_groups else 0.0
        stats["rollout/dropped_groups"] = float(self.dropped)
        stats["rollout/dropped_singleton_groups"] = float(self.singletons)
        stats["rollout/zero_advantage_groups"] = float(
            self.zero_groups
        )  # all rewards equal, refills included
        stats["rollout/zero_advantage_tokens"] = float(self.zero_tokens)
        return Collected(self.kept, self.feedback, stats, StepHealth.of(self.every))
