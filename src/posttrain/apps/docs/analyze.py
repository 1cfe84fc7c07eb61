"""The analysis a worker runs on a parsed document: structured extraction into the user's JSON Schema
(validated with jsonschema, one repair turn on invalid output) and question answering, against a chat
model - the in-process engine (`EngineModel`) or any OpenAI-compatible server (`ApiModel`, which sends
`response_format: json_schema` and falls back to plain prompting when the server answers 400).

A document that fits the model's context goes in whole; a longer one is map-reduced: each chunk is
asked separately (fields it does not state come back null), and per field the value from the LAST chunk
that states one wins (notes and restatements follow the tables they correct), cited with the page and
section of the block that states it. A chunk whose reply stays unparseable after its repair turn states
nothing (`failed_chunks`); only when every chunk fails does the job fail. Answers reduce the same way,
skipping chunks that answer NOT FOUND. Extraction requests constrain strings to MAX_STRING_CHARS.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any, Protocol

from posttrain.apps.docs.db import AnalysisResult, Citation
from posttrain.apps.docs.parse import Chunk, ParsedDoc, chunk_blocks
from posttrain.apps.docs.store import UsageError
from posttrain.envs.extract import extract_answer, parse_json_object

NOT_FOUND = "NOT FOUND"
PROMPT_MARGIN_TOKENS = 96  # chat template and instruction wording around the document


class ModelOutputError(RuntimeError):
    """The model's output could not be turned into a result (unparseable JSON after the repair turn)."""


@dataclass
class Reply:
    text: str
    prompt_tokens: int
    completion_tokens: int


class ChatModel(Protocol):
    name: str
    context_tokens: int

    def count_tokens(self, text: str) -> int: ...

    async def complete(
        self, messages: list[dict[str, str]], max_tokens: int, schema: dict[str, Any] | None
    ) -> Reply: ...


def check_schema(schema: Any) -> dict[str, Any]:
    """A user schema must be a JSON Schema object describing an object; else UsageError."""
    import jsonschema

    if not isinstance(schema, dict):
        raise UsageError(f"--schema must hold a JSON object (a JSON Schema), got {type(schema).__name__}")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as err:
        raise UsageError(f"--schema is not a valid JSON Schema: {err.message}") from None
    if (
        schema.get("type") != "object"
        or not isinstance(schema.get("properties"), dict)
        or not schema["properties"]
    ):
        raise UsageError('--schema must describe an object with "properties" (type: object)')
    return schema


def _validation_error(obj: Any, schema: dict[str, Any]) -> str | None:
    import jsonschema

    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(obj), key=lambda e: list(e.path))
    if not errors:
        return None
    e = errors[0]
    where = "/".join(map(str, e.path)) or "(root)"
    return f"{where}: {e.message}"


