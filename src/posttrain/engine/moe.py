"""Mixture-of-Experts layers of the paged engine: the families' routing rules and sparse expert execution.

Owns `MoeSpec` (which layers are sparse, experts, top-k, renormalisation, the shared expert) read from a
Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE config; `route` (softmax over the router logits, top-k, optional
renormalisation, exactly as transformers does it per family); `sparse_experts` (tokens grouped by
expert, one gate/up and one down matmul per selected expert) and `dense_experts` (every expert on every
token, masked by the router: the reference the sparse path is tested against). Does not hold weights
or run attention: model_runner.py does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")

# (expert index, "gu" | "d", rows) -> rows @ W^T: the runner's linear over that expert's weights
ExpertLinear = Callable[[int, str, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    float32_weights: bool  # Mixtral keeps the top-k weights in float32; Qwen and OLMoE cast them back
    shared_intermediate_size: int  # 0: no shared expert (Qwen2-MoE has one, behind a sigmoid gate)
    sparse_layers: tuple[bool, ...]  # per layer: an MoE block (True) or a dense MLP

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)

    @classmethod
    def from_hf_config(cls, config: Any) -> MoeSpec | None:
        """The MoE layout of a config, or None for a dense model type."""
        mt = getattr(config, "model_type", None)
        if mt not in MOE_MODEL_TYPES:
            return None
        layers = config.num_hidden_layers
        if mt in ("mixtral", "olmoe"):  # every layer sparse, no shared expert, intermediate_size an expert's
            return cls(
                num_experts=config.num_local_experts,  # OLMoE's config maps it to num_experts
                top_k=config.num_experts_per_tok,
                expert_intermediate_size=config.intermediate_size,
                norm_topk_prob=mt == "mixtral" or bool(config.norm_topk_prob),
                float32_weights=mt == "mixtral",
                shared_intermediate_size=0,
                sparse_layers=(True,) * layers,
            )
        step = config.decoder_sparse_step
        dense = set(config.mlp_only_layers or [])
        sparse = tuple(
            i not in dense and config.num_experts > 0 and (i + 1) % step == 0 for i in range(layers)
        )
        return cls(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            expert_intermediate_size=config.moe_intermediate_size,
            norm_topk_prob=bool(config.norm_topk_prob),
            float32_weights=False,
            shared_intermediate_size=config.shared_expert_intermediate_size if mt == "qwen2_moe" else 0,
            sparse_layers=sparse,
        )


def route(router_logits: torch.Tensor, spec: MoeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k weights `[T, k]`, expert ids `[T, k]`) from router logits `[T, E]`: softmax in float32,
    top-k, renormalised to sum 1 when the family does (the Learner's replay of recorded choices is
    train/moe.py's, on transformers' routers)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not spec.float32_weights:
        weights = weights.to(router_logits.dtype)
    return weights, ids


def sparse_experts(
    h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int, linear: ExpertLinear
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(h[t]), computing each expert on its tokens only.

    Experts run in increasing index order and add into a zero output, as transformers' loop does, so a
    token's sum is formed in the same order."""
    T, k = ids.shape
    out = torch.zeros_like(h)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    token_of = order // k
    slot_of = order % k
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = token_of[start : start + n]
        w = weights[rows, slot_of[start : start + n]]
        start += n
        gate, up = linear(e, "gu", h.index_select(0, rows)).chunk(2, dim=-1)
        y = linear(e, "d", F.silu(gate) * up) * w[:, None]
        out.index_add_(0, rows, y.to(out.dtype))
    return out


def dense_experts(
    h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Every expert on every token (`gate_up [E, 2I, H]`, `down [E, H, I]`), combined with the router's
    weights scattered over all experts (0 for the unselected): the reference for `sparse_experts`."""
    E = gate_up.shape[0]
    combine = torch.zeros(h.shape[0], E, dtype=weights.dtype, device=h.device).scatter(1, ids, weights)
    gate, up = torch.einsum("th,eih->eti", h, gate_up).chunk(2, dim=-1)
    y = torch.einsum("eti,ehi->eth", F.silu(gate) * up, down)  # [E, T, H]
    return torch.einsum("eth,te->th", y.to(combine.dtype), combine).to(h.dtype)
