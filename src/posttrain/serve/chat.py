"""OpenAI chat requests <-> the model's text: messages and tools rendered through the chat template
(models/chat.py), forced tool choices (named or `required`) as a prefilled call opening plus the JSON
Schema the engine's constrained decoding holds the rest of the call to, the model's reply parsed into
`tool_calls` by the environments' parsers (envs/parsers) and classified against the tools' JSON
schemas, and stop strings trimmed (also while streaming). Pure functions and one small buffer class;
no engine, no HTTP.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any

import jsonschema
from PIL import Image

from posttrain.engine.constrained import compile_schema
from posttrain.engine.types import BadRequestError
from posttrain.envs.parsers import get_parser
from posttrain.envs.parsers.common import CLOSE, MAX_CALLS_PER_TURN, OPEN, ParsedOutput
from posttrain.models import render_messages, template_supports_tools
from posttrain.models.vision import ImageInputs, image_inputs
from posttrain.serve.protocol import ChatCompletionRequest, ChatMessage, ContentPart, bad_request
from posttrain.types import ContentError, ImagePart, ToolSpec, content_part_from_dict

TOOL_OUTCOMES = ("ok", "invalid_json", "unknown_tool", "schema_violation", "none_when_required")


def chat_format_for(tokenizer: Any) -> str:
    """The tool-call syntax the model is prompted with: its template's own (Hermes/Qwen `<tool_call>{..}`)
    where it renders tools, else the SmolLM2 form models/chat.py describes in the system message."""
    return "hermes" if template_supports_tools(tokenizer) else "smollm2"


@dataclass
class ToolPlan:
    """What a request asks of tools: the specs rendered, the mode, and for a forced choice (named or
    `required`) the call opening prefilled into the prompt, the JSON Schema the completion is decoded
    under (the rest of the call), and the markup that closes the call once that JSON is complete."""

    specs: list[ToolSpec] = field(default_factory=list)
    choice: str = "none"  # none | auto | required | function
    forced_name: str | None = None
    parallel: bool = True
    prefill: str = ""
    json_schema: dict[str, Any] | None = None
    close: str = ""

    @property
    def active(self) -> bool:
        return self.choice != "none" and bool(self.specs)

    @property
    def required(self) -> bool:
        return self.choice in ("required", "function")


def plan_tools(req: ChatCompletionRequest, chat_format: str, constrained: bool = True) -> ToolPlan:
    """The request's tools as a plan (400 for an invalid schema, a duplicate name, a choice naming no
    tool). `constrained`: the engine enforces `SamplingParams.json_schema`, so a forced choice decodes
    its call under the tools' schemas; without it (an engine lacking constrained decoding) a named call
    is forced by its prefilled opening only and `required` is asked for in the tools prompt only."""
    tools = req.tools or []
    specs: list[ToolSpec] = []
    for i, t in enumerate(tools):
        schema = t.function.parameters if t.function.parameters is not None else {"type": "object"}
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as err:
            raise bad_request(
                f"tools[{i}].function.parameters is not a valid JSON schema: {err.message}",
                param=f"tools.{i}.function.parameters",
            ) from None
        specs.append(ToolSpec(t.function.name, t.function.description or "", schema))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise bad_request(f"tools hold the same function name twice: {names}", param="tools")
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if specs else "none"
    forced = None
    if not isinstance(choice, str):
        forced = choice.function.name
        if forced not in names:
            raise bad_request(
                f"tool_choice names function '{forced}', which is not in tools ({', '.join(names) or 'none given'})",
                param="tool_choice",
            )
        choice = "function"
    if choice in ("required", "function", "auto") and not specs and req.tool_choice is not None:
        raise bad_request(f"tool_choice '{choice}' needs a non-empty `tools` list", param="tool_choice")
    plan = ToolPlan(specs, choice, forced, req.parallel_tool_calls is not False)
    if plan.active and plan.required and constrained:
        force_call(plan, chat_format)
    elif forced:
        plan.prefill = _named_opening(forced, chat_format)
    return plan


def _named_opening(name: str, chat_format: str) -> str:
    """A call to `name` up to its arguments, in the model's syntax."""
    sep = "[" if chat_format == "smollm2" else "\n"
    return f'{OPEN}{sep}{{"name": {json.dumps(name)}, "arguments": '