def _partial_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema a chunk answers: every property may be null, none is required."""
    props = {k: {"anyOf": [v, {"type": "null"}]} for k, v in schema["properties"].items()}
    return {"type": "object", "properties": props, "additionalProperties": False}


SYSTEM = "You extract facts from business documents. You answer only from the document given."


def extraction_messages(text: str, schema: dict[str, Any], part: str = "") -> list[dict[str, str]]:
    """The chat a worker sends to extract `schema` from `text` (a whole document, or one chunk when
    `part` names it); `posttrain docs sft-data` trains on exactly these."""
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": _extract_prompt(text, schema, part)},
    ]


def _extract_prompt(text: str, schema: dict[str, Any], part: str) -> str:
    return (
        f"Document{part}:\n{text}\n---\nExtract the data described by this JSON Schema from the document"
        f"{' part' if part else ''}. Use null for a field the text does not state.\n"
        f"{json.dumps(schema)}\nReply with the JSON object only."
    )


def _qa_prompt(text: str, question: str, part: str) -> str:
    return (
        f"Document{part}:\n{text}\n---\nQuestion: {question}\nAnswer from the document"
        f"{' part' if part else ''}; if it does not contain the answer, answer {NOT_FOUND}. "
        "Put the final answer between <answer> and </answer>."
    )


@dataclass
class _Tally:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    calls: int = 0
    model_ms: float = 0.0

    async def ask(
        self, model: ChatModel, messages: list[dict[str, str]], max_tokens: int, schema: Any
    ) -> str:
        t = time.perf_counter()
        reply = await model.complete(messages, max_tokens, schema)
        self.model_ms += (time.perf_counter() - t) * 1000
        self.calls += 1
        self.prompt_tokens += reply.prompt_tokens
        self.completion_tokens += reply.completion_tokens
        return reply.text


MAX_STRING_CHARS = (
    120  # strings the model is constrained to: a small model otherwise rambles to its token limit
)


def bounded(schema: Any) -> Any:
    """The schema the model is constrained to: every string without a maxLength gets MAX_STRING_CHARS,
    so a constrained reply completes its JSON within the token budget (the reply is still validated
    against the user's schema)."""
    if isinstance(schema, dict):
        out = {k: bounded(v) for k, v in schema.items()}
        if out.get("type") == "string" and "maxLength" not in out and "enum" not in out:
            out["maxLength"] = MAX_STRING_CHARS
        return out
    if isinstance(schema, list):
        return [bounded(v) for v in schema]
    return schema


async def _extract_chunk(
    model: ChatModel, tally: _Tally, text: str, schema: dict[str, Any], part: str, max_tokens: int
) -> tuple[dict[str, Any], bool]:
    """(object, repaired) for one chunk: one attempt plus one repair turn naming the error."""
    messages = extraction_messages(text, schema, part)
    constraint = bounded(schema)
    reply = await tally.ask(model, messages, max_tokens, constraint)
    obj = parse_json_object(reply)
    error = "the reply is not a JSON object" if obj is None else _validation_error(obj, schema)
    if error is None:
        return obj, False
    messages += [
        {"role": "assistant", "content": reply[:4000]},
        {
            "role": "user",
            "content": f"That is not valid for the schema ({error}). Reply with the corrected JSON object only.",
        },
    ]
    reply2 = await tally.ask(model, messages, max_tokens, constraint)
    obj2 = parse_json_object(reply2)
    if obj2 is None:
        raise ModelOutputError(f"model output is not a JSON object after a repair turn: {reply2[:200]!r}")
    return obj2, True


def cite(target: str, chunk: Chunk, value: Any) -> Citation:
    """Where `value` is stated: the page and section of the first block of the chunk that shows it
    (with a little context), else the chunk's first page and last section."""
    needles = [str(value)]
    if isinstance(value, int) and not isinstance(value, bool):
        needles.insert(0, f"{value:,}")
    for block in chunk.blocks:
        for needle in needles:
            i = block.text.find(needle)
            if i >= 0:
                quote = block.text[max(0, i - 60) : i + len(needle) + 60].replace("\n", " ")
                return Citation(target, block.page, block.section, quote)
    return Citation(
        target, chunk.pages[0] if chunk.pages else None, chunk.sections[-1] if chunk.sections else None
    )


async def analyze(
    doc: ParsedDoc,
    schema: dict[str, Any],
    questions: list[str],
    model: ChatModel,
    max_new_tokens: int = 256,
) -> AnalysisResult:
    overhead = (
        model.count_tokens(_extract_prompt("", schema, " (part 10 of 10, pages 100-100)"))
        + PROMPT_MARGIN_TOKENS
    )
    budget = (
        model.context_tokens - max_new_tokens * 2 - overhead
    )  # *2: the repair turn carries the first reply
    if budget < 64:
        raise UsageError(
            f"model context of {model.context_tokens} tokens leaves no room for a document next to the schema "
            f"and {max_new_tokens} new tokens"
        )
    whole = model.count_tokens(doc.text) <= budget
    chunks = chunk_blocks(doc.blocks, budget, model.count_tokens) if not whole else [_whole(doc)]
    tally = _Tally()
    n = len(chunks)

    def part(i: int) -> str:
        if whole:
            return ""
        pages = chunks[i].pages
        where = f", pages {pages[0]}-{pages[-1]}" if pages else ""
        return f" (part {i + 1} of {n}{where})"

    target_schema = schema if whole else _partial_schema(schema)
    got = await asyncio.gather(
        *(
            _extract_chunk(model, tally, c.text, target_schema, part(i), max_new_tokens)
            for i, c in enumerate(chunks)
        ),
        return_exceptions=True,
    )
    for r in got:
        if isinstance(r, BaseException) and not isinstance(r, ModelOutputError):
            raise r
    failed = [r for r in got if isinstance(r, ModelOutputError)]
    if len(failed) == n:  # nothing usable at all: the job fails (retried, then dead-lettered)
        raise failed[0]
    # map-reduce: a chunk whose reply stayed unparseable states nothing (counted in failed_chunks)
    outs = [({}, True) if isinstance(r, ModelOutputError) else r for r in got]
    merged: dict[str, Any] = {}
    citations: list[Citation] = []
    props = schema["properties"]
    for name in props:
        for i in range(n - 1, -1, -1):
            value = outs[i][0].get(name)
            if value is not None and _validation_error(value, props[name]) is None:
                merged[name] = value
                citations.append(cite(name, chunks[i], value))
                break
    if whole:  # keep what the model said, extra keys included: validation below judges it
        merged = {**outs[0][0], **merged}
    answers: list[str] = []
    for qi, q in enumerate(questions):
        replies = await asyncio.gather(
            *(
                tally.ask(
                    model,
                    [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": _qa_prompt(c.text, q, part(i))},
                    ],
                    max_new_tokens,
                    None,
                )
                for i, c in enumerate(chunks)
            )
        )
        answer, where = NOT_FOUND, None
        for i in range(n - 1, -1, -1):
            got = extract_answer(replies[i]).text
            if got and got.strip().upper() != NOT_FOUND:
                answer, where = got, chunks[i]
                break
        answers.append(answer)
        if where is not None:
            citations.append(cite(f"answer:{qi}", where, answer))
    return AnalysisResult(
        data=merged,
        valid=_validation_error(merged, schema) is None,
        repaired=any(r for _, r in outs),
        failed_chunks=len(failed),
        mode="whole" if whole else "map_reduce",
        n_chunks=n,
        answers=answers,
        citations=citations,
        prompt_tokens=tally.prompt_tokens,
        completion_tokens=tally.completion_tokens,
        model_calls=tally.calls,
        model_ms=tally.model_ms,
    )


def _whole(doc: ParsedDoc) -> Chunk:
    pages = sorted({b.page for b in doc.blocks if b.page is not None})
    return Chunk(
        doc.text, pages, list(dict.fromkeys(b.section for b in doc.blocks if b.section)), list(doc.blocks)
    )


# ----------------------------------------------------------------------------------------------
# models


class ApiModel:
    """Any OpenAI-compatible chat endpoint. `response_format` json_schema is sent with extraction
    requests until the server answers one with 400; from then on plain prompting (the repair turn and
    validation still apply)."""

    def __init__(
        self,
        api_base: str,
        model: str,
        context_tokens: int,
        tokenizer: str = "smollm2-135m",
        api_key: str | None = None,
        timeout_s: float = 600.0,
        transport: Any = None,
    ) -> None:
        import httpx

        if not api_base.startswith(("http://", "https://")):
            raise UsageError(f"--api-base '{api_base}' is not an http(s):// URL")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(
            base_url=api_base.rstrip("/"), headers=headers, timeout=timeout_s, transport=transport
        )
        self.name = f"{api_base}#{model}"
        self.model = model
        self.context_tokens = context_tokens
        self.json_schema_supported = True
        self._tokenizer_spec = tokenizer

    def count_tokens(self, text: str) -> int:
        from posttrain.envs.tokens import count_tokens

        return count_tokens(text, self._tokenizer_spec)

    async def complete(
        self, messages: list[dict[str, str]], max_tokens: int, schema: dict[str, Any] | None
    ) -> Reply:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        if schema is not None and self.json_schema_supported:
            rf = {"type": "json_schema", "json_schema": {"name": "extraction", "schema": schema}}
            r = await self.client.post("/chat/completions", json={**body, "response_format": rf})
            if r.status_code == 400:
                self.json_schema_supported = False
                r = await self.client.post("/chat/completions", json=body)
        else:
            r = await self.client.post("/chat/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{self.name} answered {r.status_code}: {r.text[:300]}")
        try:
            data = r.json()
            text = data["choices"][0]["message"].get("content") or ""
        except (ValueError, KeyError, IndexError, TypeError) as err:
            raise RuntimeError(f"{self.name} sent a body that is not a chat completion: {err}") from None
        usage = data.get("usage") or {}
        return Reply(text, int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))

    async def aclose(self) -> None:
        await self.client.aclose()


