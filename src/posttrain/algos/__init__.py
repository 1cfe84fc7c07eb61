"""The math of post-training as pure tensor functions: advantages, policy/value losses, KL, importance.

Estimators and policy losses are registered by name (`@register_advantage("grpo")`,
`@register_policy_loss("ppo_clip")`) and looked up with `get_advantage` / `get_policy_loss`.
Holds no model and no training state (the adaptive KL coefficient is the one small stateful object).
"""

from posttrain.algos.advantages import (
    AdvantageOutput,
    discounted_returns,
    group_stats,
    masked_mean,
    masked_whiten,
    sequence_scores,
)
from posttrain.algos.importance import mismatch_metrics, ratio_mask, tis_weights
from posttrain.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    kl_estimate,
    make_kl_controller,
)
from posttrain.algos.losses import (
    AGG_MODES,
    PolicyLossOutput,
    aggregate,
    aggregation_weights,
    entropy_from_logits,
    value_loss,
)
from posttrain.algos.registry import (
    get_advantage,
    get_policy_loss,
    list_advantages,
    list_policy_losses,
    register_advantage,
    register_policy_loss,
    uses_group_baseline,
)

__all__ = [
    "AGG_MODES",
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "AdvantageOutput",
    "FixedKLController",
    "KLController",
    "PolicyLossOutput",
    "aggregate",
    "aggregation_weights",
    "discounted_returns",
    "entropy_from_logits",
    "get_advantage",
    "get_policy_loss",
    "group_stats",
    "kl_estimate",
    "list_advantages",
    "list_policy_losses",
    "make_kl_controller",
    "masked_mean",
    "masked_whiten",
    "mismatch_metrics",
    "ratio_mask",
    "register_advantage",
    "register_policy_loss",
    "sequence_scores",
    "tis_weights",
    "uses_group_baseline",
    "value_loss",
]