def _call_schema(spec: ToolSpec) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": spec.name}, "arguments": spec.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def force_call(plan: ToolPlan, chat_format: str) -> None:
    """Set a forced choice's prefill, schema and close in the model's call syntax. Named: the opening
    up to `"arguments": ` is prefilled and the completion is the arguments, under the function's
    parameters schema. Required: the completion is the call itself, a choice among the tools (SmolLM2:
    a list of one or more calls, one when parallel_tool_calls is false; Hermes: one call per block, so
    one call). 400 naming the tool whose parameters constrained decoding cannot enforce."""
    for i, spec in enumerate(plan.specs):
        if plan.forced_name in (None, spec.name):
            try:
                compile_schema(spec.parameters)
            except BadRequestError as err:
                raise bad_request(
                    f"tools[{i}].function.parameters cannot be enforced on a forced tool call: {err}",
                    param=f"tools.{i}.function.parameters",
                ) from None
    smollm2 = chat_format == "smollm2"
    if plan.forced_name is not None:
        (spec,) = [s for s in plan.specs if s.name == plan.forced_name]
        plan.prefill = _named_opening(spec.name, chat_format)
        plan.json_schema = spec.parameters
        plan.close = f"}}]{CLOSE}" if smollm2 else f"}}\n{CLOSE}"
        return
    calls = [_call_schema(s) for s in plan.specs]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if smollm2:
        plan.prefill, plan.close = OPEN, CLOSE
        most = MAX_CALLS_PER_TURN if plan.parallel else 1
        plan.json_schema = {"type": "array", "items": one, "minItems": 1, "maxItems": most}
    else:
        plan.prefill, plan.close = f"{OPEN}\n", f"\n{CLOSE}"
        plan.json_schema = one


def finished_text(visible: str, plan: ToolPlan, finish: str | None) -> str:
    """A choice's whole text: a forced call whose JSON the grammar completed (it then ends with EOS,
    finish "stop") gets its closing markup; a cut one (finish "length") stays as it is."""
    return visible + plan.close if plan.json_schema is not None and finish == "stop" else visible


def _image_of(part: ContentPart, i: int, j: int) -> ImagePart:
    """A vision model's image part: a PNG data URL (or our `image` part) that decodes; 400 naming the part."""
    where = f"messages[{i}].content[{j}]"
    try:
        img = content_part_from_dict(part.model_dump(exclude_none=True), where)
    except ContentError as err:
        msg = str(err)
        raise bad_request(
            msg if msg.startswith(where) else f"{where}: {msg}",
            param=f"messages.{i}.content.{j}",
            code="invalid_image",
        ) from None
    if not isinstance(img, ImagePart):
        raise bad_request(
            f"{where} is not an image part", param=f"messages.{i}.content.{j}", code="invalid_image"
        )
    try:
        with Image.open(io.BytesIO(img.png)) as im:
            im.load()
    except (OSError, SyntaxError, ValueError) as err:
        raise bad_request(
            f"{where}: the image does not decode as a PNG ({err})",
            param=f"messages.{i}.content.{j}",
            code="invalid_image",
        ) from None
    return img


def _text_of(m: ChatMessage, i: int, vision: ImageInputs | None = None, images: list | None = None) -> str:
    """The message's text; a vision model's image parts become its placeholder runs (their images are
    appended to `images`, in order)."""
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    texts = []
    for j, part in enumerate(m.content):
        if part.type == "text" and part.text is not None:
            texts.append(part.text)
        elif part.type in ("image_url", "image") and vision is not None and images is not None:
            images.append(_image_of(part, i, j))
            texts.append(vision.placeholder(images[-1]))
        elif part.type in ("image_url", "input_image", "image"):
            raise bad_request(
                f"messages[{i}].content[{j}] is an image: the model served here is text-only; "
                "send text content parts only",
                param=f"messages.{i}.content.{j}",
                code="unsupported_content",
            )
        else:
            raise bad_request(
                f"messages[{i}].content[{j}] has type '{part.type}'; only 'text' content parts are supported",
                param=f"messages.{i}.content.{j}",
                code="unsupported_content",
            )
    return "\n".join(texts)


