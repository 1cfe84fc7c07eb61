"""Tools an environment exposes: an OpenAI-style `ToolSpec` bound to a Python function, argument
validation against the JSON Schema, typed tool errors, and dispatch of parsed calls to tool messages.

An invalid call becomes an observation explaining the error (so the model can correct itself) and is
counted; nothing here raises on model output. Domains own the tool functions themselves.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema

from posttrain.types import Message, ToolCall, ToolSpec

MAX_TOOL_RESULT_CHARS = 4000


class ToolError(Exception):
    """A typed, expected tool failure (what a real API returns as an error body), e.g.
    `ToolError("not_found", "no customer with id 'c9'")`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class InfraError(Exception):
    """The execution backend (sandbox) failed: the episode is an infrastructure failure, not a score."""


def validate_arguments(spec: ToolSpec, arguments: Any) -> list[str]:
    """Errors (empty if valid) of `arguments` against the tool's JSON Schema, one readable line each."""
    if not isinstance(arguments, dict):
        return [f"arguments must be a JSON object, got {type(arguments).__name__}"]
    validator = jsonschema.Draft202012Validator(spec.parameters)
    out = []
    for err in sorted(validator.iter_errors(arguments), key=lambda e: list(e.absolute_path)):
        where = ".".join(str(p) for p in err.absolute_path)
        out.append(f"{where}: {err.message}" if where else err.message)
    return out


def check_schema(spec: ToolSpec) -> None:
    """Raise if a tool's `parameters` is not a valid JSON Schema object schema (a programming error)."""
    jsonschema.Draft202012Validator.check_schema(spec.parameters)
    if spec.parameters.get("type") != "object":
        raise ValueError(f"tool '{spec.name}': parameters must be an object schema")


@dataclass
class Tool:
    """A tool: its public spec and the function that runs it (sync or async, keyword arguments)."""

    spec: ToolSpec
    fn: Callable[..., Any]

    @property
    def name(self) -> str:
        return self.spec.name


def _render(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    if len(text) > MAX_TOOL_RESULT_CHARS:
        text = text[:MAX_TOOL_RESULT_CHARS] + f"... [truncated {len(text) - MAX_TOOL_RESULT_CHARS} chars]"
    return text


@dataclass
class CallOutcome:
    message: Message
    ok: bool
    invalid: bool  # unknown tool or arguments failing the schema
    tool_error: bool  # the tool ran and returned a typed error
    call: ToolCall
    internal_error: bool = False  # the tool function itself raised: a bug in the domain, counted in info


async def execute_call(tools: dict[str, Tool], call: ToolCall) -> CallOutcome:
    """Validate and run one call; the outcome's message is the role "tool" observation.

    `InfraError` from the tool propagates (the caller marks the episode as an infrastructure failure).
    """

    def reply(
        content: Any, ok: bool, invalid: bool = False, tool_error: bool = False, internal: bool = False
    ) -> CallOutcome:
        msg = Message(role="tool", content=_render(content), tool_call_id=call.id, name=call.name)
        return CallOutcome(msg, ok, invalid, tool_error, call, internal)

    tool = tools.get(call.name)
    if tool is None:
        return reply(
            {
                "error": "unknown_tool",
                "message": f"no tool named '{call.name}'",
                "valid_tools": sorted(tools),
            },
            ok=False,
            invalid=True,
        )
    errors = validate_arguments(tool.spec, call.arguments)
    if errors:
        return reply(
            {"error": "invalid_arguments", "tool": call.name, "details": errors[:5]}, ok=False, invalid=True
        )
    try:
        result = tool.fn(**call.arguments)
        if inspect.isawaitable(result):
            result = await result
    except ToolError as err:
        return reply({"error": err.code, "message": err.message}, ok=False, tool_error=True)
    except InfraError:
        raise
    except Exception as err:  # noqa: BLE001 - model output must never crash an episode; counted in info
        return reply(
            {"error": "internal_error", "message": f"{type(err).__name__}: {str(err)[:200]}"},
            ok=False,
            tool_error=True,
            internal=True,
        )
    return reply(result, ok=True)


def tool_specs(tools: dict[str, Tool]) -> list[ToolSpec]:
    return [t.spec for t in tools.values()]


def fn_schema(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """A closed object schema (no extra properties), the shape every tool here uses."""
    return {
        "type": "object",
        "properties": properties,
        "required": required or [],
        "additionalProperties": False,
    }
