"""The Hermes / Qwen form: one `<tool_call>{"name": .., "arguments": {..}}</tool_call>` block per call,
possibly several blocks in one message."""

from __future__ import annotations

import json
from typing import Any

from posttrain.envs.parsers.common import CLOSE, OPEN, ChatFormat, call_from_obj


class HermesFormat(ChatFormat):
    name = "hermes"

    def _calls_from_block(self, raw: Any) -> list[tuple[str, dict[str, Any]]]:
        if isinstance(raw, list):
            raise ValueError("hermes format takes one JSON object per <tool_call> block, got a list")
        return [call_from_obj(raw)]

    def format_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "\n".join(f"{OPEN}\n{json.dumps({'name': n, 'arguments': a})}\n{CLOSE}" for n, a in calls)


HERMES = HermesFormat()
