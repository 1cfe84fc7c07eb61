"""Self-speculative decoding (`speculative="early_exit"`): drafts are the greedy tokens of the model's first
K layers + final norm + head (checked against a truncated transformers model), verified by the full
model with the exact rule: greedy output identical to plain decoding, sampled output from the same
distribution (chi-square)."""

from __future__ import annotations

import pytest
import torch
import transformers

from posttrain.engine import GenerationRequest, SamplingParams
from posttrain.engine import paged as paged_module

from .helpers import assert_same_token_distribution
from .test_speculative import LOOP, _engine, lively


def _truncated_hf(config, state: dict, layers: int):
    cfg = transformers.AutoConfig.for_model(**{**config.to_dict(), "num_hidden_layers": layers})
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    keep = {
        k: v for k, v in state.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
    }
    missing, unexpected = model.load_state_dict(keep, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing)  # the head is tied to the embedding
    return model.eval()


def test_drafts_are_the_first_layers_greedy_tokens(tokenizer, monkeypatch):
    config, state = lively(3)
    drafts: list[tuple[list[int], list[int]]] = []
    verify = paged_module.verify

    def recording(logits, draft, params, generator):
        out = verify(logits, draft, params, generator)
        drafts.append((list(draft), out[0]))
        return out

    monkeypatch.setattr(paged_module, "verify", recording)
    engine = _engine((config, state), tokenizer, speculative="early_exit", early_exit_layers=1)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    out = engine.generate([GenerationRequest(prompt_token_ids=LOOP, params=params)])[0].completions[0]
    head = _truncated_hf(config, state, 1)
    context = LOOP + out.token_ids[:1]  # the first token comes from the prefill, then each step verifies
    for draft, emitted in drafts:
        want = []
        with torch.inference_mode():
            for _ in draft:
                want.append(int(head(torch.tensor([context + want])).logits[0, -1].argmax()))
        assert draft == want
        context += emitted
    # the steps verified every token but the last ones, decoded plainly once no room for a draft is left
    assert context == (LOOP + out.token_ids)[: len(context)] and len(drafts) >= 3


def test_greedy_with_early_exit_drafts_is_greedy_without_them(tokenizer):
    model = lively(3)
    prompts = [LOOP, list(range(100, 140))]
    reqs = [
        GenerationRequest(
            prompt_token_ids=p, params=SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
        )
        for p in prompts
        for m in (1, 30)
    ]
    plain = _engine(model, tokenizer).generate(reqs)
    spec = _engine(model, tokenizer, speculative="early_exit", early_exit_layers=1, speculative_max_batch=64)
    got = spec.generate(reqs)
    for a, b in zip(plain, got, strict=True):
        assert b.completions[0].token_ids == a.completions[0].token_ids
        assert b.completions[0].logprobs == pytest.approx(a.completions[0].logprobs, abs=1e-4)
    stats = spec.speculation_stats()
    assert stats["draft_tokens"] > 0 and 0 < stats["accepted_tokens"] < stats["draft_tokens"]


@pytest.mark.slow  # 30-70 s here: 300 completions, each verified on its own
def test_sampling_with_early_exit_drafts_keeps_the_distribution(tokenizer):
    """Two-sample chi-square on the second and third tokens of 300 seeded completions with and without
    early-exit drafts (p = 0.001 critical values, rare tokens pooled)."""
    model = lively(5, scale=1.0)  # unscaled, the first layer's guess is often the full model's
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True, n=300, seed=7)
    req = GenerationRequest(prompt_token_ids=LOOP, params=params)
    big = dict(num_blocks=2048, max_num_seqs=512)
    plain = _engine(model, tokenizer, **big).generate([req])[0]
    spec_engine = _engine(
        model, tokenizer, speculative="early_exit", early_exit_layers=1, speculative_max_batch=512, **big
    )
    spec = spec_engine.generate([req])[0]
    stats = spec_engine.speculation_stats()
    assert stats["accepted_tokens"] > 20 and stats["accepted_tokens"] < stats["draft_tokens"]
    for pos in (1, 2):
        assert_same_token_distribution(plain.completions, spec.completions, pos)


def test_early_exit_needs_fewer_layers_than_the_model(tokenizer):
    with pytest.raises(ValueError, match="early_exit_layers must be below the model's 2 layers, got 2"):
        _engine(lively(3), tokenizer, speculative="early_exit", early_exit_layers=2)
    with pytest.raises(ValueError, match="early_exit_layers must be a positive integer"):
        _engine(lively(3), tokenizer, speculative="early_exit", early_exit_layers=0)
