"""The paged engine's MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) against transformers (greedy tokens identical, logprobs within 1e-4),
sparse expert execution against the dense all-experts computation masked by the router, the families'
routing rules, OLMoE's whole-projection q/k norm and clip_qkv, the int8 weight mode, and the expert
choices recorded per token."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from posttrain.engine import GenerationRequest, PagedEngine, SamplingParams
from posttrain.engine.moe import MoeSpec, dense_experts, route, sparse_experts
from posttrain.models import load_policy

from .helpers import hf_greedy, hf_logprobs, random_prompts, tiny

MOE_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def _greedy_matches_hf(model, tokenizer, prompts, tol: float, max_tokens: int = 16, **engine_kw):
    """(engine, greedy completions of `prompts`), checked: tokens equal to HF `generate`'s, logprobs within
    `tol` of HF's full-sequence forward."""
    engine = PagedEngine(model, tokenizer, block_size=4, **engine_kw)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    comps = [o.completions[0] for o in engine.generate([GenerationRequest(p, params) for p in prompts])]
    for prompt, comp in zip(prompts, comps, strict=True):
        assert comp.token_ids == hf_greedy(model, prompt, max_tokens)
        ref = hf_logprobs(model, prompt, comp.token_ids)
        assert max(abs(a - b) for a, b in zip(ref, comp.logprobs, strict=True)) <= tol
    return engine, comps


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_greedy_and_logprobs_match_hf(family, tokenizer):
    _greedy_matches_hf(tiny(family), tokenizer, random_prompts([1, 4, 5, 17], seed=1), 1e-4, num_blocks=128)


def test_qwen2_moe_layout_dense_layer_shared_expert_and_no_renormalisation():
    spec = MoeSpec.from_hf_config(tiny("qwen2_moe").config)
    assert spec is not None
    assert spec.sparse_layers == (False, True)  # decoder_sparse_step 2: layer 0 is a dense MLP
    assert spec.shared_intermediate_size == 96 and not spec.norm_topk_prob
    assert MoeSpec.from_hf_config(tiny("llama").config) is None


def test_olmoe_layout_every_layer_sparse_no_shared_expert_no_renormalisation():
    spec = MoeSpec.from_hf_config(tiny("olmoe").config)
    assert spec == MoeSpec(8, 2, 64, False, False, 0, (True, True))


def _olmoe_with_norm_weights(clip: float | None):
    """tiny:olmoe with random q/k norm weights (init leaves them 1) and `clip_qkv` set to `clip`."""
    model = copy.deepcopy(tiny("olmoe"))
    model.config.clip_qkv = clip
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=g))
    return model


def _outputs_of(model, ids: list[int], modules: list[torch.nn.Module]) -> list:
    """Each module's output (tensors copied: transformers may change them in place afterwards) in a full
    forward of `ids`, in the order of `modules`; each must run once."""
    seen: dict[int, object] = {}

    def keep(m, _args, out):
        seen[id(m)] = out.detach().clone() if isinstance(out, torch.Tensor) else out

    hooks = [m.register_forward_hook(keep) for m in modules]
    try:
        with torch.inference_mode():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return [seen[id(m)] for m in modules]


def _clipped_fraction(model, ids: list[int]) -> dict[str, float]:
    """Share of layer 0's normed q, normed k and v entries whose magnitude exceeds clip_qkv (before the clamp)."""
    attn, clip = model.model.layers[0].self_attn, model.config.clip_qkv
    outs = _outputs_of(model, ids, [attn.q_norm, attn.k_norm, attn.v_proj])
    return {n: float((t.abs() > clip).float().mean()) for n, t in zip("qkv", outs, strict=True)}


@pytest.mark.parametrize("clip", [None, 0.3])
def test_olmoe_whole_projection_qk_norm_and_clip_qkv_match_hf(clip, tokenizer):
    """q/k RMSNorm over all heads at once with non-trivial weights; with clip 0.3 each of q, k and v has
    entries beyond the clip, and clipping moves transformers' logprobs by far more than the 1e-4 the
    engine is held to, so an engine that skipped any clamp (or normed per head) would fail here."""
    model = _olmoe_with_norm_weights(clip)
    prompts = random_prompts([3, 11], seed=12)
    engine, comps = _greedy_matches_hf(model, tokenizer, prompts, 1e-4, num_blocks=64)
    assert engine.runner.spec.qk_norm_proj and engine.runner.spec.clip_qkv == clip
    if clip is not None:
        prompt, completion = prompts[1], comps[1].token_ids
        frac = _clipped_fraction(model, prompt + completion)
        assert all(f > 0.01 for f in frac.values()), frac
        clipped = hf_logprobs(model, prompt, completion)
        unclipped = hf_logprobs(_olmoe_with_norm_weights(None), prompt, completion)
        gap = max(abs(a - b) for a, b in zip(clipped, unclipped, strict=True))
        assert gap > 1e-2, gap


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe"])
def test_bfloat16_greedy_matches_hf_bfloat16(family, tokenizer):
    model = load_policy(f"tiny:{family}", dtype="bfloat16")
    prompts = random_prompts([5, 13], seed=3)
    # within one bfloat16 step of a logit near 1 (2^-8 = 0.0039): an expert's bf16 matmul over one
    # decode row and transformers' over all the sequence's rows routed to it round differently
    _greedy_matches_hf(model, tokenizer, prompts, 2**-8 + 1e-6, 10, dtype="bfloat16", num_blocks=64)


