"""RoPE scaling: the engine's logits equal transformers' for a scaled model at positions beyond the trained
window (each scaling type), the Learner's logprobs equal the engine's, packing keeps dynamic NTK per
sequence, and bad scaling configs are refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from engine.helpers import hf_logprobs, random_prompts, tiny
from posttrain.config import (
    AlgorithmConfig,
    ConfigError,
    ModelConfig,
    RopeScaling,
    TrainerConfig,
    load_config,
)
from posttrain.engine import GenerationRequest, PagedEngine, SamplingParams
from posttrain.longctx.rope import apply_rope_scaling, scaled_parameters
from posttrain.train import Learner, Sample

WINDOW = 48  # the tiny model's trained window, for the test; prompts run well past it
SCALINGS = {
    "linear": RopeScaling(type="linear", factor=4.0),
    "dynamic": RopeScaling(type="dynamic", factor=4.0),
    "yarn": RopeScaling(type="yarn", factor=4.0, beta_fast=16.0),
    "llama3": RopeScaling(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0),
}
NEW = 6


def _windowed():
    model = copy.deepcopy(tiny("llama"))
    model.config.max_position_embeddings = WINDOW
    model.model.rotary_emb = LlamaRotaryEmbedding(config=model.config)
    with torch.no_grad():  # sharper attention than the random init's, so positions move the logits
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(10.0)
            layer.self_attn.k_proj.weight.mul_(10.0)
    return model


def _transformers_scaled(scaling: RopeScaling):
    """The reference: transformers' own rotary module over the scaled rope_parameters."""
    model = _windowed()
    model.config.rope_parameters = scaled_parameters(model.config, scaling)
    model.model.rotary_emb = LlamaRotaryEmbedding(config=model.config)
    return model


@torch.inference_mode()
def _hf_generate(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from transformers' generate (one forward over the prompt, then
    one token at a time over the KV cache)."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=NEW,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    lps = [float(torch.log_softmax(lg[0].float(), -1)[t]) for lg, t in zip(out.logits, tokens, strict=True)]
    return tokens, lps


def _engine_generate(model, tokenizer, prompts):
    engine = PagedEngine(model, tokenizer, block_size=16, num_blocks=96)
    outs = engine.generate(
        [GenerationRequest(p, SamplingParams(temperature=0.0, max_tokens=NEW)) for p in prompts]
    )
    return [(o.completions[0].token_ids, o.completions[0].logprobs) for o in outs]


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_engine_equals_transformers_past_the_window(kind, tokenizer):
    scaling = SCALINGS[kind]
    prompts = random_prompts([30, 3 * WINDOW + 5], seed=7)  # one inside the window, one 3x past it
    model = apply_rope_scaling(_windowed(), scaling)
    reference = _transformers_scaled(scaling)
    got = _engine_generate(model, tokenizer, prompts)
    for prompt, (tokens, lps) in zip(prompts, got, strict=True):
        ref_tokens, ref_lps = _hf_generate(reference, prompt)
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)) < 1e-4
        if kind != "dynamic":  # static scalings: also equal to one full forward over the whole sequence
            full = hf_logprobs(reference, prompt, tokens)
            assert max(abs(a - b) for a, b in zip(lps, full, strict=True)) < 1e-4
    # the scaling took effect: past the window the unscaled model's logits are different
    with torch.inference_mode():
        scaled, plain = (m(torch.tensor(prompts[1:])).logits[0, -1] for m in (reference, _windowed()))
    assert float((scaled - plain).abs().max()) > 1e-2
    if kind == "dynamic":  # inside the window dynamic NTK is the plain RoPE
        assert _engine_generate(_windowed(), tokenizer, prompts[:1])[0][1] == pytest.approx(
            got[0][1], abs=1e-5
        )


