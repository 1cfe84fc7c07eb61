"""Name -> function registries for advantage estimators and policy losses.

Adding an algorithm is adding a decorated function; the Learner looks functions up by the names in
`AlgorithmConfig`. This module holds no math and no state beyond the two name tables.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

ADVANTAGES: dict[str, Callable[..., Any]] = {}
POLICY_LOSSES: dict[str, Callable[..., Any]] = {}
GROUP_BASELINE: set[str] = set()  # estimators whose baseline is the rest of the sequence's group


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


def register_advantage(name: str, group_baseline: bool = False) -> Callable[[F], F]:
    """Register an advantage estimator: `fn(token_rewards, mask, group_ids, **params) -> AdvantageOutput`.
    `group_baseline`: its baseline comes from the other members of the group, so a group of one has none."""
    if group_baseline:
        GROUP_BASELINE.add(name)
    return _register(ADVANTAGES, "advantage estimator", name)


def uses_group_baseline(name: str) -> bool:
    """Whether the estimator `name` compares a sequence with its group (a lone member carries no signal)."""
    get_advantage(name)
    return name in GROUP_BASELINE


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
