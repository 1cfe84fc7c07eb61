"""Quantized engine weights (int8, int4) and int8 K/V: kernel numerics, logits and greedy tokens close to the
float engine, the engine generating with each config, re-quantization on weight loads, and clear errors.

Tolerances are relative to the float logits' standard deviation (the scale that decides a token)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from posttrain.config import ConfigError, EngineConfig, load_config
from posttrain.engine.factory import make_engine
from posttrain.engine.model_runner import ModelRunner, PrefillChunk, StepBatch
from posttrain.engine.paged import PagedEngine
from posttrain.engine.quant import (
    Int4Linear,
    Int8Linear,
    Int8WeightOnlyLinear,
    dequantize_kv,
    quantize_kv,
    weight_quant_works,
)
from posttrain.engine.types import GenerationRequest, SamplingParams

from .helpers import random_prompts, tiny


def _row_rel_err(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (got.double() - ref).abs().amax(dim=1) / ref.abs().amax(dim=1)


def test_int8_linear_matches_float64_and_gives_each_token_its_own_scale():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 160, generator=g) * 0.05
    x = torch.randn(6, 160, generator=g)
    x[0] *= 50  # one loud token: with one scale per batch the quiet rows would lose ~7 bits
    ref = F.linear(x.double(), w.double())
    err = _row_rel_err(Int8Linear(w)(x), ref)
    assert float(err.max()) < 0.03, err
    alone = _row_rel_err(Int8Linear(w)(x[1:2]), ref[1:2])
    assert float(err[1]) < 2 * float(alone) + 0.01


def test_int8_linear_does_not_saturate():
    # every product at its maximum: a 16-bit-saturating integer GEMM returns about half of this
    w = torch.full((32, 256), 0.01)
    x = torch.ones(2, 256)
    got = Int8Linear(w)(x)
    assert torch.allclose(got, torch.full((2, 32), 2.56), rtol=1e-3)


def test_int4_linear_matches_float64_within_4_bit_error():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 128, generator=g) * 0.05
    x = torch.randn(3, 128, generator=g)
    ref = F.linear(x.double(), w.double())
    err = _row_rel_err(Int4Linear(w)(x), ref)
    assert float(err.max()) < 0.15, err  # 4 bits over ranges of 32 weights: ~0.07 measured
    assert float(err.max()) > 0.005  # and it really is 4-bit (not a float fallback)
    with pytest.raises(ValueError, match="divisible by 32"):
        Int4Linear(torch.randn(8, 48))


def test_int8_weight_only_linear_equals_its_dequantized_weights_in_bfloat16():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 128, generator=g) * 0.05
    x = torch.randn(5, 128, generator=g)
    lin = Int8WeightOnlyLinear(w)
    # the same function as a bf16 matmul against the int8 weights times their scales (hand-dequantized)
    deq = lin.weight.float() * lin.scale.float()[:, None]
    want = F.linear(x.bfloat16().double(), deq.double())
    got = lin(x)
    assert float(_row_rel_err(got, want).max()) < 0.02
    err = _row_rel_err(got, F.linear(x.double(), w.double()))
    assert 0.001 < float(err.max()) < 0.03, err  # 8 bits per weight (not a float fallback)
    assert lin.nbytes() == 64 * 128 + 2 * 64


def test_the_output_projection_takes_its_own_quantization():
    model = tiny("llama")
    mixed = _runner(model, weight_quant="int4", lm_head_quant="int8")
    assert isinstance(mixed.quantized[0]["wgu"], Int4Linear)
    assert isinstance(mixed.quantized_lm_head, Int8Linear)
    assert _runner(model, weight_quant="int4").quantized_lm_head.__class__ is Int4Linear
    assert _runner(model, weight_quant="int4", lm_head_quant="none").quantized_lm_head is None
    assert _runner(model, lm_head_quant="int8").quantized_lm_head is None  # no body quantization: none
    with pytest.raises(ValueError, match="lm_head_quant must be one of"):
        _runner(model, weight_quant="int4", lm_head_quant="fp8")
    with pytest.raises(ConfigError, match="engine.lm_head_quant"):
        load_config(overrides=["engine.quantize_lm_head=false"])


def test_weight_kernels_are_checked_on_this_machine():
    assert weight_quant_works("int8_weight_only", torch.device("cpu")) is None
    assert weight_quant_works("int8", torch.device("cpu")) is None
    assert weight_quant_works("int4", torch.device("cpu")) is None
    assert "CPU kernels only" in weight_quant_works("int8", torch.device("cuda"))


def test_kv_quantization_error_is_at_most_half_a_step():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 2, 16, generator=g) * torch.tensor([0.1, 10.0])[None, :, None]
    q, scale = quantize_kv(x)
    assert q.dtype == torch.int8 and scale.shape == (7, 2)
    back = dequantize_kv(q, scale, torch.float32)
    assert bool(((back - x).abs() <= scale[..., None] / 2 + 1e-6).all())
    assert torch.equal(dequantize_kv(*quantize_kv(torch.zeros(1, 1, 4)), torch.float32), torch.zeros(1, 1, 4))


def _runner(model, **kw) -> ModelRunner:
    config, state = model.config, model.state_dict()
    r = ModelRunner(config, state, num_blocks=64, max_model_len=256, **kw)
    r.allocate_kv_cache()
    return r


def _prefill_logits(runner: ModelRunner, prompt: list[int], split: int) -> torch.Tensor:
    """Logits of every position, prefilled as two chunks (the second attends to the first through the pool)."""
    bs = runner.block_size
    blocks = torch.arange(1, 1 + -(-len(prompt) // bs))
    out = []
    for start, end in ((0, split), (split, len(prompt))):
        pos = torch.arange(start, end)
        batch = StepBatch(
            input_ids=torch.tensor(prompt[start:end]),
            positions=pos,
            slot_mapping=blocks[pos // bs] * bs + pos % bs,
            decode_groups=[],
            prefills=[PrefillChunk(0, end - start, start, blocks[: -(-end // bs)])],
            logit_rows=torch.arange(end - start),
        )
        out.append(runner.forward(batch))
    return torch.cat(out)


# max and mean |logit - float logit| / std(float logits); measured on 3 prompts: int8 weights 0.06-0.09 and
# 0.009, int4 weights 0.67-0.73 and 0.08-0.09, int8 K/V 0.007-0.009 and 0.0005
@pytest.mark.parametrize(
    ("weight_quant", "kv", "max_tol", "mean_tol"),
    [
        ("int8", "auto", 0.15, 0.02),
        ("int8_weight_only", "auto", 0.15, 0.02),
        ("int4", "auto", 1.0, 0.15),
        ("none", "int8", 0.02, 0.002),
    ],
)
def test_quantized_logits_are_close_to_the_float_model(weight_quant, kv, max_tol, mean_tol):
    model = tiny("llama")
    prompt = random_prompts([40], seed=3, vocab=model.config.vocab_size)[0]
    ref = _prefill_logits(_runner(model), prompt, split=24)
    got = _prefill_logits(_runner(model, weight_quant=weight_quant, kv_cache_dtype=kv), prompt, split=24)
    diff = (got - ref).abs() / ref.std()
    assert float(diff.max()) < max_tol and float(diff.mean()) < mean_tol, (diff.max(), diff.mean())
    assert float(diff.mean()) > mean_tol / 100  # the quantized path ran
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.9


def test_forwards_above_weight_quant_max_rows_run_on_the_float_weights():
    """max_rows 16: a 16-row chunk runs quantized, chunks of more rows on the float weights."""
    model = tiny("llama")
    prompt = random_prompts([40], seed=3, vocab=model.config.vocab_size)[0]
    ref = _prefill_logits(_runner(model), prompt, split=16)
    int4 = _prefill_logits(_runner(model, weight_quant="int4"), prompt, split=16)
    hybrid_runner = _runner(model, weight_quant="int4", weight_quant_max_rows=16)
    hybrid = _prefill_logits(hybrid_runner, prompt, split=16)
    assert torch.equal(hybrid[:16], int4[:16]) and not torch.equal(hybrid[:16], ref[:16])
    # the second chunk attends to the first's (int4-computed) K/V, so it equals neither reference
    # exactly; its own rows' linears are float: closer to the float model than int4's are
    assert (hybrid[16:] - ref[16:]).abs().mean() < (int4[16:] - ref[16:]).abs().mean()
    # two chunks of 20 rows, both above the limit: the float model's logits exactly
    float_rows = _prefill_logits(_runner(model, weight_quant="int4", weight_quant_max_rows=16), prompt, 20)
    assert torch.equal(float_rows, _prefill_logits(_runner(model), prompt, split=20))
    with pytest.raises(ValueError, match="weight_quant_max_rows must be >= 0"):
        _runner(model, weight_quant="int4", weight_quant_max_rows=-1)


def _greedy(engine: PagedEngine, prompts: list[list[int]], steps: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    return [
        o.completions[0].token_ids for o in engine.generate([GenerationRequest(p, params) for p in prompts])
    ]


def _first_divergence_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Tokens generated before the two runs first differ, as a fraction of all (later ones see other text)."""
    same = 0
    for x, y in zip(a, b, strict=True):
        n = next((i for i, (s, t) in enumerate(zip(x, y, strict=True)) if s != t), len(x))
        same += n
    return same / sum(len(x) for x in a)


