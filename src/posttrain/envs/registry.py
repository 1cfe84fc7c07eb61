"""The domain registry: `@register_env(name)` on a `Domain` class, `get_domain(name, **options)`,
`list_domains()`.

Built-in domains are imported lazily on first lookup so that listing them stays cheap; owns nothing
about any one domain.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import Any

from posttrain.envs.base import Domain

_REGISTRY: dict[str, type[Domain]] = {}

# Built-in domain name -> module that registers it on import.
_BUILTIN: dict[str, str] = {
    "math": "posttrain.envs.domains.math",
    "code.unit_tests": "posttrain.envs.domains.code",
    "code.humaneval": "posttrain.envs.domains.code",
    "tools.apis": "posttrain.envs.domains.tools_apis",
    "swe.ci_fix": "posttrain.envs.domains.swe_ci_fix",
}


class UnknownDomainError(KeyError):
    """A domain name that is not registered; the message lists the valid names."""

    def __str__(self) -> str:  # KeyError's str() would add quotes around the message
        return str(self.args[0])


def register_env(name: str) -> Callable[[type[Domain]], type[Domain]]:
    """Class decorator: register a `Domain` subclass under `name` (sets `cls.name`)."""

    def deco(cls: type[Domain]) -> type[Domain]:
        if not (isinstance(cls, type) and issubclass(cls, Domain)):
            raise TypeError(f"@register_env({name!r}) must decorate a Domain subclass, got {cls!r}")
        existing = _REGISTRY.get(name)
        if existing is not None and existing.__qualname__ != cls.__qualname__:
            raise ValueError(f"domain '{name}' is already registered by {existing.__module__}.{existing.__qualname__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def list_domains() -> list[str]:
    """All domain names: the built-ins and anything registered since."""
    return sorted(set(_BUILTIN) | set(_REGISTRY))


def domain_class(name: str) -> type[Domain]:
    if name not in _REGISTRY and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])
    if name not in _REGISTRY:
        valid = list_domains()
        close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise UnknownDomainError(f"unknown domain '{name}'{hint} (valid domains: {', '.join(valid)})")
    return _REGISTRY[name]


def get_domain(name: str, **options: Any) -> Domain:
    """Instantiate the domain `name` with its options (e.g. `get_domain("math", datasets=["gcd"])`)."""
    cls = domain_class(name)
    try:
        return cls(**options)
    except TypeError as err:
        raise ValueError(f"bad options for domain '{name}': {err}") from None
