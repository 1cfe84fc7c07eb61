"""SmolLM2's function-calling form: one `<tool_call>[{"name": .., "arguments": {..}}, ...]</tool_call>`
block holding a JSON list of calls (a single object is accepted as a one-call list)."""

from __future__ import annotations

import json
from typing import Any

from posttrain.envs.parsers.common import CLOSE, OPEN, ChatFormat, call_from_obj


class SmolLM2Format(ChatFormat):
    name = "smollm2"

    def _calls_from_block(self, raw: Any) -> list[tuple[str, dict[str, Any]]]:
        items = raw if isinstance(raw, list) else [raw]
        if not items:
            raise ValueError("empty tool-call list")
        return [call_from_obj(item) for item in items]

    def format_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        body = json.dumps([{"name": n, "arguments": a} for n, a in calls])
        return f"{OPEN}{body}{CLOSE}"


SMOLLM2 = SmolLM2Format()
