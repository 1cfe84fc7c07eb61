"""RoPE scaling: linear, dynamic NTK, YaRN and Llama-3, computed exactly as transformers computes them.

Owns turning a `model.rope_scaling` config into a model config's `rope_parameters` (and rebuilding the
model's rotary modules), and the cos/sin tables the paged engine reads. Dynamic NTK depends on the length
of the sequence being computed: here it is the length of each sequence on its own (transformers uses the
longest row of the batch and keeps it between calls). Does not know about tasks or training.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3")


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's RoPE parameters as one flat dict with `rope_type` and `rope_theta` (old and new forms)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def scaled_parameters(config: Any, scaling: Any) -> dict[str, Any]:
    """transformers' `rope_parameters` for `scaling` (a config.RopeScaling) over the model's own RoPE."""
    current = rope_parameters(config)
    if current["rope_type"] != "default":
        raise ValueError(
            f"the model already uses RoPE scaling '{current['rope_type']}'; model.rope_scaling would replace it"
        )
    params: dict[str, Any] = {
        "rope_type": scaling.type,
        "rope_theta": float(current["rope_theta"]),
        "factor": float(scaling.factor),
    }
    if "partial_rotary_factor" in current:
        params["partial_rotary_factor"] = current["partial_rotary_factor"]
    window = scaling.original_max_position_embeddings or int(config.max_position_embeddings)
    if scaling.type == "yarn":
        params.update(
            original_max_position_embeddings=window,
            beta_fast=scaling.beta_fast,
            beta_slow=scaling.beta_slow,
        )
        if scaling.attention_factor is not None:
            params["attention_factor"] = scaling.attention_factor
    elif scaling.type == "llama3":
        params.update(
            original_max_position_embeddings=window,
            low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor,
        )
    return params


def inv_freq_and_scale(config: Any, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[head_dim // 2]` (float32) and the cos/sin scale, by transformers' own functions.

    `seq_len` matters for dynamic NTK only: the length of the sequence the frequencies are for."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        base = float(params["rope_theta"])
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"RoPE type '{rope_type}' is not supported ({', '.join(('default', *ROPE_TYPES))} are)"
        )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type == "dynamic" and seq_len is not None:
        # a tensor, as transformers' forward passes it (its arithmetic is then float32, not float64)
        return ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), seq_len=torch.tensor(seq_len))
    return ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))


def cos_sin(
    inv_freq: torch.Tensor, scale: float, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[len(positions), 2 * len(inv_freq)]` in float32, as transformers' rotary forward."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


class RopeTables:
    """The engine's RoPE: a table for positions `< max_len`; under dynamic NTK, the rows of sequences
    longer than the trained window are recomputed with the frequencies of their own length."""

    def __init__(self, config: Any, head_dim: int, max_len: int) -> None:
        self.config = config
        inv_freq, self.scale = inv_freq_and_scale(config)
        if inv_freq.numel() * 2 != head_dim:
            raise ValueError("partial rotary embeddings are not supported")
        self.cos, self.sin = cos_sin(inv_freq, self.scale, torch.arange(max_len))
        self.dynamic = rope_parameters(config)["rope_type"] == "dynamic"
        self.window = int(config.max_position_embeddings)
        self._inv_freq: dict[int, torch.Tensor] = {}

    def dynamic_rows(
        self, positions: torch.Tensor, seq_lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows whose sequence is longer than the window, and their cos and sin (float32)."""
        rows = torch.nonzero(seq_lens > self.window).flatten()
        n = rows.numel()
        cos = torch.empty(n, self.cos.shape[1])
        sin = torch.empty(n, self.cos.shape[1])
        lens = seq_lens.index_select(0, rows)
        for length in lens.unique().tolist():
            inv = self._inv_freq.get(length)
            if inv is None:
                inv = self._inv_freq[length] = inv_freq_and_scale(self.config, length)[0]
                if len(self._inv_freq) > 4096:  # one entry per length seen; bounded
                    self._inv_freq.clear()
            pick = torch.nonzero(lens == length).flatten()
            c, s = cos_sin(inv, self.scale, positions.index_select(0, rows.index_select(0, pick)).cpu())
            cos[pick], sin[pick] = c, s
        return rows, cos, sin


class DynamicNTKRotary(nn.Module):
    """A transformers rotary module for dynamic NTK without state: each sequence gets the frequencies of
    its own length, also when several are packed into one row (a sequence is a run of position ids that
    rise by one), so its result depends neither on the other rows nor on earlier calls."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.window = int(config.max_position_embeddings)
        inv_freq, self.attention_scaling = inv_freq_and_scale(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._inv_freq: dict[int, torch.Tensor] = {}

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = position_ids.reshape(-1)
        cos, sin = cos_sin(self.inv_freq, self.attention_scaling, pos)
        lens = sequence_lengths(position_ids).reshape(-1)
        for length in lens[lens > self.window].unique().tolist():
            inv = self._inv_freq.get(length)
            if inv is None:
                inv = self._inv_freq[length] = inv_freq_and_scale(self.config, length)[0]
            rows = torch.nonzero(lens == length).flatten()
            cos[rows], sin[rows] = cos_sin(inv.to(pos.device), self.attention_scaling, pos[rows])
        shape = (*position_ids.shape, cos.shape[-1])
        return cos.view(shape).to(x.dtype), sin.view(shape).to(x.dtype)


def sequence_lengths(position_ids: torch.Tensor) -> torch.Tensor:
    """For each position `[B, L]`, the length of its sequence: a sequence is a run of position ids that
    rise by one, and its length is its last position id + 1."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    seg = torch.cumsum(starts.reshape(-1).long(), 0) - 1  # rows never join: each row starts a run
    last = torch.zeros(int(seg[-1]) + 1, dtype=position_ids.dtype, device=position_ids.device)
    last = last.scatter_reduce(0, seg, position_ids.reshape(-1), "amax", include_self=False)
    return (last[seg] + 1).view(position_ids.shape)


def apply_rope_scaling(model: Any, scaling: Any) -> Any:
    """Set `scaling` (a config.RopeScaling, or None for no change) on a loaded transformers model: its
    config's `rope_parameters`, and every rotary module rebuilt from them. Returns the model."""
    if scaling is None:
        return model
    config = model.config
    config.rope_parameters = scaled_parameters(config, scaling)
    found = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not (hasattr(child, "inv_freq") and hasattr(child, "attention_scaling")):
                continue
            device = child.inv_freq.device
            fresh = DynamicNTKRotary(config) if scaling.type == "dynamic" else type(child)(config=config)
            setattr(parent, name, fresh.to(device))
            found += 1
    if not found:
        raise ValueError(f"no rotary embedding module found in {type(model).__name__}")
    return model


def check_rope_scaling(model: Any, scaling: Any) -> None:
    """Refuse a model handed over ready-made whose RoPE is not what `scaling` asks for."""
    have = rope_parameters(model.config)
    want = {k: v for k, v in scaled_parameters(_unscaled(model.config), scaling).items() if k != "rope_theta"}
    differ = sorted(k for k, v in want.items() if have.get(k) != v)
    if differ:
        raise ValueError(
            f"model.rope_scaling asks for {want} but the model given has RoPE {have} (differs in {differ})"
        )


def _unscaled(config: Any) -> Any:
    import copy

    plain = copy.copy(config)
    plain.rope_parameters = {"rope_type": "default", "rope_theta": rope_parameters(config)["rope_theta"]}
    return plain
