"""Constrained decoding: a request's JSON Schema (`SamplingParams.json_schema`) as a token-level grammar.

Owns compiling a schema with llguidance (the structured-output library vLLM and SGLang also use) over
the engine's tokenizer, one matcher per sequence that follows its sampled tokens, and the allowed-token
mask applied to a step's logits (disallowed tokens to -inf) before sampling. Once the grammar is
complete only the end-of-sequence ids are allowed, so a constrained completion ends with EOS
(finish_reason "stop") or is cut by max_tokens ("length"). Does not sample (sampling.py) or schedule.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from posttrain.engine.types import BadRequestError

JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}  # OpenAI's response_format json_object
# json.dumps' separators, without free whitespace: a model cannot pad its reply with endless blanks
_COMPILE_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


class GrammarCompiler:
    """Compiles JSON Schemas against one tokenizer (its llguidance view is built once, on first use)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._ll_tokenizer: Any = None

    def _tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            if not self.eos_ids:
                raise BadRequestError("constrained decoding needs an end-of-sequence id; the model has none")
            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_ids
                )
            except ValueError as err:
                raise BadRequestError(f"constrained decoding cannot use this tokenizer: {err}") from None
        return self._ll_tokenizer

    def matcher(self, schema: dict[str, Any]) -> Constraint:
        """A fresh constraint for `schema` (BadRequestError as `compile_schema` raises it)."""
        tok = self._tokenizer()
        m = llguidance.LLMatcher(tok, compile_schema(schema, tok), log_level=0)
        if m.is_error():
            raise BadRequestError(f"json_schema cannot be enforced: {m.get_error()}")
        return Constraint(m, self.vocab_size)


def compile_schema(schema: dict[str, Any], ll_tokenizer: Any = None) -> str:
    """llguidance's grammar for `schema`; BadRequestError names what it cannot enforce (an unimplemented
    keyword such as `not` or `if`, an unknown format, a malformed schema). Keywords JSON Schema does not
    define are annotations and are ignored, as the specification says."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), overrides=_COMPILE_OPTIONS
        )
    except (TypeError, ValueError) as err:
        raise BadRequestError(f"json_schema is not a valid JSON object: {err}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer)
    if is_error:
        raise BadRequestError(f"json_schema cannot be enforced: {'; '.join(messages)}")
    return grammar


class Constraint:
    """One sequence's position in its grammar: which tokens may come next, and the tokens it consumed."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size

    def allowed(self) -> np.ndarray:
        """The next token's allowed ids as a bool mask `[vocab_size]`."""
        bits = np.empty(4 * ((self.vocab_size + 31) // 32), dtype=np.uint8)  # llguidance's int32 words
        self.matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        if self.matcher.is_error():
            raise RuntimeError(f"constrained decoding failed: {self.matcher.get_error()}")
        # little-endian words: bit i of byte j is token 8j + i (numpy's unpack; torch's shifts are ~1000x slower)
        return np.unpackbits(bits, bitorder="little")[: self.vocab_size].view(np.bool_)

    def consume(self, token: int) -> None:
        """Advance past a sampled token (one the mask allowed)."""
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"constrained decoding rejected token {token}: {self.matcher.get_error()}")

    def copy(self) -> Constraint:
        return Constraint(self.matcher.deep_copy(), self.vocab_size)


def mask_logits(logits: torch.Tensor, constraints: list[Constraint | None]) -> torch.Tensor:
    """`logits` `[B, vocab]` with each constrained row's disallowed tokens at -inf (a new tensor if any row
    is constrained); rows whose constraint is None pass unchanged. On CPU the mask is built and applied in
    numpy (one thread): torch's multi-threaded small ops cost several ms each on a busy CPU."""
    if all(c is None for c in constraints):
        return logits
    B, V = logits.shape
    allowed = np.ones((B, V), dtype=np.bool_)
    for i, c in enumerate(constraints):
        if c is not None:
            if c.vocab_size != V:
                raise RuntimeError(f"the grammar's vocabulary ({c.vocab_size}) is not the model's ({V})")
            allowed[i] = c.allowed()
    if not allowed.any(-1).all():
        raise RuntimeError("constrained decoding allows no token at this position")
    if logits.device.type != "cpu":
        return logits.masked_fill(torch.from_numpy(~allowed).to(logits.device), float("-inf"))
    out = logits.detach().numpy().copy()
    out[~allowed] = -np.inf
    return torch.from_numpy(out)
