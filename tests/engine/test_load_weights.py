"""The paged engine's `load_weights`: oneDNN-packed weights rewritten in place, the engine's weights after a
full or LoRA-merged load exactly the pushed ones, and its greedy output a freshly built engine's."""

from __future__ import annotations

import pytest
import torch

import posttrain.orchestrator.rl.weight_sync as ws
from engine.helpers import random_prompts, tiny
from posttrain.engine import GenerationRequest, PagedEngine, SamplingParams
from posttrain.engine.model_runner import onednn_packing_works
from posttrain.engine.onednn import PackedWeight, find_layout, pack
from posttrain.models import load_policy, wrap_lora

needs_onednn = pytest.mark.skipif(
    not onednn_packing_works(torch.device("cpu"), torch.float32), reason="oneDNN packing does not run here"
)


def _linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(128, 64), (192, 64), (64, 128), (100, 70)])
def test_a_refreshed_packed_weight_is_onednns_packing_of_the_new_weight(dtype, shape):
    gen = torch.Generator().manual_seed(1)
    old, new = (torch.randn(*shape, generator=gen).to(dtype) for _ in range(2))
    weight = PackedWeight(old)
    padded = shape == (100, 70)  # oneDNN pads it to whole blocks: not the in-place layout
    assert weight.in_place is (not padded) and (find_layout(*shape, dtype) is None) is padded
    before = weight.tensor
    weight.refresh(new)
    assert (weight.tensor is before) is (not padded)  # the same packed tensor, rewritten
    assert torch.equal(weight.tensor.to_dense(), new)
    x = torch.randn(5, shape[1], generator=gen).to(dtype)
    assert torch.equal(_linear(x, weight.tensor), _linear(x, pack(new)))


def _greedy(engine: PagedEngine, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and their logprobs (tiny random models often repeat a token; the
    logprobs still tell two sets of weights apart)."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = engine.generate([GenerationRequest(p, params) for p in prompts])
    return [(o.completions[0].token_ids, o.completions[0].logprobs) for o in outs]


def _assert_engine_holds(engine: PagedEngine, weights: dict[str, torch.Tensor]) -> None:
    """Every pushed tensor is exactly in the engine (its fused slice), every packed copy is its dense weight."""
    runner = engine.runner
    for name, tensor in weights.items():
        found = runner.weight_for(name.removeprefix("base_model.model."))
        if found is not None:
            assert torch.equal(found[0], tensor.to(runner.dtype)), name
    packed = runner.packed_weights()
    assert bool(packed) is (runner.packed is not None)
    for name, dense, weight in packed:
        assert torch.equal(weight.tensor.to_dense(), dense), name


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen2_moe", "olmoe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_full_load_holds_the_pushed_weights_and_generates_as_a_fresh_engine(tokenizer, family, dtype):
    old = load_policy(f"tiny:{family}", seed=0, dtype=dtype)
    new = load_policy(f"tiny:{family}", seed=1, dtype=dtype)
    prompts = random_prompts([5, 19, 33], seed=3)
    engine = PagedEngine(old, tokenizer, dtype=dtype, block_size=8, num_blocks=64)
    before = _greedy(engine, prompts)
    weights = {k: v.detach() for k, v in new.state_dict().items()}
    engine.load_weights(weights, version=3)
    _assert_engine_holds(engine, weights)
    fresh = PagedEngine(new, tokenizer, dtype=dtype, block_size=8, num_blocks=64)
    assert _greedy(engine, prompts) == _greedy(fresh, prompts) != before
    if dtype == "float32":  # every tiny shape takes the in-place layout
        assert all(weight.in_place for _, _, weight in engine.runner.packed_weights())


def test_a_partial_load_refreshes_only_the_packed_weights_it_touches(tokenizer):
    engine = PagedEngine(tiny("llama", 0), tokenizer, num_blocks=16)
    if engine.runner.packed is None:
        pytest.skip("oneDNN packing does not run here")
    new = tiny("llama", 1).state_dict()
    name = "model.layers.1.mlp.up_proj.weight"
    engine.load_weights({name: new[name]})
    _assert_engine_holds(engine, {name: new[name]})
    old = tiny("llama", 0).state_dict()
    untouched = {k: v for k, v in old.items() if ".layers.1.mlp.gate_proj" in k or ".layers.0." in k}
    _assert_engine_holds(engine, untouched)


def test_a_lora_merged_load_holds_the_merged_weights_and_generates_as_a_fresh_engine(tokenizer):
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = wrap_lora(
        load_policy("tiny:llama", seed=0), rank=4, alpha=8.0, dropout=0.0, target_modules=targets
    )
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # non-zero B: a real delta
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    base_model = load_policy("tiny:llama", seed=0)
    engine = PagedEngine(base_model, tokenizer, block_size=8, num_blocks=64)
    receiver = ws.Receiver(engine, base=ws.lora_base(lora))
    update = ws.lora_update(lora, 1)
    pushed = receiver._merged(update)
    assert receiver.apply(update)
    _assert_engine_holds(engine, pushed)
    state = {k: v.detach().clone() for k, v in base_model.state_dict().items()}
    state.update({k.removeprefix("base_model.model."): v for k, v in pushed.items()})
    fresh = PagedEngine((base_model.config, state), tokenizer, block_size=8, num_blocks=64)
    prompts = random_prompts([7, 26], seed=4)
    assert _greedy(engine, prompts) == _greedy(fresh, prompts)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_released_weights_hold_no_memory_refuse_requests_and_come_back_whole(tokenizer, dtype):
    model = load_policy("tiny:qwen2", seed=0, dtype=dtype)  # q/k/v biases: fused slices of their own
    prompts = random_prompts([6, 21], seed=6)
    engine = PagedEngine(model, tokenizer, dtype=dtype, block_size=8, num_blocks=64)
    before = _greedy(engine, prompts)
    held = engine.runner.weight_storage_bytes()
    dense = sum(v.numel() * v.element_size() for k, v in model.state_dict().items() if k != "lm_head.weight")
    assert held >= dense
    engine.release_weights()
    assert engine.runner.weight_storage_bytes() == 0 and engine.runner.k_cache is None
    assert all(t.untyped_storage().nbytes() == 0 for t in engine.runner.weight_tensors())
    with pytest.raises(RuntimeError, match="weights are released"):
        _greedy(engine, prompts)
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    partial = {k: v for k, v in weights.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match=r"weights were released.*model\.norm\.weight"):
        engine.load_weights(partial)
    assert engine.runner.weight_storage_bytes() == 0  # a failed load leaves them released
    with pytest.raises(RuntimeError, match="weights are released"):
        _greedy(engine, prompts)
    engine.load_weights(weights, version=2)
    assert engine.runner.weight_storage_bytes() == held and engine.version == 2
    _assert_engine_holds(engine, weights)
    assert _greedy(engine, prompts) == before


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_weights_are_released_and_rebuilt_by_the_next_load(tokenizer, quant):
    from posttrain.engine.quant import weight_quant_works

    if weight_quant_works(quant, torch.device("cpu")) is not None:
        pytest.skip(f"{quant} kernels do not run here")
    model = tiny("llama", 0)
    prompts = random_prompts([9, 17], seed=7)
    engine = PagedEngine(model, tokenizer, block_size=8, num_blocks=64, weight_quant=quant)
    before = _greedy(engine, prompts)
    held = engine.runner.weight_storage_bytes()
    engine.release_weights()
    assert engine.runner.weight_storage_bytes() == 0 and engine.runner.quantized is None
    engine.load_weights(model.state_dict())
    assert engine.runner.weight_storage_bytes() == held
    assert _greedy(engine, prompts) == before
