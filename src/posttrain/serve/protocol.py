"""The OpenAI wire format the server accepts and the error it answers with: pydantic request models
(unknown top-level fields are refused by name, never silently ignored; types are strict: a string is
not a boolean or a number), `APIError` with its HTTP
status, and the mapping of validation errors to one readable 400. Does not generate or render prompts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


_EXPECTED = {
    "bool_type": "a boolean",
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "dict_type": "an object",
    "model_type": "an object",
    "list_type": "an array",
}


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "null" if value is None else "an object"


def _field_path(loc: tuple[Any, ...]) -> str:
    """`("stop", "list[str]", 0)` -> `stop.0`: pydantic names the union member it tried (a type, a model
    class, an input item's `type=` tag); field names are lowercase, without brackets or `=`."""
    members = {"str", "int", "float", "bool", "dict", "list", "none"}

    def member(p: Any) -> bool:
        return isinstance(p, str) and ("[" in p or "=" in p or p in members or p[:1].isupper())

    return ".".join(str(p) for p in loc if not member(p))


def from_validation_error(err: ValidationError) -> APIError:
    """The deepest pydantic error as a 400 naming the field (`messages.0.content`), without echoing input;
    a wrong JSON type in OpenAI's words ("Invalid type for 'logprobs': expected a boolean, but got a
    string instead"), a union's members joined ("expected a string or an array")."""
    errors = err.errors(include_url=False)
    # the deepest error: of a union's members, the one the input got furthest into
    first = max(errors, key=lambda e: len(_field_path(e["loc"]))) if errors else {"loc": (), "msg": str(err)}
    loc = _field_path(first.get("loc", ()))
    kind = first.get("type", "")
    if kind in _EXPECTED and loc:
        same = [e for e in errors if _field_path(e["loc"]) == loc]
        wanted = list(dict.fromkeys(_EXPECTED.get(e["type"], "another type") for e in same))
        more = f" (and {len(errors) - len(same)} more error(s))" if len(errors) > len(same) else ""
        got = _json_type(first.get("input"))
        return bad_request(
            f"Invalid type for '{loc}': expected {' or '.join(wanted)}, but got {got} instead{more}",
            param=loc,
            code="invalid_type",
        )
    msg = first.get("msg", "invalid value")
    if kind == "extra_forbidden":
        msg = "unknown field (not part of the API this server implements)"
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return bad_request(f"{loc}: {msg}{more}" if loc else f"{msg}{more}", param=loc or None)


class _Strict(BaseModel):
    # strict: "yes" is not a boolean, "3" not a number (OpenAI answers both with a 400)
    model_config = ConfigDict(extra="forbid", strict=True)


class _Lenient(BaseModel):
    # messages echoed back from a response carry fields such as `refusal` or `annotations`
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionDef(_Lenient):
    name: str = Field(pattern=r"^[A-Za-z0-9_\-.]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCallIn(_Lenient):
    name: str
    arguments: str = ""


class ToolCallIn(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ContentPart(_Lenient):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class StreamOptions(_Lenient):
    include_usage: bool = False


class ResponseFormat(_Lenient):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]


class _Sampling(_Strict):
    """Fields both endpoints share; `top_k`, `min_p`, `repetition_penalty`, `ignore_eos` are extensions
    (the names vLLM uses) for what the engine also offers."""

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=64)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    max_tokens: int | None = Field(None, ge=1)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, lt=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


# ---- the Responses API (POST /v1/responses) ---------------------------------------------------------


class InputText(_Lenient):
    """A text part of an input item: input_text (user, system) or output_text (an echoed reply)."""

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]


def _item_type(item: Any) -> str:
    kind = item.get("type", "message" if "role" in item else None) if isinstance(item, dict) else None
    return f"type={kind}"


InputItem = Annotated[
    Annotated[InputMessage, Tag("type=message")]
    | Annotated[FunctionCallItem, Tag("type=function_call")]
    | Annotated[FunctionCallOutputItem, Tag("type=function_call_output")],
    Discriminator(_item_type),
]


class FunctionTool(_Lenient):
    """A function tool in the Responses API's flat form (name beside type, not under `function`)."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_\-.]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(_Lenient):
    type: Literal["function"]
    name: str


class TextConfig(_Lenient):
    format: ResponseFormat | None = None


class ResponsesRequest(_Strict):
    """What `/v1/responses` accepts: text or input items (messages, function calls and their outputs),
    function tools, sampling. Nothing is stored: `previous_response_id` and `background` are refused."""

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    previous_response_id: str | None = None  # refused with a 400: nothing is stored
    background: bool | None = None  # true is refused with a 400
