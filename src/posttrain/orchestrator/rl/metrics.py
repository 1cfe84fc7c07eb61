"""What one step of a run reports: reward and sandbox figures per domain, the step's timeline, the
progress bar's figures and the plain line printed when stdout is not a terminal, and the order in which the run's phases ran. Pure functions over trajectories
and dicts; logging them is telemetry's job."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from posttrain.types import Trajectory


@dataclass
class PhaseLog:
    """The order in which phases ran (tested: the KV pool is freed before every update)."""

    events: list[str] = field(default_factory=list)

    def add(self, name: str) -> None:
        self.events.append(name)


def reward_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Mean reward overall and per domain, response lengths and reward components per domain, and the
    sandbox outcomes the episodes counted."""
    out: dict[str, float] = {}
    by_domain: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        by_domain.setdefault(t.task.domain, []).append(t)
    all_r = [t.reward for t in trajectories]
    out["reward/mean"] = float(np.mean(all_r)) if all_r else 0.0
    successes = [t.rewards["success"] for t in trajectories if "success" in t.rewards]
    if successes:  # the strict criterion, over the episodes whose domain reports it
        out["success/mean"] = float(np.mean(successes))
    for comp in ("verifier", "reward_model", "length_penalty"):  # a learned reward's parts, side by side
        vals = [t.rewards[comp] for t in trajectories if comp in t.rewards]
        if vals:
            out[f"reward/{comp}"] = float(np.mean(vals))
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
        out[f"sandbox/{k[len('sandbox_') :]}"] = float(v)
    return out


def step_metrics(
    trajs: list[Trajectory],
    stats: dict[str, float],
    train_metrics: dict[str, float],
    *,
    update_s: float,
    sync_s: float,
    wall_s: float,
    idle_s: float,
    policy_version: int,
) -> dict[str, float]:
    """One step's row: rollout stats, learner metrics, rewards and the timeline."""
    return {
        **stats,
        **train_metrics,
        **reward_metrics(trajs),
        "timeline/generate_s": stats.get("rollout/wall_s", 0.0),
        "timeline/update_s": update_s,
        "timeline/weight_sync_s": sync_s,
        "timeline/step_s": wall_s,
        "timeline/idle_s": idle_s,
        "policy_version": float(policy_version),
    }


def progress_figures(metrics: dict[str, float], domains: list[str]) -> dict[str, float]:
    """What the progress bar shows after a step: mean reward, reward per domain, KL, generated tok/s."""
    figures = {"reward": metrics.get("reward/mean", 0.0)}
    for d in domains:
        if f"reward/{d}" in metrics:
            figures[d] = metrics[f"reward/{d}"]
    if "train/kl" in metrics:
        figures["kl"] = metrics["train/kl"]
    figures["tok/s"] = metrics.get("rollout/tokens_per_s", 0.0)
    return figures


def step_line(step: int, total: int, metrics: dict[str, float]) -> str:
    """One plain line per step for logs (stdout not a terminal: nohup, SLURM, `| tee`): the step, mean
    reward, strict success, clipped ratio, generated tokens and the step's seconds."""
    success = metrics.get("success/mean")
    return (
        f"step {step}/{total}  reward {metrics.get('reward/mean', 0.0):.4g}  "
        f"success {'-' if success is None else f'{success:.3g}'}  "
        f"clipped {metrics.get('rollout/clipped_ratio', 0.0):.3g}  "
        f"tokens {metrics.get('rollout/generated_tokens', 0.0):.0f}  "
        f"{metrics.get('timeline/step_s', 0.0):.1f}s"
    )
