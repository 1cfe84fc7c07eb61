"""Collects groups of episodes concurrently: every episode is an asyncio task, so while some wait
for the sandbox the engine keeps batching the others' generation. Seeds are derived per sample so
the same tasks and seed give the same trajectories whatever the completion order. Each `Pick` becomes
one `Group` here, the only place a step's groups are made.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from posttrain.rollout.agent import EpisodeLimits, GroupPrefill, run_episode
from posttrain.types import Group, Pick, Trajectory, TrajectoryStatus

if TYPE_CHECKING:
    from posttrain.engine import Engine, SamplingParams
    from posttrain.rollout.reward_model import LearnedReward


@dataclass
class RolloutBatch:
    """The groups of one `collect_groups` call, in the order of its picks."""

    groups: list[Group]
    wall_s: float
    policy_version: int

    @property
    def trajectories(self) -> list[Trajectory]:
        """Every group's members, group by group (infrastructure failures included)."""
        return [t for g in self.groups for t in g.members]


def sample_seed(run_seed: int, step: int, group: int, sample: int) -> int:
    """A stable per-sample seed (fits in 63 bits)."""
    return (run_seed * 1_000_003 + step * 10_007 + group * 101 + sample) % (2**62)


async def collect_groups(
    engine: Engine,
    tokenizer: Any,
    picks: list[Pick],
    group_size: int,
    sandbox: Any,
    sampling: SamplingParams,
    limits: EpisodeLimits,
    policy_version: int,
    run_seed: int,
    step: int,
    group_offset: int = 0,
    share_prefill: bool = False,
    reward: LearnedReward | None = None,
) -> RolloutBatch:
    """Run `group_size` episodes of each pick's task in its domain concurrently, one `Group` per pick
    (group ids from `group_offset` on); with `share_prefill` (for
    engines with a prefix cache: pass `engine.caches_prefixes`) each group's prompt is prefilled once
    (`GroupPrefill`). With a learned `reward`, the finished trajectories are scored by it too."""
    t0 = time.perf_counter()
    coros = []
    for g, pick in enumerate(picks):
        gid = group_offset + g
        gate = GroupPrefill() if share_prefill and group_size > 1 else None
        for s in range(group_size):
            params = replace(sampling, seed=sample_seed(run_seed, step, gid, s))
            coros.append(
                run_episode(
                    engine,
                    tokenizer,
                    pick.domain,
                    pick.task,
                    sandbox,
                    params,
                    limits,
                    policy_version,
                    group_id=gid,
                    prefill_gate=gate,
                )
            )
    trajectories = list(await asyncio.gather(*coros))
    if reward is not None:
        await reward.apply(trajectories)
    wall = time.perf_counter() - t0
    groups = [
        Group(p.task, p.arm, p.prompt, group_offset + g, trajectories[g * group_size : (g + 1) * group_size])
        for g, p in enumerate(picks)
    ]
    return RolloutBatch(groups, wall, policy_version)


def rollout_stats(trajectories: list[Trajectory], wall_s: float) -> dict[str, float]:
    n = max(len(trajectories), 1)
    generated = sum(t.num_generated for t in trajectories)
    gen_s = sum(t.timings.get("generate_s", 0.0) for t in trajectories)
    env_s = sum(t.timings.get("env_s", 0.0) for t in trajectories)
    out = {
        "rollout/episodes": float(len(trajectories)),
        "rollout/generated_tokens": float(generated),
        "rollout/tokens_per_s": generated / wall_s if wall_s > 0 else 0.0,
        "rollout/mean_turns": sum(t.turns for t in trajectories) / n,
        "rollout/mean_response_tokens": generated / n,
        "rollout/max_response_tokens": float(max((t.num_generated for t in trajectories), default=0)),
        "rollout/infra_failures": float(sum(t.status.is_infra_failure for t in trajectories)),
        "rollout/reward_errors": float(sum(t.status is TrajectoryStatus.REWARD_ERROR for t in trajectories)),
        "rollout/reward_fn_errors": float(
            sum(t.status is TrajectoryStatus.REWARD_FN_ERROR for t in trajectories)
        ),
        # cut short: out of turns or episode tokens, or the last completion stopped at its token limit
        # (a single-turn episode whose answer is cut is still `done`, so its status alone says OK)
        "rollout/truncated": float(
            sum(t.status is TrajectoryStatus.TRUNCATED or t.clipped for t in trajectories)
        ),
        **clipped_ratios(trajectories),
        # episode-seconds spent awaiting the engine / the environment; their sum over the wall time
        # says how much generation and environment work overlapped across episodes
        "timeline/episode_generate_s": gen_s,
        "timeline/episode_env_s": env_s,
    }
    return out


def clipped_ratios(trajectories: list[Trajectory]) -> dict[str, float]:
    """`rollout/clipped_ratio`: the share of episodes whose last completion stopped at its token limit
    (engine.max_new_tokens, or what was left of envs.max_episode_tokens) rather than on a stop token, over
    every episode of the step; `rollout/clipped_ratio/<domain>` the same per domain (verl's
    `response_length/clip_ratio`, TRL's `completions/clipped_ratio`)."""
    if not trajectories:
        return {"rollout/clipped_ratio": 0.0}
    out = {"rollout/clipped_ratio": sum(t.clipped for t in trajectories) / len(trajectories)}
    by_domain: dict[str, list[bool]] = {}
    for t in trajectories:
        by_domain.setdefault(t.task.domain, []).append(t.clipped)
    for domain, clipped in sorted(by_domain.items()):
        out[f"rollout/clipped_ratio/{domain}"] = sum(clipped) / len(clipped)
    return out
