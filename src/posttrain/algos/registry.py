"""Name -> function registries for advantage estimators, policy losses and preference losses.

Adding an algorithm is adding a decorated function; the Learner looks functions up by the names in
`AlgorithmConfig`. This module holds no math and no state beyond the name tables.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

ADVANTAGES: dict[str, Callable[..., Any]] = {}
POLICY_LOSSES: dict[str, Callable[..., Any]] = {}
GROUP_BASELINE: set[str] = set()  # estimators whose baseline is the rest of the sequence's group
NEEDS_VALUES: set[str] = set()  # estimators that take a value function's estimates (a critic)
PREFERENCE_LOSSES: dict[str, Callable[..., Any]] = {}
REFERENCE_FREE: set[str] = set()  # preference losses that take no reference model (SimPO)
# the `dpo` config section's fields each preference loss reads, as {keyword: field}
PREFERENCE_KNOBS: dict[str, dict[str, str]] = {}


def _register(table: dict[str, Callable[..., Any]], kind: str, name: str) -> Callable[[F], F]:
    def decorator(fn: F) -> F:
        if name in table and table[name] is not fn:
            raise ValueError(f"{kind} '{name}' is already registered (by {table[name].__qualname__})")
        table[name] = fn
        return fn

    return decorator


def _get(table: dict[str, Callable[..., Any]], kind: str, name: str) -> Callable[..., Any]:
    try:
        return table[name]
    except KeyError:
        raise KeyError(f"unknown {kind} '{name}'; registered: {', '.join(sorted(table))}") from None


def register_advantage(
    name: str, group_baseline: bool = False, needs_values: bool = False
) -> Callable[[F], F]:
    """Register an advantage estimator: `fn(token_rewards, mask, group_ids, **params) -> AdvantageOutput`.
    `group_baseline`: its baseline comes from the other members of the group, so a group of one has none.
    `needs_values`: it reads `values=` (a critic's estimates), so the Learner must keep a critic."""
    if group_baseline:
        GROUP_BASELINE.add(name)
    if needs_values:
        NEEDS_VALUES.add(name)
    return _register(ADVANTAGES, "advantage estimator", name)


def uses_group_baseline(name: str) -> bool:
    """Whether the estimator `name` compares a sequence with its group (a lone member carries no signal)."""
    get_advantage(name)
    return name in GROUP_BASELINE


def needs_values(name: str) -> bool:
    """Whether the estimator `name` needs a value function (trainer.critic other than none)."""
    get_advantage(name)
    return name in NEEDS_VALUES


def register_policy_loss(name: str) -> Callable[[F], F]:
    """Register a policy loss: `fn(logprobs, old_logprobs, advantages, mask, **params) -> PolicyLossOutput`."""
    return _register(POLICY_LOSSES, "policy loss", name)


def get_advantage(name: str) -> Callable[..., Any]:
    return _get(ADVANTAGES, "advantage estimator", name)


def get_policy_loss(name: str) -> Callable[..., Any]:
    return _get(POLICY_LOSSES, "policy loss", name)


def list_advantages() -> list[str]:
    return sorted(ADVANTAGES)


def list_policy_losses() -> list[str]:
    return sorted(POLICY_LOSSES)


def register_preference_loss(
    name: str, reference: bool = True, knobs: dict[str, str] | None = None
) -> Callable[[F], F]:
    """Register a preference loss over per-sequence logprobs of (chosen, rejected) pairs:
    `fn(policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps, *,
    chosen_tokens, rejected_tokens, **hyperparameters) -> PreferenceLossOutput`.
    `reference=False`: the loss uses no reference model (its reference arguments must be None).
    `knobs`: its hyperparameters read from the `dpo` config section, {keyword: field} (none: a plugin's
    loss runs with its own defaults)."""
    if not reference:
        REFERENCE_FREE.add(name)
    PREFERENCE_KNOBS[name] = dict(knobs or {})
    return _register(PREFERENCE_LOSSES, "preference loss", name)


def preference_knobs(name: str) -> dict[str, str]:
    """{keyword: `dpo` config field} of the registered preference loss `name`."""
    get_preference_loss(name)
    return PREFERENCE_KNOBS.get(name, {})


def get_preference_loss(name: str) -> Callable[..., Any]:
    return _get(PREFERENCE_LOSSES, "preference loss", name)


def preference_needs_reference(name: str) -> bool:
    """Whether the preference loss `name` compares the policy with a reference model."""
    get_preference_loss(name)
    return name not in REFERENCE_FREE


def list_preference_losses() -> list[str]:
    return sorted(PREFERENCE_LOSSES)