@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_int8_weights_quantize_every_expert_and_stay_close(family, tokenizer):
    model = tiny(family)
    prompts = random_prompts([6, 20], seed=4)
    ref_engine = PagedEngine(model, tokenizer, num_blocks=64)
    eng = PagedEngine(model, tokenizer, weight_quant="int8", num_blocks=64)
    layer_q = eng.runner.quantized[0]
    E = ref_engine.runner.spec.moe.num_experts
    assert {f"gu.{e}" for e in range(E)} | {f"d.{e}" for e in range(E)} <= set(layer_q)
    assert "router" not in layer_q  # routing stays float
    float_bytes, int8_bytes = ref_engine.runner.weight_bytes(), eng.runner.weight_bytes()
    assert int8_bytes < 0.3 * float_bytes
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = ref_engine.generate([GenerationRequest(p, params) for p in prompts])
    got = eng.generate([GenerationRequest(p, params) for p in prompts])
    for r, g, prompt in zip(ref, got, prompts, strict=True):
        # the int8 logprobs of the tokens it chose, against the float model's of the same tokens
        float_lp = hf_logprobs(model, prompt, g.completions[0].token_ids)
        assert max(abs(a - b) for a, b in zip(float_lp, g.completions[0].logprobs, strict=True)) < 0.1
        assert g.completions[0].token_ids[:3] == r.completions[0].token_ids[:3]


def _random_moe(T: int = 9, E: int = 5, k: int = 2, H: int = 16, inter: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(T, H, generator=g),
        torch.randn(E, H, generator=g),
        torch.randn(E, 2 * inter, H, generator=g) * 0.3,
        torch.randn(E, H, inter, generator=g) * 0.3,
    )


@pytest.mark.parametrize("norm", [True, False])
def test_sparse_experts_equal_dense_all_experts_masked_by_the_router(norm):
    h, router, gate_up, down = _random_moe()
    spec = MoeSpec(5, 2, 8, norm, True, 0, (True,))
    weights, ids = route(F.linear(h, router), spec)
    calls: list[tuple[int, str, int]] = []

    def linear(e: int, which: str, rows: torch.Tensor) -> torch.Tensor:
        calls.append((e, which, rows.shape[0]))
        return F.linear(rows, gate_up[e] if which == "gu" else down[e])

    got = sparse_experts(h, weights, ids, 5, linear)
    want = dense_experts(h, weights, ids, gate_up, down)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # sparse: one gate/up and one down matmul per selected expert, over exactly its tokens
    counts = torch.bincount(ids.flatten(), minlength=5).tolist()
    used = [e for e in range(5) if counts[e]]
    assert [(e, w) for e, w, _ in calls] == [(e, w) for e in used for w in ("gu", "d")]
    assert sum(n for _, w, n in calls if w == "gu") == 9 * 2  # T x top_k rows, not T x experts


def test_route_hand_computed():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    probs = torch.softmax(logits, -1)[0]
    renorm = MoeSpec(4, 2, 8, True, True, 0, (True,))
    w, ids = route(logits, renorm)
    assert ids.tolist() == [[2, 1]]
    torch.testing.assert_close(w[0], torch.stack([probs[2], probs[1]]) / (probs[2] + probs[1]))
    raw = MoeSpec(4, 2, 8, False, False, 0, (True,))
    w, ids = route(logits, raw)
    torch.testing.assert_close(w[0], torch.stack([probs[2], probs[1]]))


def _hf_routing(model, ids: list[int]) -> list[list[list[int]]]:
    """transformers' own top-k choice at every position of a full forward, [position][layer][k]."""
    from posttrain.train.moe import routers

    outs = _outputs_of(model, ids, routers(model))
    return torch.stack([out[2] for out in outs], dim=1).tolist()


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_recorded_routing_is_transformers_choice_and_survives_prefix_cache_hits(family, tokenizer):
    model = tiny(family)
    prompt = random_prompts([13], seed=8)[0]  # 3 full blocks of 4, then a partial one
    engine = PagedEngine(model, tokenizer, block_size=4, num_blocks=64)
    first = engine.generate([GenerationRequest(prompt, GREEDY)])[0].completions[0]
    ids = prompt + first.token_ids
    want = _hf_routing(model, ids[:-1])
    assert first.routing is not None and len(first.routing) == len(ids) - 1
    # a choice can only differ on a float near-tie; none in this draw: equal as sets per layer
    assert [[sorted(x) for x in pos] for pos in first.routing] == [[sorted(x) for x in p] for p in want]
    # the same prompt again: its 3 full blocks come from the prefix cache, their routing from the cache too
    second = engine.generate([GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=3))])[0]
    assert engine.kv_stats()["prefix_hit_tokens"] == 12
    assert second.completions[0].routing == first.routing[: len(prompt) + 2]
    # forked samples of one prefill each get the shared prompt's routing
    out = engine.generate(
        [GenerationRequest(prompt, SamplingParams(temperature=1.0, max_tokens=4, n=3, seed=1))]
    )
    assert all(c.routing[: len(prompt)] == first.routing[: len(prompt)] for c in out[0].completions)
    assert (
        PagedEngine(tiny("llama"), tokenizer, num_blocks=16)
        .generate([GenerationRequest(prompt, GREEDY)])[0]
        .completions[0]
        .routing
        is None
    )  # a dense model records nothing
