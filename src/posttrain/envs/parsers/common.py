"""Shared pieces of the tool-call parsers: the parse result, the format interface, and the
`<tool_call>...</tool_call>` block scanner both supported formats use. No format-specific rules here."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from posttrain.types import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
MAX_CALLS_PER_TURN = 16


@dataclass
class ParsedOutput:
    """`content` is the text outside tool-call markup; `errors` has one line per block that failed."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def has_markup(self) -> bool:
        return bool(self.calls or self.errors)


class ChatFormat:
    """One chat format's tool-call syntax. Subclasses implement `_calls_from_block` and `format_calls`."""

    name = ""

    def parse(self, text: str, turn: int = 0) -> ParsedOutput:
        if not isinstance(text, str):
            return ParsedOutput(content="", errors=[f"assistant output is not text ({type(text).__name__})"])
        calls: list[ToolCall] = []
        errors: list[str] = []
        for m in _BLOCK.finditer(text):
            body = m.group(1).strip()
            if not m.group(0).endswith(CLOSE):
                errors.append(f"unclosed {OPEN} block (missing {CLOSE})")
                continue
            try:
                raw = json.loads(body)
            except (json.JSONDecodeError, RecursionError) as err:
                errors.append(f"tool call is not valid JSON: {str(err)[:120]}")
                continue
            try:
                pairs = self._calls_from_block(raw)
            except ValueError as err:
                errors.append(str(err)[:300])
                continue
            for name, args in pairs:
                calls.append(ToolCall(id=f"call_{turn}_{len(calls)}", name=name, arguments=args))
        if len(calls) > MAX_CALLS_PER_TURN:
            errors.append(f"too many tool calls in one message ({len(calls)} > {MAX_CALLS_PER_TURN})")
            calls = calls[:MAX_CALLS_PER_TURN]
        stray_close = text.count(CLOSE) > text.count(OPEN)
        if stray_close:
            errors.append(f"{CLOSE} without a matching {OPEN}")
        content = _BLOCK.sub("", text).replace(CLOSE, "").strip()
        return ParsedOutput(content=content, calls=calls, errors=errors)

    def _calls_from_block(self, raw: Any) -> list[tuple[str, dict[str, Any]]]:
        raise NotImplementedError

    def format_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        raise NotImplementedError


def call_from_obj(obj: Any) -> tuple[str, dict[str, Any]]:
    """{"name": str, "arguments": dict | JSON string} -> (name, arguments), or ValueError saying why."""
    if not isinstance(obj, dict):
        raise ValueError(
            f"a tool call must be a JSON object with 'name' and 'arguments', got {type(obj).__name__}"
        )
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("a tool call needs a non-empty string 'name'")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI style: arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise ValueError(f"arguments of tool call '{name}' are a string that is not JSON") from None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ValueError(f"arguments of tool call '{name}' must be a JSON object, got {type(args).__name__}")
    return name, args
