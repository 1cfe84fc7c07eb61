"""The agent loop: engine + environment + sandbox -> token-exact trajectories with loss masks and
behaviour logprobs. Does not compute losses."""

from posttrain.rollout.agent import EpisodeLimits, GlueRenderer, GroupPrefill, run_episode
from posttrain.rollout.collector import RolloutBatch, collect_groups, rollout_stats, sample_seed

__all__ = [
    "EpisodeLimits",
    "GlueRenderer",
    "GroupPrefill",
    "RolloutBatch",
    "collect_groups",
    "rollout_stats",
    "run_episode",
    "sample_seed",
]