@pytest.mark.parametrize(
    ("dtype", "weight_quant", "kv", "min_agree"),
    [
        ("float32", "int8", "auto", 0.8),
        ("bfloat16", "int8", "int8", 0.8),
        ("float32", "int4", "auto", 0.6),
        ("float32", "none", "int8", 0.95),
    ],
)
def test_engine_generates_greedily_like_the_float_engine(tokenizer, dtype, weight_quant, kv, min_agree):
    model = tiny("llama")
    prompts = random_prompts([5, 30, 12, 50, 8, 21], seed=4, vocab=model.config.vocab_size)
    kw = dict(num_blocks=128, max_model_len=256)
    ref = _greedy(PagedEngine(model, tokenizer, dtype=dtype, **kw), prompts, 24)
    eng = PagedEngine(model, tokenizer, dtype=dtype, weight_quant=weight_quant, kv_cache_dtype=kv, **kw)
    got = _greedy(eng, prompts, 24)
    assert all(len(x) == 24 for x in got)
    assert _first_divergence_agreement(got, ref) >= min_agree


def test_int8_kv_staged_and_gathered_decode_agree(tokenizer):
    model = tiny("llama")
    prompts = random_prompts([5, 33, 17], seed=5, vocab=model.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = []
    for staging in (True, False):
        eng = PagedEngine(
            model, tokenizer, kv_cache_dtype="int8", decode_staging=staging, num_blocks=64, max_model_len=128
        )
        outs.append(eng.generate([GenerationRequest(p, params) for p in prompts]))
    for a, b in zip(*outs, strict=True):
        assert a.completions[0].token_ids == b.completions[0].token_ids
        lp_a, lp_b = torch.tensor(a.completions[0].logprobs), torch.tensor(b.completions[0].logprobs)
        assert torch.allclose(lp_a, lp_b, atol=1e-4)


def test_int8_kv_pool_is_about_half_of_bfloat16():
    model = tiny("llama")
    int8 = _runner(model, dtype="bfloat16", kv_cache_dtype="int8")
    bf16 = _runner(model, dtype="bfloat16")
    hd = model.config.hidden_size // model.config.num_attention_heads
    assert int8.kv_cache_bytes() / bf16.kv_cache_bytes() == pytest.approx((hd + 4) / (2 * hd))
    assert int8.k_cache.dtype == torch.int8


def test_weight_load_requantizes(tokenizer):
    a, b = tiny("llama", seed=0), tiny("llama", seed=1)
    prompts = random_prompts([9, 14], seed=6, vocab=a.config.vocab_size)
    kw = dict(weight_quant="int8", num_blocks=64, max_model_len=128)
    reloaded = PagedEngine(a, tokenizer, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    before = reloaded.generate([GenerationRequest(p, params) for p in prompts])
    reloaded.load_weights(b.state_dict())
    fresh = PagedEngine(b, tokenizer, **kw)
    got = reloaded.generate([GenerationRequest(p, params) for p in prompts])
    want = fresh.generate([GenerationRequest(p, params) for p in prompts])
    for x, y in zip(got, want, strict=True):
        assert x.completions[0].token_ids == y.completions[0].token_ids
        assert x.completions[0].logprobs == y.completions[0].logprobs
    assert [o.completions[0].logprobs for o in got] != [o.completions[0].logprobs for o in before]


def test_quantized_weights_are_smaller():
    model = tiny("llama")
    fp32 = _runner(model).weight_bytes()
    assert _runner(model, weight_quant="int8").weight_bytes() < 0.27 * fp32
    assert _runner(model, weight_quant="int4").weight_bytes() < 0.17 * fp32
    assert (
        _runner(model, weight_quant="int8", lm_head_quant="none").weight_bytes()
        > _runner(model, weight_quant="int8").weight_bytes()
    )


def test_config_selects_the_quantized_engine(tokenizer):
    cfg = load_config(overrides=["engine.weight_quant=int8", "engine.kv_cache_dtype=int8"])
    eng = make_engine(cfg.engine, tiny("llama"), tokenizer)
    assert eng.runner.weight_quant == "int8" and eng.runner.kv_int8


@pytest.mark.parametrize(("key", "value"), [("weight_quant", "int3"), ("kv_cache_dtype", "fp8")])
def test_bad_config_value_names_the_key(key, value):
    with pytest.raises(ConfigError, match=key):
        load_config(overrides=[f"engine.{key}={value}"])
    assert EngineConfig().weight_quant == "none"


def test_bad_runner_arguments_are_clear_errors():
    model = tiny("llama")
    with pytest.raises(ValueError, match="weight_quant must be one of"):
        _runner(model, weight_quant="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        _runner(model, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="CPU kernels only.*use weight_quant 'none'"):
        ModelRunner(model.config, model.state_dict(), weight_quant="int8", device="meta")
