"""The domain registry: `@register_env(name)` on a `Domain` class, `get_domain(name, **options)`,
`list_domains()`, and plugins: `load_plugin(path_or_module)` (the CLI's `--plugin`) and the
`posttrain.domains` entry-point group of installed packages (`name = "package.module"`; the module
registers its domains on import).

Built-in and entry-point domains are imported lazily on first lookup so that listing them stays cheap;
owns nothing about any one domain.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from posttrain.envs.base import Domain

_REGISTRY: dict[str, type[Domain]] = {}

# Built-in domain name -> module that registers it on import.
_BUILTIN: dict[str, str] = {
    "math": "posttrain.envs.domains.math",
    "instruct.constraints": "posttrain.envs.domains.instruct",
    "code.unit_tests": "posttrain.envs.domains.code",
    "code.humaneval": "posttrain.envs.domains.code",
    "tools.apis": "posttrain.envs.domains.tools_apis",
    "swe.ci_fix": "posttrain.envs.domains.swe_ci_fix",
    "dataset": "posttrain.envs.domains.dataset",
    "docs.financial": "posttrain.envs.domains.docs_financial",
    "scene.layout": "posttrain.envs.domains.scene_layout",
    "cad.modeling": "posttrain.envs.domains.cad_modeling",
    "longctx.ruler": "posttrain.envs.domains.longctx_ruler",
    "longctx.hard": "posttrain.envs.domains.longctx_hard",
    "longctx.codebase": "posttrain.envs.domains.longctx_codebase",
    "vision.shapes": "posttrain.envs.domains.vision_shapes",
    "vision.views": "posttrain.envs.domains.vision_shapes",
    "vision.chart": "posttrain.envs.domains.vision_chart",
    "vision.cad_drawing": "posttrain.envs.domains.vision_cad",
}
ENTRY_POINT_GROUP = "posttrain.domains"


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
            raise ValueError(
                f"domain '{name}' is already registered by {existing.__module__}.{existing.__qualname__}"
            )
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def _entry_points() -> dict[str, str]:
    """Domain name -> module, from installed packages' `posttrain.domains` entry points."""
    from importlib.metadata import entry_points

    return {ep.name: ep.value.split(":")[0] for ep in entry_points(group=ENTRY_POINT_GROUP)}


def import_target(target: str, what: str) -> ModuleType:
    """Import a `.py` file (once per resolved path) or a module by name; errors start with `what`."""
    if not target.endswith(".py"):
        try:
            return importlib.import_module(target)
        except ImportError as err:
            raise ValueError(f"{what}: cannot import module '{target}' ({err})") from None
    file = Path(target)
    if not file.is_file():
        raise ValueError(f"{what}: no such file '{target}'")
    name = "posttrain_user_" + hashlib.sha256(str(file.resolve()).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"{what}: '{target}' cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ValueError(f"{what}: '{target}' failed on import: {type(err).__name__}: {err}") from None
    return module


def load_plugin(target: str) -> list[str]:
    """Import a plugin (a `.py` file or a module name) whose import registers domains; returns the domain
    names it added. Errors name the plugin."""
    before = set(_REGISTRY)
    import_target(target, "plugin")
    return sorted(set(_REGISTRY) - before)


def list_domains() -> list[str]:
    """All domain names: the built-ins, the installed entry points and anything registered since."""
    return sorted(set(_BUILTIN) | set(_entry_points()) | set(_REGISTRY))


def domain_class(name: str) -> type[Domain]:
    if name not in _REGISTRY and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])
    if name not in _REGISTRY:
        module = _entry_points().get(name)
        if module is not None:
            try:
                importlib.import_module(module)
            except Exception as err:
                raise ValueError(
                    f"domain '{name}': its entry point module '{module}' failed on import: "
                    f"{type(err).__name__}: {err}"
                ) from None
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
