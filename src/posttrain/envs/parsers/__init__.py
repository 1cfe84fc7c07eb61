"""Tool-call parsers, one module per chat format: the text a model writes -> content + `ToolCall`s.

`get_parser(chat_format)` returns a `ChatFormat` that both parses calls and writes them (for reference
solutions). A block that cannot be parsed is reported in `ParsedOutput.errors`, never guessed at.
"""

from __future__ import annotations

from posttrain.envs.parsers.common import ChatFormat, ParsedOutput
from posttrain.envs.parsers.hermes import HERMES
from posttrain.envs.parsers.smollm2 import SMOLLM2

_FORMATS: dict[str, ChatFormat] = {"smollm2": SMOLLM2, "hermes": HERMES, "qwen": HERMES, "qwen2": HERMES}


def get_parser(chat_format: str) -> ChatFormat:
    try:
        return _FORMATS[chat_format]
    except KeyError:
        raise ValueError(
            f"unknown chat format '{chat_format}' (valid: {', '.join(sorted(_FORMATS))})"
        ) from None


def chat_formats() -> list[str]:
    return sorted(_FORMATS)


__all__ = ["ChatFormat", "ParsedOutput", "chat_formats", "get_parser"]
