"""Bad requests get clear errors; stop tokens, stop strings and the context limit end completions exactly."""

from __future__ import annotations

import pytest

from engine.helpers import hf_greedy, random_prompts, tiny
from posttrain.engine import BadRequestError, GenerationRequest, PagedEngine, SamplingParams


@pytest.fixture(scope="module")
def engine(tokenizer):
    return PagedEngine(tiny("llama"), tokenizer, block_size=4, num_blocks=64, max_model_len=64)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "prompt_token_ids is empty"),
        ([5, 6], SamplingParams(max_tokens=0), "max_tokens must be >= 1, got 0"),
        (
            list(range(3, 67)),
            SamplingParams(),
            "prompt of 64 tokens does not fit the context: max_model_len is 64",
        ),
        ([5, 49152], SamplingParams(), r"ids outside \[0, 49152\)"),
        ([5], SamplingParams(temperature=-1.0), "temperature must be >= 0"),
        ([5], SamplingParams(top_p=0.0), "top_p must be in"),
        ([5], SamplingParams(n=0), "n must be >= 1"),
        ([5], SamplingParams(stop=[""]), "stop must be a list of non-empty strings"),
    ],
)
def test_bad_requests_get_clear_errors(engine, prompt, params, message):
    with pytest.raises(BadRequestError, match=message):
        engine.generate([GenerationRequest(prompt, params)])


def test_request_larger_than_the_pool_is_refused(tokenizer):
    small = PagedEngine(tiny("llama"), tokenizer, block_size=4, num_blocks=4)
    with pytest.raises(BadRequestError, match="needs 6 KV blocks; the pool holds 4"):
        small.generate([GenerationRequest([5] * 10, SamplingParams(max_tokens=14))])


def test_stop_token_is_included_and_ends_the_completion(engine, tokenizer):
    prompt = random_prompts([7], seed=30)[0]
    ref = hf_greedy(tiny("llama"), prompt, 20)
    stop = ref[6]
    cut = ref.index(stop)
    out = engine.generate(
        [GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop]))]
    )
    comp = out[0].completions[0]
    assert comp.token_ids == ref[: cut + 1]
    assert comp.finish_reason == "stop"
    assert comp.text == tokenizer.decode(ref[:cut])


def test_stop_string_keeps_tokens_through_the_one_completing_the_match(engine, tokenizer):
    prompt = random_prompts([5], seed=31)[0]
    ref = hf_greedy(tiny("llama"), prompt, 20)
    full = tokenizer.decode(ref[:12])
    stop = full[-4:].strip() or full[-6:]  # text that ends inside token 12
    k = next(i for i in range(1, 21) if stop in tokenizer.decode(ref[:i]))
    out = engine.generate(
        [GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=20, stop=[stop]))]
    )
    comp = out[0].completions[0]
    assert comp.token_ids == ref[:k]
    assert comp.finish_reason == "stop"
    assert stop in comp.text


def test_length_limits_end_with_reason_length(engine):
    prompt = random_prompts([60], seed=32)[0]
    comp = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=20, ignore_eos=True))])[
        0
    ].completions[0]
    assert len(comp.token_ids) == 4 and comp.finish_reason == "length"  # 60 + 4 = max_model_len
    comp = engine.generate([GenerationRequest(prompt[:10], SamplingParams(max_tokens=3, ignore_eos=True))])[
        0
    ].completions[0]
    assert len(comp.token_ids) == 3 and comp.finish_reason == "length"


def test_duplicate_request_ids_are_refused(engine):
    reqs = [GenerationRequest([5, 6], SamplingParams(max_tokens=2), request_id="a") for _ in range(2)]
    with pytest.raises(BadRequestError, match="duplicate request_id"):
        engine.generate(reqs)
