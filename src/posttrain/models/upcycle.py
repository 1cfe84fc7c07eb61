"""Sparse upcycling: a dense Llama/Mistral (or Qwen3) model turned into a Mixtral (or Qwen3-MoE) model
whose every expert is a copy of the dense MLP.

The router is initialised with small seeded noise, so tokens spread over the experts, and the top-k
weights are renormalised to sum to 1: a weighted sum of identical experts is the dense MLP, so the
upcycled model computes the dense model's function at initialisation (to float rounding). Optional
noise on the expert copies (`expert_noise` > 0) breaks that equality on purpose. Does not train.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from posttrain.models.loading import load_policy, load_tokenizer
from posttrain.models.text import quiet_transformers, save_hf_folder_atomically

UPCYCLE_TARGETS = {"llama": "mixtral", "mistral": "mixtral", "qwen3": "qwen3_moe"}
_DROP = ("architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "mlp_bias")


def upcycled_config(dense: Any, experts: int, top_k: int) -> Any:
    """The MoE config of `dense`'s architecture with `experts` experts of the dense MLP's size, top `top_k`."""
    from transformers import AutoConfig

    mt = getattr(dense, "model_type", None)
    if mt not in UPCYCLE_TARGETS:
        raise ValueError(f"upcycling supports dense model types {sorted(UPCYCLE_TARGETS)}, got '{mt}'")
    if experts < 2:
        raise ValueError(f"--experts must be >= 2 (one expert is the dense model), got {experts}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"--top-k must be in [1, experts={experts}], got {top_k}")
    if getattr(dense, "mlp_bias", False) or getattr(dense, "hidden_act", "silu") != "silu":
        raise ValueError("upcycling needs a bias-free SwiGLU MLP (hidden_act 'silu', mlp_bias false)")
    if mt != "qwen3" and getattr(dense, "attention_bias", False):
        raise ValueError("Mixtral has no attention bias; this model's attention_bias is true")
    kw = {k: v for k, v in dense.to_dict().items() if k not in _DROP}
    kw["num_experts_per_tok"] = top_k
    target = UPCYCLE_TARGETS[mt]
    if target == "mixtral":
        kw.update(num_local_experts=experts, sliding_window=None)
    else:
        kw.update(
            num_experts=experts,
            moe_intermediate_size=dense.intermediate_size,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return AutoConfig.for_model(target, **kw)


@torch.no_grad()
def upcycle(
    dense_model: Any,
    experts: int,
    top_k: int,
    router_std: float = 0.02,
    expert_noise: float = 0.0,
    seed: int = 0,
) -> Any:
    """The upcycled MoE model (float32, eval mode) of a transformers dense causal LM."""
    from transformers import AutoModelForCausalLM

    if router_std < 0 or expert_noise < 0:
        raise ValueError(f"router_std and expert_noise must be >= 0, got {router_std} and {expert_noise}")
    config = upcycled_config(dense_model.config, experts, top_k)
    with quiet_transformers():
        moe = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    state = {k: v.float() for k, v in dense_model.state_dict().items()}
    target = moe.state_dict()
    out: dict[str, torch.Tensor] = {}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.mlp."
        gate_up = torch.cat([state.pop(p + "gate_proj.weight"), state.pop(p + "up_proj.weight")])
        down = state.pop(p + "down_proj.weight")
        gu = gate_up.expand(experts, *gate_up.shape).clone()
        dn = down.expand(experts, *down.shape).clone()
        if expert_noise > 0:  # breaks the equality with the dense model (relative to each weight's std)
            gu += torch.randn(gu.shape, generator=g) * expert_noise * gate_up.std()
            dn += torch.randn(dn.shape, generator=g) * expert_noise * down.std()
        out[p + "experts.gate_up_proj"] = gu
        out[p + "experts.down_proj"] = dn
        out[p + "gate.weight"] = torch.randn(experts, config.hidden_size, generator=g) * router_std
    out.update(state)
    missing = set(target) - set(out) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    unexpected = set(out) - set(target)
    if missing or unexpected:
        raise ValueError(
            f"cannot map the dense weights onto {config.model_type}: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}"
        )
    moe.load_state_dict(out, strict=False)
    if config.tie_word_embeddings:
        moe.tie_weights()
    return moe.eval()


def upcycle_to_folder(
    spec: str,
    out: str | Path,
    experts: int,
    top_k: int,
    router_std: float = 0.02,
    expert_noise: float = 0.0,
    seed: int = 0,
) -> tuple[Path, Any]:
    """Upcycle the model `spec` and save it (with its tokenizer) as an HF folder at `out`, atomically."""
    dense = load_policy(spec, dtype="float32", seed=seed)
    moe = upcycle(dense, experts, top_k, router_std, expert_noise, seed)
    with quiet_transformers():
        path = save_hf_folder_atomically(moe, load_tokenizer(spec), Path(out))
    return path, moe
