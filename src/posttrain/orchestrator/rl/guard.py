"""The step guard: what a run does about a step's episodes that could not be scored, so it never trains
on nothing in silence. Reward-function errors (the user's function raised or gave no finite number) stop
the run once more than orchestrator.max_reward_fn_errors have happened; a step whose every episode is an
infrastructure failure stops it; a step where more than orchestrator.infra_warn_share of the episodes are
infrastructure failures warns on stderr. Pure over a step's trajectories; the run owns the counts.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TextIO

from posttrain.types import Trajectory, TrajectoryStatus


class RunFailure(RuntimeError):
    """A guard stopped the run; `exit_code` is what the CLI exits with (2: the user's input is wrong,
    1: the run failed at runtime)."""

    exit_code = 1


class RewardFunctionError(RunFailure):
    """The user's reward function raised or returned no finite number: a bug of the function."""

    exit_code = 2


class AllEpisodesFailed(RunFailure):
    """Every episode of a step was an infrastructure failure: nothing to train on."""

    exit_code = 1


@dataclass(frozen=True)
class StepHealth:
    """A step's episodes (every one rolled out, refills included), its infrastructure failures and
    reward-function errors, and the first error of each kind."""

    episodes: int = 0
    infra_failures: int = 0
    first_infra_error: str = ""
    reward_fn_errors: int = 0
    first_reward_fn_error: str = ""

    @classmethod
    def of(cls, trajectories: list[Trajectory]) -> StepHealth:
        infra = [t for t in trajectories if t.status.is_infra_failure]
        user = [t for t in trajectories if t.status is TrajectoryStatus.REWARD_FN_ERROR]
        return cls(
            episodes=len(trajectories),
            infra_failures=len(infra),
            first_infra_error=_why(infra[0]) if infra else "",
            reward_fn_errors=len(user),
            first_reward_fn_error=str(user[0].info.get("reward_fn_error", "")) if user else "",
        )


def _why(traj: Trajectory) -> str:
    info = traj.info
    detail = info.get("error") or info.get("infra_error") or info.get("reward_error") or "no detail"
    return f"{traj.task.id}: {traj.status.value}: {detail}"[:400]


def check_step(
    health: StepHealth,
    step: int,
    reward_fn_errors_so_far: int,
    max_reward_fn_errors: int,
    infra_warn_share: float,
    stream: TextIO | None = None,
) -> None:
    """Judge step `step` (1-based) of a run that had `reward_fn_errors_so_far` reward-function errors
    before it: raise RewardFunctionError once the run's total passes `max_reward_fn_errors`, raise
    AllEpisodesFailed when every episode is an infrastructure failure, and write one warning line to
    `stream` (default stderr) when their share passes `infra_warn_share`."""
    total = reward_fn_errors_so_far + health.reward_fn_errors
    if health.reward_fn_errors and total > max_reward_fn_errors:
        raise RewardFunctionError(
            f"step {step}: the reward function failed on {health.reward_fn_errors} of {health.episodes} "
            f"episodes ({total} in the run, orchestrator.max_reward_fn_errors={max_reward_fn_errors}); "
            f"the first: {health.first_reward_fn_error}. Fix the function (it must return one finite "
            "number, or a dict with 'reward', per completion) and start the run again"
        )
    if health.episodes and health.infra_failures == health.episodes:
        raise AllEpisodesFailed(
            f"step {step}: all {health.episodes} episodes were infrastructure failures, nothing to train "
            f"on; the first: {health.first_infra_error}"
        )
    if health.episodes and health.infra_failures / health.episodes > infra_warn_share:
        share = health.infra_failures / health.episodes
        print(
            f"warning: step {step}: {health.infra_failures} of {health.episodes} episodes ({share:.0%}) were "
            f"infrastructure failures (not trained on); the first: {health.first_infra_error}",
            file=stream or sys.stderr,
            flush=True,
        )
