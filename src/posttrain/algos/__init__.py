"""The math of post-training as pure tensor functions: advantages, policy/value losses, KL, importance,
the supervised NLL, preference losses (DPO, IPO, SimPO) and the reward model's Bradley-Terry loss.

Estimators, policy losses and preference losses are registered by name (`@register_advantage("grpo")`,
`@register_policy_loss("ppo_clip")`, `@register_preference_loss("dpo")`) and looked up with
`get_advantage` / `get_policy_loss` / `get_preference_loss`.
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
from posttrain.algos.preference import PreferenceLossOutput, dpo, ipo, simpo
from posttrain.algos.registry import (
    get_advantage,
    get_policy_loss,
    get_preference_loss,
    list_advantages,
    list_policy_losses,
    list_preference_losses,
    needs_values,
    preference_needs_reference,
    register_advantage,
    register_policy_loss,
    register_preference_loss,
    uses_group_baseline,
)
from posttrain.algos.reward import bradley_terry, mix_rewards, pairwise_accuracy
from posttrain.algos.supervised import masked_nll

__all__ = [
    "AGG_MODES",
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "AdvantageOutput",
    "FixedKLController",
    "KLController",
    "PolicyLossOutput",
    "PreferenceLossOutput",
    "aggregate",
    "aggregation_weights",
    "bradley_terry",
    "discounted_returns",
    "dpo",
    "entropy_from_logits",
    "get_advantage",
    "get_policy_loss",
    "get_preference_loss",
    "group_stats",
    "ipo",
    "kl_estimate",
    "list_advantages",
    "list_policy_losses",
    "list_preference_losses",
    "make_kl_controller",
    "masked_mean",
    "masked_nll",
    "masked_whiten",
    "mix_rewards",
    "mismatch_metrics",
    "needs_values",
    "pairwise_accuracy",
    "preference_needs_reference",
    "ratio_mask",
    "register_advantage",
    "register_policy_loss",
    "register_preference_loss",
    "sequence_scores",
    "simpo",
    "tis_weights",
    "uses_group_baseline",
    "value_loss",
]
