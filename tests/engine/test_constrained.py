"""Constrained decoding (`SamplingParams.json_schema`): a tiny random model, which otherwise emits garbage,
emits JSON valid under the schema; greedy picks the argmax over the allowed tokens (checked against a
brute-force mask over the whole vocabulary and an independent full forward); logprobs are those of the
masked distribution; unenforceable schemas are refused by name."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import pytest
import torch

from posttrain.engine import GenerationRequest, PagedEngine, SamplingParams
from posttrain.engine.constrained import JSON_OBJECT_SCHEMA, compile_schema
from posttrain.engine.hf import HFEngine
from posttrain.engine.speculative import can_speculate
from posttrain.engine.types import BadRequestError

from .helpers import random_prompts, tiny

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "pos": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "ok": {"type": "boolean"}},
            "required": ["x", "ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "color", "tags", "pos"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tokenizer):
    return PagedEngine(tiny("llama"), tokenizer, num_blocks=256)


def _run(engine, prompts, params):
    return [o.completions for o in engine.generate([GenerationRequest(p, params) for p in prompts])]


def test_json_object_output_parses_or_is_cut_by_max_tokens(engine, tokenizer):
    eos = tokenizer.eos_token_id
    prompts = random_prompts([5, 9, 13], seed=1)
    free = _run(engine, prompts[:1], SamplingParams(temperature=0.0, max_tokens=24))[0][0]
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.text)  # unconstrained, the model emits garbage
    stops = 0
    for params in [
        SamplingParams(temperature=0.0, max_tokens=32, json_schema=JSON_OBJECT_SCHEMA),
        SamplingParams(temperature=1.0, max_tokens=32, json_schema=JSON_OBJECT_SCHEMA, seed=3, n=2),
    ]:
        for comps in _run(engine, prompts, params):
            for c in comps:
                if c.finish_reason == "stop":  # the JSON is complete: EOS was the only allowed token
                    stops += 1
                    assert c.token_ids[-1] == eos
                    assert isinstance(json.loads(c.text), dict)
                else:  # cut mid-value by max_tokens
                    assert c.finish_reason == "length" and len(c.token_ids) == 32
                    assert c.text.startswith("{")
    assert stops >= 3


def test_json_schema_output_validates(engine, tokenizer):
    prompts = random_prompts([6, 11], seed=2)
    outs = _run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=120, json_schema=SCHEMA))
    outs += _run(
        engine, prompts, SamplingParams(temperature=1.0, max_tokens=120, json_schema=SCHEMA, seed=7, n=3)
    )
    texts = set()
    for comps in outs:
        for c in comps:
            assert c.finish_reason == "stop" and c.token_ids[-1] == tokenizer.eos_token_id, c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)
            texts.add(c.text)
    assert len(texts) >= 4  # sampled completions differ: the constraint narrows, it does not script


def _reference_allowed(ll_tokenizer, grammar: str, prefix: list[int], tokenizer, vocab: int) -> torch.Tensor:
    """The allowed tokens after `prefix` from a fresh matcher's byte-per-token logit bias (not the engine's
    bitmask unpacking), checked against a brute force over the whole vocabulary: every token the matcher
    accepts on its own is allowed, except splits of bytes the grammar forces next (`{` when `{"name": "`
    is forced), which llguidance leaves to the forced text's own tokenization."""
    m = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    assert m.consume_tokens(prefix)
    allowed = torch.frombuffer(bytearray(m.compute_logit_bias()), dtype=torch.uint8)[:vocab] > 0
    accepted = torch.tensor([m.validate_tokens([t]) == 1 for t in range(vocab)])
    assert not bool((allowed & ~accepted).any())
    forced = m.compute_ff_bytes()
    for t in torch.nonzero(accepted & ~allowed).flatten().tolist():
        piece = tokenizer.decode([t]).encode()
        assert forced.startswith(piece) and len(piece) < len(forced), (t, piece, forced)
    return allowed


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_tokens_and_logprobs_follow_the_masked_distribution(engine, tokenizer, temperature):
    model = tiny("llama")
    prompt = random_prompts([8], seed=4)[0]
    params = SamplingParams(temperature=temperature, max_tokens=6, json_schema=SCHEMA, seed=1, top_logprobs=3)
    c = _run(engine, [prompt], params)[0][0]
    ll_tok = engine.grammars._tokenizer()
    grammar = compile_schema(SCHEMA, ll_tok)
    vocab = model.config.vocab_size
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 :].float()
    for i, tok in enumerate(c.token_ids):
        allowed = _reference_allowed(ll_tok, grammar, c.token_ids[:i], tokenizer, vocab)
        assert allowed[tok]
        masked = logits[i].masked_fill(~allowed, float("-inf"))
        if temperature == 0.0:
            assert tok == int(masked.argmax())
        else:
            masked = masked / temperature
        lp = torch.log_softmax(masked, -1)
        assert c.logprobs[i] == pytest.approx(float(lp[tok]), abs=1e-4)
        top = c.top_logprobs[i]
        n_allowed = int(allowed.sum())
        assert len(top) == min(3, n_allowed)  # never a token the grammar forbids
        assert all(allowed[t] for t, _ in top)
        assert [v for _, v in top] == pytest.approx(lp.topk(len(top)).values.tolist(), abs=1e-4)


def test_speculation_skips_constrained_requests(engine, tokenizer):
    reply = '{"name": "ab", "age": 3, "color": "red", "tags": [], "pos": {"x": 1, "ok": true}}'
    prompt = tokenizer.encode(reply + " " + reply, add_special_tokens=False)  # prompt lookup would draft it
    params = SamplingParams(temperature=0.0, max_tokens=50, json_schema=SCHEMA)
    assert not can_speculate(params)
    spec = PagedEngine(tiny("llama"), tokenizer, num_blocks=64, speculative="ngram")
    assert _run(spec, [prompt], params)[0][0].token_ids == _run(engine, [prompt], params)[0][0].token_ids
    assert spec.speculation_stats()["draft_tokens"] == 0


def test_unenforceable_or_malformed_requests_are_refused(engine):
    prompt = [5, 6, 7]
    for schema, match in [
        ({"type": "object", "not": {"required": ["a"]}}, r'Unimplemented keys: \["not"\]'),
        ({"type": "string", "format": "colour"}, "Unknown format: colour"),
        ({"type": "frob"}, "Invalid type: frob"),
    ]:
        with pytest.raises(BadRequestError, match=match):
            engine.generate([GenerationRequest(prompt, SamplingParams(json_schema=schema))])
    with pytest.raises(BadRequestError, match="json_schema must be a JSON Schema object"):
        engine.generate([GenerationRequest(prompt, SamplingParams(json_schema='{"type": "object"}'))])
    with pytest.raises(BadRequestError, match="ignore_eos cannot be combined with json_schema"):
        engine.generate([GenerationRequest(prompt, SamplingParams(json_schema={}, ignore_eos=True))])


def test_the_hf_backend_refuses_json_schema(tokenizer):
    hf = HFEngine(tiny("llama"), tokenizer)
    with pytest.raises(BadRequestError, match="hf backend has no constrained decoding"):
        hf.generate(
            [GenerationRequest([5, 6, 7], SamplingParams(json_schema=JSON_OBJECT_SCHEMA, max_tokens=2))]
        )
