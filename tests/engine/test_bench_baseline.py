"""The engine benchmark's HF baseline returns the same logprobs a teacher-forced forward pass gives, from
HF's own sampling, without the hf backend's per-token Python loop."""

from __future__ import annotations

import pytest

from engine.helpers import hf_logprobs, random_prompts, tiny
from posttrain.bench.engine import HFGenerate
from posttrain.engine.types import GenerationRequest, SamplingParams


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_baseline_logprobs_equal_a_teacher_forced_forward(tokenizer, temperature):
    model = tiny("llama")
    prompts = random_prompts([5, 9, 3], seed=1, vocab=model.config.vocab_size)
    reqs = [
        GenerationRequest(
            p, SamplingParams(temperature=temperature, max_tokens=6, n=2, seed=i, ignore_eos=True)
        )
        for i, p in enumerate(prompts)
    ]
    outs = HFGenerate(model, tokenizer).generate(reqs)
    assert [len(o.completions) for o in outs] == [2, 2, 2]
    for out, prompt in zip(outs, prompts, strict=True):
        assert out.prompt_token_ids == prompt
        for c in out.completions:
            assert len(c.token_ids) == 6
            assert c.logprobs == pytest.approx(hf_logprobs(model, prompt, c.token_ids, temperature), abs=1e-4)


def test_baseline_refuses_requests_it_would_not_batch_like_the_bench(tokenizer):
    model = tiny("llama")
    mixed = [
        GenerationRequest([5, 6], SamplingParams(max_tokens=3, ignore_eos=True)),
        GenerationRequest([5, 6], SamplingParams(max_tokens=4, ignore_eos=True)),
    ]
    with pytest.raises(ValueError, match="share their sampling params"):
        HFGenerate(model, tokenizer).generate(mixed)
