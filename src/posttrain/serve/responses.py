"""The Responses API (`POST /v1/responses`) over the chat path: a request's input items (messages,
function calls, their outputs), instructions and flat function tools become a chat request; the reply
becomes `output` items (a message with output_text, function_call items) in a `response` object with
usage, whole or as the documented event stream (response.created, response.in_progress, then per item
output_item.added ... output_item.done with its text or arguments deltas, then response.completed or
response.incomplete). Nothing is stored: there is no retrieval, and `previous_response_id` is a 400.
No engine and no HTTP here: app.py runs the generation and frames the events.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from posttrain.engine.types import BadRequestError, SamplingParams
from posttrain.serve.chat import ChoiceText, ToolPlan, finished_text, view_reply
from posttrain.serve.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCallIn,
    FunctionCallItem,
    FunctionDef,
    InputMessage,
    InputText,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    ResponsesRequest,
    ToolCallIn,
    ToolDef,
    bad_request,
)


def _text(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


def _response_format(req: ResponsesRequest) -> ResponseFormat | None:
    """`text.format` (flat: {"type": "json_schema", "name", "schema"}) in chat's nested form."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type != "json_schema":
        return fmt
    extra = fmt.model_extra or {}
    if not isinstance(extra.get("schema"), dict):
        raise bad_request(
            'text.format json_schema needs `schema`, a JSON Schema object (e.g. {"type": "json_schema", '
            '"name": "reply", "schema": {"type": "object"}})',
            param="text.format.schema",
        )
    spec = {"name": extra.get("name", "response"), "schema": extra["schema"]}
    return ResponseFormat.model_validate({"type": "json_schema", "json_schema": spec})


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses request means: instructions as the system message, each input
    item in order (a function_call joins the assistant message before it, as one turn), a
    function_call_output as the tool message answering its call. 400 for what cannot be served."""
    if req.previous_response_id is not None:
        raise bad_request(
            "previous_response_id is not supported: this server stores no responses; send the "
            "conversation so far as `input` items",
            param="previous_response_id",
            code="unsupported_parameter",
        )
    if req.background:
        raise bad_request(
            "background responses are not supported", param="background", code="unsupported_parameter"
        )
    messages: list[ChatMessage] = []
    if req.instructions:
        messages.append(ChatMessage(role="system", content=req.instructions))
    items = [InputMessage(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    if not items:
        raise bad_request("input holds no items; give text or at least one message", param="input")
    names: dict[str, str] = {}  # call_id -> the function it called
    for i, item in enumerate(items):
        if isinstance(item, InputMessage):
            messages.append(ChatMessage(role=item.role, content=_text(item.content)))
        elif isinstance(item, FunctionCallItem):
            names[item.call_id] = item.name
            call = ToolCallIn(
                id=item.call_id, function=FunctionCallIn(name=item.name, arguments=item.arguments)
            )
            if messages and messages[-1].role == "assistant":
                messages[-1].tool_calls = [*(messages[-1].tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        else:
            if item.call_id not in names:
                raise bad_request(
                    f"input[{i}] is the output of call_id '{item.call_id}', which no function_call "
                    "item before it made",
                    param=f"input.{i}.call_id",
                )
            messages.append(
                ChatMessage(
                    role="tool",
                    content=_text(item.output),
                    tool_call_id=item.call_id,
                    name=names[item.call_id],
                )
            )
    tools = [
        ToolDef(function=FunctionDef(name=t.name, description=t.description, parameters=t.parameters))
        for t in req.tools or []
    ]
    choice = req.tool_choice
    named = (
        NamedToolChoice(function=NamedFunction(name=choice.name))
        if choice is not None and not isinstance(choice, str)
        else None
    )
    return ChatCompletionRequest(
        model=req.model,
        messages=messages,
        tools=tools or None,
        tool_choice=named or choice,  # type: ignore[arg-type]
        parallel_tool_calls=req.parallel_tool_calls,
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        response_format=_response_format(req),
        user=req.user,
    )


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """Responses usage; no token is reported cached or reasoning (the engine counts neither)."""
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def call_item(call: dict[str, Any], item_id: str, status: str = "completed") -> dict[str, Any]:
    """A chat `tool_calls` entry as a function_call output item."""
    fn = call["function"]
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"],
        "status": status,
    }


def response_object(
    req: ResponsesRequest,
    rid: str,
    model: str,
    created_at: int,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """The `response` object; status "incomplete" (max_output_tokens cut the reply) names its reason."""
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if req.tools else "none"
    return {
        "id": rid,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "text": {
            "format": (req.text.format.model_dump() if req.text and req.text.format else {"type": "text"})
        },
        "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
        "tools": [t.model_dump() for t in req.tools or []],
        "truncation": "disabled",
        "usage": usage,
        "user": req.user,
        "metadata": req.metadata or {},
    }


async def response_whole(
    gen: Any,
    req: ResponsesRequest,
    chat_format: str,
    model: str,
    plan: ToolPlan,
    params: SamplingParams,
    rid: str,
) -> dict[str, Any]:
    """The finished `response` object (gen: app.py's generation of one completion)."""
    text = ChoiceText(params.stop, False, plan.prefill)
    finish = None
    async for _, d in gen.deltas():
        text.push(d.text)
        finish = d.finish_reason or finish
    view = view_reply(finished_text(text.visible(), plan, finish), plan, chat_format, f"call_{rid[-12:]}")
    gen.tool_outcome(view.outcome)
    status = "incomplete" if finish == "length" else "completed"
    output = [message_item(f"msg_{rid[-12:]}", view.content, status)] if view.content else []
    output += [call_item(c, f"fc_{rid[-12:]}_{k}") for k, c in enumerate(view.tool_calls)]
    usage = usage_of(gen.prompt_tokens, gen.completion_tokens)
    return response_object(req, rid, model, int(time.time()), status, output, usage)


def _event(kind: str, seq: int, **fields: Any) -> str:
    body = {"type": kind, **fields, "sequence_number": seq}
    return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"


async def response_events(
    gen: Any,
    req: ResponsesRequest,
    chat_format: str,
    model: str,
    plan: ToolPlan,
    params: SamplingParams,
    rid: str,
) -> AsyncIterator[str]:
    """The SSE event stream of one response: text as output_text deltas while it is generated (never
    tool-call markup), each parsed call as a function_call item once the reply ends. Closes `gen`."""
    seq = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal seq
        seq += 1
        return _event(kind, seq - 1, **fields)

    created = int(time.time())
    output: list[dict[str, Any]] = []
    msg_id = f"msg_{rid[-12:]}"
    streamed: str | None = None  # the message's text so far; None until its item is opened

    def open_message() -> list[str]:
        return [
            event(
                "response.output_item.added",
                output_index=0,
                item=message_item(msg_id, "", "in_progress") | {"content": []},
            ),
            event(
                "response.content_part.added",
                item_id=msg_id,
                output_index=0,
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            ),
        ]

    def emit(piece: str) -> list[str]:
        """A text delta, after the message item's opening events if it is the first."""
        nonlocal streamed
        opening = open_message() if streamed is None else []
        streamed = (streamed or "") + piece
        kind = "response.output_text.delta"
        return [
            *opening,
            event(kind, item_id=msg_id, output_index=0, content_index=0, delta=piece, logprobs=[]),
        ]

    try:
        start = response_object(req, rid, model, created, "in_progress", [], None)
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        text = ChoiceText(params.stop, plan.active, plan.prefill)
        async for _, d in gen.deltas():
            piece = text.push(d.text)
            if piece:
                for e in emit(piece):
                    yield e
            if d.finish_reason is None:
                continue
            status = "incomplete" if d.finish_reason == "length" else "completed"
            full = finished_text(text.visible(), plan, d.finish_reason)
            view = view_reply(full, plan, chat_format, f"call_{rid[-12:]}")
            gen.tool_outcome(view.outcome)
            rest = "" if view.tool_calls else full[text.sent :]
            if rest:
                for e in emit(rest):
                    yield e
            if streamed is not None:
                item = message_item(msg_id, streamed, status)
                part = item["content"][0]
                yield event(
                    "response.output_text.done",
                    item_id=msg_id,
                    output_index=0,
                    content_index=0,
                    text=streamed,
                    logprobs=[],
                )
                yield event(
                    "response.content_part.done", item_id=msg_id, output_index=0, content_index=0, part=part
                )
                yield event("response.output_item.done", output_index=0, item=item)
                output.append(item)
            for k, call in enumerate(view.tool_calls):
                item = call_item(call, f"fc_{rid[-12:]}_{k}")
                at = len(output)
                yield event(
                    "response.output_item.added",
                    output_index=at,
                    item=item | {"arguments": "", "status": "in_progress"},
                )
                args = item["arguments"]
                yield event(
                    "response.function_call_arguments.delta", item_id=item["id"], output_index=at, delta=args
                )
                yield event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=at,
                    arguments=args,
                )
                yield event("response.output_item.done", output_index=at, item=item)
                output.append(item)
            usage = usage_of(gen.prompt_tokens, gen.completion_tokens)
            final = response_object(req, rid, model, created, status, output, usage)
            yield event(f"response.{status}", response=final)
    except BadRequestError as err:
        yield event("error", code=None, message=str(err), param=None)
    finally:
        await gen.close()
