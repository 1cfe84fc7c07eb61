"""The engine's seam: the `Engine` protocol every backend (paged, hf, vllm) provides, and its request and
result types. Owns validation of sampling parameters and requests (clear errors for bad input). Does
not generate: the backends in `paged.py`, `hf.py` and `vllm_backend.py` do.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from posttrain.types import ImagePart


class BadRequestError(ValueError):
    """A request the engine cannot serve; the message names the field and what would be right."""


MAX_TOP_LOGPROBS = 20  # as OpenAI's API allows


@dataclass
class SamplingParams:
    """How to sample one request.

    temperature 0 is greedy. top_k 0 and top_p 1 and min_p 0 mean no truncation. `stop` strings and
    `stop_token_ids` end a completion (the model's EOS ids always do, unless `ignore_eos`). `seed`
    makes the completions reproducible whatever else is in the batch; `n` completions share the
    prompt's KV blocks. `presence_penalty` and `frequency_penalty` (OpenAI's, in [-2, 2]) subtract
    presence x [t was generated] + frequency x (times t was generated) from token t's logit, over the
    completion's tokens (after the multiplicative `repetition_penalty`, HF's, over prompt and completion).
    `top_logprobs` N in [0, 20] also reports, for every generated token, the N most
    likely (token, logprob) pairs under the distribution its logprob is reported under. `json_schema`
    (None = free text) constrains the completion to JSON valid under that schema (`{"type": "object"}`:
    any JSON object): tokens the grammar forbids get logit -inf before the penalties and temperature, so
    logprobs and top logprobs are those of the masked distribution actually sampled from; the
    completion ends with EOS once the JSON is complete (see engine/constrained.py).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    n: int = 1
    ignore_eos: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    json_schema: dict[str, Any] | None = None

    @property
    def penalised(self) -> bool:
        """Whether a penalty changes the logits with the tokens before them."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self) -> None:
        if not self.temperature >= 0.0:
            raise BadRequestError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise BadRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise BadRequestError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 <= self.min_p < 1.0:
            raise BadRequestError(f"min_p must be in [0, 1), got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise BadRequestError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise BadRequestError(f"{name} must be in [-2, 2] (0 = off), got {value}")
        if self.max_tokens <= 0:
            raise BadRequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.n < 1:
            raise BadRequestError(f"n must be >= 1, got {self.n}")
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int):
            raise BadRequestError(
                f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}"
            )
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.json_schema is not None:
            if not isinstance(self.json_schema, dict):
                raise BadRequestError(
                    f"json_schema must be a JSON Schema object (a dict), got {type(self.json_schema).__name__}"
                )
            if self.ignore_eos:
                raise BadRequestError(
                    "ignore_eos cannot be combined with json_schema: a completed JSON ends with EOS"
                )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise BadRequestError(f"stop must be a list of non-empty strings, got {self.stop!r}")


@dataclass
class GenerationRequest:
    """`images` (vision models only) fill the prompt's image placeholder runs, in order: each image
    needs exactly the placeholder ids of its layout (models.vision.encode_with_images)."""

    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    images: list[ImagePart] = field(default_factory=list)


@dataclass
class Completion:
    """One sampled continuation.

    `token_ids` include the stop token when generation stopped on one (the trainer must learn to
    emit it), and end with the token that completed a stop string. `logprobs[i]` is the logprob of
    `token_ids[i]` under the distribution it was sampled from: after repetition penalty and
    temperature, before top-k/top-p/min-p truncation (for temperature 0: the untempered softmax).
    `text` decodes `token_ids` without a trailing stop token. `finish_reason` is "stop" or "length".
    `top_logprobs[i]` (None unless the request asked for `top_logprobs` > 0) holds the N most likely
    (token id, logprob) pairs at position i under that same distribution, most likely first.
    `routing` (MoE models on the paged engine; None otherwise): for every token fed to the model, the
    prompt's and the completion's but its last, the expert ids chosen at each sparse layer,
    `[position][layer][top_k]`; position p's choice is the one that computed its K/V and the
    distribution of token p + 1.
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    top_logprobs: list[list[tuple[int, float]]] | None = None
    routing: list[list[list[int]]] | None = None


@dataclass
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    completions: list[Completion]
    ttft_s: float