@pytest.mark.parametrize("kind", ["linear", "yarn", "llama3", "dynamic"])
def test_learner_logprobs_equal_the_engine_s_and_transformers(kind, tokenizer):
    scaling = SCALINGS[kind]
    prompts = random_prompts([2 * WINDOW + 3, 20], seed=9)
    model = apply_rope_scaling(_windowed(), scaling)
    got = _engine_generate(model, tokenizer, prompts)
    samples = [
        Sample(p + toks, [0] * len(p) + [1] * len(toks), [0.0] * len(p) + lps, 1.0, 0)
        for p, (toks, lps) in zip(prompts, got, strict=True)
    ]
    learner = Learner(
        ModelConfig(spec="tiny:llama", rope_scaling=scaling),
        TrainerConfig(packing=True),
        AlgorithmConfig(),
        model=model,
    )
    lp = learner.compute_logprobs(samples)
    reference = _transformers_scaled(scaling)
    for i, (p, (toks, lps)) in enumerate(zip(prompts, got, strict=True)):
        mine = lp[i, len(p) : len(p) + len(toks)].tolist()
        # a full forward of each sequence alone, by transformers (dynamic: the length of that sequence)
        assert mine == pytest.approx(hf_logprobs(reference, p, toks), abs=1e-4)
        if kind != "dynamic":
            assert mine == pytest.approx(lps, abs=1e-4)
    if kind == "dynamic":
        # the engine decodes token t with the frequencies of length t + 1, the Learner scores the whole
        # sequence with those of its final length, as transformers' generate and forward differ
        assert (
            max(abs(a - b) for a, b in zip(lp[0, len(prompts[0]) :].tolist(), got[0][1], strict=True)) > 1e-4
        )


def test_a_learner_given_an_unscaled_model_with_rope_scaling_set_is_refused():
    with pytest.raises(ValueError, match="model.rope_scaling asks for"):
        Learner(
            ModelConfig(spec="tiny:llama", rope_scaling=SCALINGS["yarn"]),
            TrainerConfig(),
            AlgorithmConfig(),
            model=_windowed(),
        )
    with pytest.raises(ValueError, match="already uses RoPE scaling 'linear'"):
        apply_rope_scaling(apply_rope_scaling(_windowed(), SCALINGS["linear"]), SCALINGS["yarn"])


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "model.rope_scaling={type: linear, factor: 4, beta_fast: 8}",
            "\\['beta_fast'\\] do not apply to rope type 'linear'",
        ),
        ("model.rope_scaling={type: ntk, factor: 4}", "'model.rope_scaling.type'"),
        ("model.rope_scaling={type: yarn, factor: 1}", "'model.rope_scaling.factor'"),
        ("model.rope_scaling={type: yarn, factor: 2, beta_fast: 1, beta_slow: 2}", "beta_fast > beta_slow"),
        (
            "model.rope_scaling={type: llama3, factor: 2, low_freq_factor: 4}",
            "high_freq_factor > low_freq_factor",
        ),
    ],
)
def test_bad_rope_scaling_is_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_rope_scaling_sets_transformers_rope_parameters():
    cfg = load_config(
        None, ["model.rope_scaling={type: yarn, factor: 4, original_max_position_embeddings: 8192}"]
    )
    model = _windowed()
    assert scaled_parameters(model.config, cfg.model.rope_scaling) == {
        "rope_type": "yarn",
        "rope_theta": float(model.config.rope_parameters["rope_theta"]),
        "factor": 4.0,
        "original_max_position_embeddings": 8192,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }


def test_packing_that_would_leave_each_sequence_alone_keeps_the_2d_mask():
    from posttrain.train.batch import make_inputs

    ids = torch.arange(30).view(3, 10)
    alone = make_inputs(ids, torch.tensor([10, 6, 5]), packed=True)  # 6 + 5 > 10: no row shared
    assert alone.attention_mask.dim() == 2 and alone.input_ids.shape == (3, 10)
    assert torch.equal(alone.attention_mask.sum(1), torch.tensor([10, 6, 5]))
    shared = make_inputs(ids, torch.tensor([10, 5, 5]), packed=True)  # 5 + 5 fit one row
    assert shared.attention_mask.dim() == 4 and shared.input_ids.shape == (2, 10)