def message_dicts(
    messages: list[ChatMessage], tokenizer: Any, chat_format: str, images: list | None = None
) -> list[dict[str, Any]]:
    """OpenAI messages as the dicts the chat template takes; earlier assistant calls in the model's syntax.
    For a vision model (its tokenizer carries image inputs) image parts are collected into `images`."""
    native_tools = template_supports_tools(tokenizer)
    vision = image_inputs(tokenizer)
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        d: dict[str, Any] = {"role": role, "content": _text_of(m, i, vision, images)}
        if m.tool_calls:
            calls = []
            for k, c in enumerate(m.tool_calls):
                try:
                    args = json.loads(c.function.arguments) if c.function.arguments.strip() else {}
                except json.JSONDecodeError:
                    raise bad_request(
                        f"messages[{i}].tool_calls[{k}].function.arguments is not a JSON string",
                        param=f"messages.{i}.tool_calls.{k}.function.arguments",
                    ) from None
                calls.append((c.function.name, args))
            if native_tools:
                d["tool_calls"] = [
                    {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls
                ]
            else:
                text = get_parser(chat_format).format_calls(calls)
                d["content"] = f"{d['content']}\n{text}" if d["content"] else text
        if role == "tool":
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                d["name"] = m.name
        out.append(d)
    return out


def render_chat(
    req: ChatCompletionRequest, tokenizer: Any, chat_format: str, plan: ToolPlan, images: list | None = None
) -> str:
    """The prompt string: messages, the tools (unless tool_choice is none), and a forced call's opening.
    A vision model's images are appended to `images` (in placeholder order)."""
    dicts = message_dicts(req.messages, tokenizer, chat_format, images)
    try:
        text = render_messages(tokenizer, dicts, plan.specs if plan.active else None)
    except Exception as err:  # a template's own raise_exception (e.g. roles out of order)
        raise bad_request(
            f"the model's chat template rejects these messages: {err}", param="messages"
        ) from None
    return text + plan.prefill


def trim_at_stop(text: str, stops: list[str]) -> str:
    """`text` up to the first occurrence of any stop string (OpenAI leaves the stop string out)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


def _partial_suffix(text: str, markers: list[str]) -> int:
    """Length of the longest end of `text` that could begin one of `markers`."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class ChoiceText:
    """One choice's text while streaming: what is safe to send now (never a piece of a stop string, nor
    tool-call markup when tools are active), and the whole reply once it ends."""

    def __init__(self, stops: list[str], watch_tools: bool, prefill: str = "") -> None:
        self.stops = stops
        self.watch_tools = watch_tools
        self.raw = prefill
        self.sent = 0

    def visible(self) -> str:
        return trim_at_stop(self.raw, self.stops)

    def push(self, delta: str) -> str:
        self.raw += delta
        vis = self.visible()
        markers = list(self.stops)
        limit = len(vis)
        if self.watch_tools:
            at = vis.find(OPEN)
            if at >= 0:
                limit = at
            else:
                markers.append(OPEN)
        if limit == len(vis):
            limit -= _partial_suffix(vis, markers)
        limit = max(limit, self.sent)
        out = vis[self.sent : limit]
        self.sent = limit
        return out


@dataclass
class ReplyView:
    """A finished reply as the API shows it."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    outcome: str | None  # one of TOOL_OUTCOMES when the request had tools; None otherwise


def classify(parsed: ParsedOutput, plan: ToolPlan) -> str | None:
    """The tool-call outcome of a reply to a request with tools (see TOOL_OUTCOMES)."""
    if parsed.errors:
        return "invalid_json"
    if not parsed.calls:
        return "none_when_required" if plan.required else None
    schemas = {s.name: s.parameters for s in plan.specs}
    if any(c.name not in schemas for c in parsed.calls):
        return "unknown_tool"
    for c in parsed.calls:
        if not jsonschema.validators.validator_for(schemas[c.name])(schemas[c.name]).is_valid(c.arguments):
            return "schema_violation"
    return "ok"


def view_reply(text: str, plan: ToolPlan, chat_format: str, call_prefix: str) -> ReplyView:
    """`text` (stop strings already trimmed, prefill included) as content and tool_calls.

    Well-formed calls become `tool_calls` (arguments as JSON strings), whether or not they name a known
    tool or validate, as OpenAI does; markup that does not parse is left in `content` for the client to see.
    """
    if not plan.active:
        return ReplyView(text, [], None)
    parsed = get_parser("smollm2" if chat_format == "smollm2" else "hermes").parse(text)
    outcome = classify(parsed, plan)
    if parsed.errors or not parsed.calls:
        return ReplyView(text, [], outcome)
    calls = parsed.calls if plan.parallel else parsed.calls[:1]
    tool_calls = [
        {
            "id": f"{call_prefix}_{k}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        for k, c in enumerate(calls)
    ]
    return ReplyView(parsed.content or None, tool_calls, outcome)
