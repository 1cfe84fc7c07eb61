"""The config tree described key by key: dotted key, type (with its bounds), default and description,
read from the pydantic fields of config.py. `posttrain config show --describe` prints it and the docs
site's config reference is generated from it, so neither can drift from the code. Holds no defaults."""

from __future__ import annotations

import inspect
import json
import types
import typing
from dataclasses import dataclass
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from posttrain.config import RunConfig


@dataclass(frozen=True)
class KeyDoc:
    """One key of the config tree. `section` keys hold other keys (their description is the section's
    docstring, its line breaks kept); `key` is dotted, with `[]` for the items of a list of sections (`envs.domains[].name`)."""

    key: str
    type: str
    default: str
    description: str
    section: bool = False


_BOUNDS = (
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.Le, "le", "<="),
)


def type_name(annotation: Any) -> str:
    """A readable type: `int`, `float | None`, `"sync" | "async"`, `list[str]`, `list[DomainConfig]`."""
    if annotation is type(None):
        return "None"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_name(a) for a in args)}]"
    if annotation is typing.Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _bounds(field: FieldInfo) -> str:
    parts = []
    for meta in field.metadata:
        for kind, attr, sign in _BOUNDS:
            if isinstance(meta, kind):
                parts.append(f"{sign} {getattr(meta, attr)}")
    return ", ".join(parts)


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def render_value(value: Any) -> str:
    """A value as it would be written on the command line (`--set key=VALUE`): JSON for everything but
    plain strings, which stay bare."""
    if isinstance(value, str):
        return value
    return json.dumps(_plain(value))


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        return render_value(field.default_factory())  # type: ignore[call-arg]
    return render_value(field.default)


def _section_model(annotation: Any) -> tuple[type[BaseModel] | None, str]:
    """(the section class, the suffix its keys take) when `annotation` holds a section: the class itself,
    `list[Class]` (whose items' keys read `key[].item`), or either in a union (`Class | None`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list and len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0], "[]"
    if origin in (typing.Union, types.UnionType):
        found = [m for m in map(_section_model, args) if m[0] is not None]
        if len(found) == 1:
            return found[0]
    return None, ""


def _doc(model: type[BaseModel]) -> str:
    """A section's docstring, dedented, its line breaks kept (some hold a table)."""
    return inspect.cleandoc(model.__doc__ or "")


def describe(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[KeyDoc]:
    """Every key under `model`, depth first in declaration order: a section's entry, then its keys."""
    out: list[KeyDoc] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        sub, suffix = _section_model(field.annotation)
        kind = type_name(field.annotation)
        bounds = _bounds(field)
        if bounds:
            kind = f"{kind} ({bounds})"
        if sub is None:
            out.append(KeyDoc(key, kind, _default(field), " ".join((field.description or "").split())))
            continue
        description = " ".join((field.description or "").split()) or _doc(sub)
        default = "" if not suffix and field.annotation is sub else _default(field)
        out.append(KeyDoc(key, kind, default, description, section=True))
        out.extend(describe(sub, f"{key}{suffix}."))
    return out


def lookup(cfg: BaseModel, key: str) -> tuple[bool, Any]:
    """(found, value) of a dotted key in a config; keys under a list (`a[].b`) or an unset optional
    section are not found."""
    value: Any = cfg
    for part in key.split("."):
        if part.endswith("[]") or not isinstance(value, BaseModel):
            return False, None
        value = getattr(value, part)
    return True, value


def describe_text(cfg: RunConfig | None = None) -> str:
    """The plain-text listing of `config show --describe`: one block per key, `key: type = default` then
    the description indented, a blank line before each top-level section; with a config, a key whose
    value differs from its default shows both."""
    lines = []
    for doc in describe():
        if doc.section and "." not in doc.key and lines:
            lines.append("")
        head = f"{doc.key}: {doc.type}" + (f" = {doc.default}" if doc.default else "")
        if cfg is not None and not doc.section:
            found, value = lookup(cfg, doc.key)
            if found and render_value(value) != doc.default:
                head = f"{doc.key}: {doc.type} = {render_value(value)} (default {doc.default})"
        lines.append(head)
        lines.extend(f"    {line}".rstrip() for line in doc.description.splitlines())
    return "\n".join(lines) + "\n"
