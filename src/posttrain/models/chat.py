"""Chat formatting through the tokenizer's chat template, with tools.

Where a template renders tools itself (it references `tools`), they are passed through. SmolLM2's
template does not, so tools are described in the system message in the SmolLM2 function-calling
form (`<tools>[...]</tools>`, calls as `<tool_call>[{"name":..,"arguments":..}]</tool_call>`).
Parsing the model's calls belongs to `posttrain.envs.parsers`, not here.
"""

from __future__ import annotations

import json
from typing import Any

from posttrain.types import Message, ToolSpec

SMOLLM2_TOOLS_PREAMBLE = (
    "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
    "If none of the functions can be used, point it out and answer in plain text.\n\n"
    "You have access to the following tools:\n<tools>{tools}</tools>\n\n"
    "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
    "<tool_call>[\n"
    '{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},\n'
    "... (more tool calls as required)\n"
    "]</tool_call>"
)


def template_supports_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template


def _message_dicts(messages: list[Message | dict]) -> list[dict]:
    out = []
    for m in messages:
        if isinstance(m, Message):
            d: dict[str, Any] = {"role": m.role, "content": m.text}  # images as their descriptions
            if m.tool_calls:
                calls = [{"name": c.name, "arguments": c.arguments} for c in m.tool_calls]
                if not d["content"]:
                    d["content"] = f"<tool_call>{json.dumps(calls)}</tool_call>"
            out.append(d)
        else:
            out.append(dict(m))
    return out


def render_messages(
    tokenizer: Any,
    messages: list[Message | dict],
    tools: list[ToolSpec] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """Render a conversation (and tools) to the prompt string the model sees."""
    dicts = _message_dicts(messages)
    kwargs: dict[str, Any] = {}
    if tools:
        if template_supports_tools(tokenizer):
            kwargs["tools"] = [t.to_openai() for t in tools]
        else:
            preamble = SMOLLM2_TOOLS_PREAMBLE.format(
                tools=json.dumps([t.to_openai()["function"] for t in tools])
            )
            if dicts and dicts[0]["role"] == "system":
                dicts[0] = {**dicts[0], "content": dicts[0]["content"] + "\n\n" + preamble}
            else:
                dicts.insert(0, {"role": "system", "content": preamble})
    return tokenizer.apply_chat_template(
        dicts, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )


def encode_messages(
    tokenizer: Any,
    messages: list[Message | dict],
    tools: list[ToolSpec] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    text = render_messages(tokenizer, messages, tools, add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)
