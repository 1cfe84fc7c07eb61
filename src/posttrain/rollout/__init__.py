"""The agent loop: engine + environment + sandbox -> token-exact trajectories with loss masks and
behaviour logprobs, scored by the environment's verifier and, when configured, a learned reward model
(`reward_model`: in process or over HTTP). Does not compute losses."""

from posttrain.rollout.agent import EpisodeLimits, GlueRenderer, GroupPrefill, run_episode
from posttrain.rollout.collector import RolloutBatch, collect_groups, rollout_stats, sample_seed
from posttrain.rollout.reward_model import (
    LearnedReward,
    LocalRewardScorer,
    RemoteRewardScorer,
    RewardModelError,
    make_learned_reward,
    make_reward_app,
)

__all__ = [
    "EpisodeLimits",
    "GlueRenderer",
    "GroupPrefill",
    "LearnedReward",
    "LocalRewardScorer",
    "RemoteRewardScorer",
    "RewardModelError",
    "RolloutBatch",
    "collect_groups",
    "make_learned_reward",
    "make_reward_app",
    "rollout_stats",
    "run_episode",
    "sample_seed",
]