class EngineModel:
    """The in-process paged engine over a model spec (greedy); extraction requests are constrained to
    the schema when the engine supports `SamplingParams.json_schema`."""

    def __init__(
        self, spec: str = "smollm2-135m", max_model_len: int = 8192, num_kv_blocks: int | None = None
    ) -> None:
        from posttrain.config import EngineConfig
        from posttrain.engine import make_engine
        from posttrain.models import load_policy, load_tokenizer

        self.tokenizer = load_tokenizer(spec)
        net = load_policy(spec, dtype="float32")
        limit = getattr(getattr(net, "config", None), "max_position_embeddings", max_model_len)
        self.context_tokens = min(max_model_len, int(limit))
        # room for the K/V of ~6 full-context requests: map-reduce sends a document's chunks at once
        blocks = num_kv_blocks or max(2048, 6 * self.context_tokens // 16)
        cfg = EngineConfig(
            max_model_len=self.context_tokens, num_kv_blocks=blocks, max_num_batched_tokens=2048
        )
        self.engine = make_engine(cfg, net, self.tokenizer)
        self.name = spec
        self._constrained = "json_schema" in {f.name for f in dataclasses.fields(self._params_cls())}

    @staticmethod
    def _params_cls() -> Any:
        from posttrain.engine import SamplingParams

        return SamplingParams

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    async def complete(
        self, messages: list[dict[str, str]], max_tokens: int, schema: dict[str, Any] | None
    ) -> Reply:
        from posttrain.engine import BadRequestError, GenerationRequest
        from posttrain.models.chat import encode_messages

        ids = encode_messages(self.tokenizer, messages)
        room = self.context_tokens - len(ids)
        if room < 1:
            raise RuntimeError(
                f"prompt of {len(ids)} tokens does not fit the context of {self.context_tokens}"
            )
        kwargs: dict[str, Any] = {}
        if schema is not None and self._constrained:
            kwargs["json_schema"] = schema
        params = self._params_cls()(
            temperature=0.0,
            max_tokens=min(max_tokens, room),
            stop_token_ids=[self.tokenizer.eos_token_id],
            **kwargs,
        )
        try:
            out = await self.engine.agenerate(GenerationRequest(ids, params))
        except BadRequestError:
            if "json_schema" not in kwargs:
                raise
            self._constrained = False  # a schema the grammar cannot take: prompt + validation instead
            params = dataclasses.replace(params, json_schema=None)
            out = await self.engine.agenerate(GenerationRequest(ids, params))
        c = out.completions[0]
        return Reply(c.text, len(ids), len(c.token_ids))

    async def aclose(self) -> None:
        return None
