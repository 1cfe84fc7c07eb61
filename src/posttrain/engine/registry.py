"""The engine registry: `@register_engine(name)` on a builder `(engine_cfg, model, tokenizer, *, seed) ->
Engine`, `engine_builder(name)` and `list_engines()`. The built-in backends register on import of their
module, which happens on first lookup, so the optional vLLM backend is never imported unless asked for.
Owns names and lookup; what each backend is built from is the backend module's."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import Any

from posttrain.engine.types import Engine

EngineBuilder = Callable[..., Engine]  # (engine_cfg: EngineConfig, model, tokenizer, *, seed: int) -> Engine

_REGISTRY: dict[str, EngineBuilder] = {}

# Built-in backend name -> module that registers it on import.
_BUILTIN: dict[str, str] = {
    "paged": "posttrain.engine.paged",
    "hf": "posttrain.engine.hf",
    "vllm": "posttrain.engine.vllm_backend",
}


class UnknownEngineError(ValueError):
    """An engine backend name that is not registered; the message lists the registered names."""


def register_engine(name: str) -> Callable[[EngineBuilder], EngineBuilder]:
    """Decorator: register an engine builder under `name` (`engine.backend` in the config)."""

    def deco(builder: EngineBuilder) -> EngineBuilder:
        if not callable(builder):
            raise TypeError(f"@register_engine({name!r}) must decorate a callable, got {builder!r}")
        existing = _REGISTRY.get(name)
        # the same function again (its module re-imported) replaces itself; another one is a clash
        if existing is not None and existing.__qualname__ != builder.__qualname__:
            raise ValueError(
                f"engine '{name}' is already registered by {existing.__module__}.{existing.__qualname__}"
            )
        _REGISTRY[name] = builder
        return builder

    return deco


def list_engines() -> list[str]:
    """Every engine backend name: the built-ins (imported or not) and anything registered since."""
    return sorted(set(_BUILTIN) | set(_REGISTRY))


def engine_builder(name: str) -> EngineBuilder:
    """The builder registered as `name`, importing a built-in backend's module on first use."""
    if name not in _REGISTRY and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])
    if name not in _REGISTRY:
        names = list_engines()
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise UnknownEngineError(f"unknown engine backend '{name}'{hint} (registered: {', '.join(names)})")
    return _REGISTRY[name]


def refuse_paged_only(backend: str, engine_cfg: Any) -> None:
    """Raise for engine keys only the paged engine runs, set on another backend (never ignore them)."""
    unsupported = engine_cfg.paged_only_settings()
    if unsupported:
        raise ValueError(
            f"engine.backend={backend} does not run {', '.join(unsupported)}: those are the paged engine's "
            "(engine.backend=paged); leave them at their defaults"
        )