@dataclass
class StreamDelta:
    """New tokens of one completion (`index` of n) since the last delta; the last one has a finish_reason.
    `top_logprobs` is one list of (token id, logprob) pairs per new token, or None (see Completion)."""

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


def validate_request(
    req: GenerationRequest, vocab_size: int, max_model_len: int, takes_images: bool = False
) -> None:
    """Raise BadRequestError for an empty prompt, out-of-vocabulary ids, a prompt too long, or images
    for an engine that does not take them (`takes_images`: the paged engine serving a vision model)."""
    if not isinstance(req, GenerationRequest):
        raise BadRequestError(f"expected a GenerationRequest, got {type(req).__name__}")
    req.params.validate()
    if req.images and not takes_images:
        raise BadRequestError(
            f"the request has {len(req.images)} image(s), but this engine serves a text-only model "
            "(images run on the paged engine with a vision model)"
        )
    ids = req.prompt_token_ids
    if len(ids) == 0:
        raise BadRequestError("prompt_token_ids is empty; a request needs at least one prompt token")
    bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise BadRequestError(f"prompt_token_ids holds ids outside [0, {vocab_size}): {bad[:5]}")
    if len(ids) >= max_model_len:
        raise BadRequestError(
            f"prompt of {len(ids)} tokens does not fit the context: max_model_len is {max_model_len} "
            "and at least one new token is needed"
        )


Weights = dict[str, Any] | Iterable[tuple[str, Any]]  # HF parameter names -> tensors


_STEP_THREAD: ThreadPoolExecutor | None = None
_STEP_THREAD_LOCK = threading.Lock()


def step_thread() -> ThreadPoolExecutor:
    """The one thread every engine of the process runs its async steps on. Each thread that calls into
    torch gets its own OpenMP team; with two teams on the cores libgomp throttles its spinning and every
    small parallel region pays a wake-up (async decoding ran at 30 tok/s where the same steps on one
    thread ran at 44): so steps of all engines (two for `serve --mode both`) share one thread."""
    global _STEP_THREAD
    with _STEP_THREAD_LOCK:
        if _STEP_THREAD is None:
            _STEP_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="posttrain-engine-step")
        return _STEP_THREAD


@runtime_checkable
class Engine(Protocol):
    """What every engine backend provides, and all a caller may rely on (see `posttrain.engine`).

    A backend must implement `generate`, `load_weights` and `version`. The other members are optional
    capabilities with a default behaviour, which a backend inherits by subclassing `Engine`:
    `agenerate` runs `generate` in a worker thread (no batching across callers), `stream` delivers each
    completion whole, `release_kv_cache` and `reset_stats` do nothing, `kv_stats` is empty and
    `caches_prefixes` is False. `isinstance(x, Engine)` checks that every member is present.
    """

    version: int  # the policy version of the loaded weights; load_weights sets or bumps it
    # a prompt prefilled once is reused by later requests (the rollout collector then prefills a group's prompt once)
    caches_prefixes: bool = False

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationOutput]:
        """A batch of requests, blocking; outputs in request order."""
        ...

    def load_weights(self, weights: Weights, version: int | None = None) -> None:
        """Copy HF-named weights in place (a "base_model.model." prefix is stripped); sets `version` to
        `version`, or bumps it."""
        ...

    async def agenerate(self, request: GenerationRequest) -> GenerationOutput:
        """One request from a coroutine. Default: `generate([request])` on the engines' step thread."""
        loop = asyncio.get_running_loop()
        return (await loop.run_in_executor(step_thread(), self.generate, [request]))[0]

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        """The request's new tokens as they come; closing the stream early aborts the request. Default: each
        completion in one delta, once `agenerate` returns."""
        out = await self.agenerate(request)
        for j, c in enumerate(out.completions):
            yield StreamDelta(
                out.request_id, j, c.token_ids, c.logprobs, c.text, c.finish_reason, c.top_logprobs
            )

    def release_kv_cache(self) -> None:
        """Free the KV cache (a colocated learner is about to train); the next step re-allocates it.
        Default: nothing to free."""

    def kv_stats(self) -> dict[str, Any]:
        """KV usage figures (blocks_allocated, tokens_stored, waste_frac, prefix hits, peaks, preemptions);
        default: none."""
        return {}

    def reset_stats(self) -> None:
        """Restart the peak and hit counters `kv_stats` reports. Default: nothing to reset."""
