"""The Llama-family forward pass over a paged KV cache, in plain PyTorch (CPU or GPU).

Owns the engine's copy of the weights (q/k/v and gate/up fused for fewer matmuls; on CPU also their
oneDNN-packed copies, rewritten in place by each load, onednn.py; all of it freed by `release_weights`
until the next full load), the per-layer KV block pools `[num_blocks, block_size, kv_heads,
head_dim]`, RoPE tables, and one varlen forward
that runs decode tokens (batched per group over its decode stage, or a padded gather of its blocks)
and prefill chunks (one attention call per sequence, no padding) together. Supports Llama, Qwen2 (q/k/v bias), Qwen3
(q/k RMSNorm), Mistral without a sliding window, Qwen2-VL's language model (M-RoPE: 3-D positions for
image rows, mrope.py), and the MoE families Mixtral, Qwen2-MoE (shared expert),
Qwen3-MoE and OLMoE (q/k RMSNorm over the whole projections, `clip_qkv`), with routing and sparse experts
from moe.py, recording each token's expert choices. Optionally runs the linears on int8/int4 weights and
keeps K/V in int8 with per-token-per-head scales (the kernels are quant.py). Does not schedule or sample.
"""

from __future__ import annotations

import ctypes
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from posttrain.engine.decode_stage import DecodeStage
from posttrain.engine.moe import MOE_MODEL_TYPES, MoeSpec, route, sparse_experts
from posttrain.engine.mrope import MROPE_MODEL_TYPES, mrope_columns, mrope_rows
from posttrain.engine.onednn import PACK_BATCH_HINT, PackedWeight
from posttrain.engine.quant import (
    KV_INT8,
    WEIGHT_QUANTS,
    QuantLinear,
    dequantize_kv,
    quantize_kv,
    quantize_linear,
    weight_quant_works,
)
from posttrain.longctx.rope import RopeTables

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", *MOE_MODEL_TYPES, *MROPE_MODEL_TYPES)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool  # RMSNorm per head of q and k (Qwen3)
    moe: MoeSpec | None = None
    qk_norm_proj: bool = False  # RMSNorm over the whole q and k projections (OLMoE)
    clip_qkv: float | None = None  # q, k, v clamped to [-clip, clip] after the norms (OLMoE)

    @classmethod
    def from_hf_config(cls, config: Any, max_model_len: int) -> ModelSpec:
        mt = getattr(config, "model_type", None)
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"the paged engine supports model types {SUPPORTED_MODEL_TYPES}, got '{mt}'")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"the paged engine supports SwiGLU (hidden_act 'silu'), got '{act}'")
        window = getattr(config, "sliding_window", None)
        uses_window = getattr(config, "use_sliding_window", mt == "mistral")
        if window is not None and uses_window and window < max_model_len:
            raise ValueError(
                f"sliding-window attention (window {window}) is not supported; set max_model_len <= {window}"
            )
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            model_type=mt,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=mt in ("qwen2", *MROPE_MODEL_TYPES)
            or bool(getattr(config, "attention_bias", False))
            or (mt == "qwen2_moe" and bool(config.qkv_bias)),
            qk_norm=mt in ("qwen3", "qwen3_moe"),
            moe=MoeSpec.from_hf_config(config),
            qk_norm_proj=mt == "olmoe",
            clip_qkv=getattr(config, "clip_qkv", None) if mt == "olmoe" else None,
        )


# Weights of the CPU GEMMs, pre-packed for oneDNN: on this project's machine (AMD, AVX-512) oneDNN's fp32
# GEMM ran 1.9x (1 row) to 2.5x (64-512 rows) faster than torch's default BLAS path; for bfloat16 F.linear
# already uses oneDNN, and the packed weights win only for few rows (2.3x at 1 row, slower at 512).
_BF16_PACKED_MAX_ROWS = 128
_PACKED = ("wqkv", "wo", "wgu", "wd")


def _slot_key(gemm_key: str) -> str:
    """The layer tensor a `_gemm_weights` key is (part of): an expert's "gu.E" / "d.E" are slices of
    "experts_gu" / "experts_d"."""
    return {"gu": "experts_gu", "d": "experts_d"}.get(gemm_key.split(".")[0], gemm_key)


def _gemm_weights(layer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layer's GEMM weights by name: _PACKED's it has, and each expert's gate/up ("gu.E") and down
    ("d.E"); the router and the shared-expert gate stay float (tiny, and routing decides every token)."""
    out = {k: layer[k] for k in _PACKED if k in layer}
    if "router" in layer:
        for e in range(layer["router"].shape[0]):
            out[f"gu.{e}"] = layer["experts_gu"][e]
            out[f"d.{e}"] = layer["experts_d"][e]
    return out


def onednn_packing_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether pre-packed oneDNN linears run here and agree with F.linear (checked on a small case)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.randn(8, 16).to(dtype)
        x = torch.randn(3, 16).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return got.shape == (3, 8) and torch.allclose(got.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2)


def _trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim): weight tensors below glibc's
    mmap threshold live on the heap, and freeing them alone would leave them in the process's RSS.
    A no-op elsewhere."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, cast back, then scale."""
    dtype = x.dtype
    if dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one kernel, same arithmetic
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(dtype)


@dataclass
class PrefillChunk:
    row: int  # first row of this chunk in the flat batch
    num_tokens: int
    start_pos: int  # tokens of this sequence already in the cache
    block_ids: torch.Tensor  # the blocks covering start_pos + num_tokens tokens


@dataclass
class DecodeGroup:
    """Decode rows of similar context length, attended together: over their decode stage (contiguous K/V
    kept across steps, see decode_stage.py) or, without one, over a padded gather of their blocks."""

    row: int
    num_rows: int
    mask: torch.Tensor | None  # [rows, 1, 1, width]: bool True / additive 0 where attended; None: all
    block_tables: torch.Tensor | None = None  # gather: [rows, max_blocks] (padded with block 0)
    stage: DecodeStage | None = None  # staged: the rows are the stage's first num_rows rows, in order
    write_index: torch.Tensor | None = None  # staged: the new K/V's slots in stage.k[layer].view(-1, hd)
    width: int = 0  # staged: tokens attended (the longest row's context after this step)


@dataclass
class StepBatch:
    """One forward: decode rows first (one token each), then prefill chunks, all flattened."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat slot = block * block_size + offset
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    logit_rows: torch.Tensor  # rows whose next-token logits are needed
    embed_rows: torch.Tensor | None = None  # vision: rows whose input embedding is an image feature
    embeds: torch.Tensor | None = None  # [len(embed_rows), hidden] those features (engine/vision.py)
    mrope_rows: torch.Tensor | None = None  # M-RoPE: rows whose 3 position components differ (images)
    mrope_positions: torch.Tensor | None = None  # [3, len(mrope_rows)] their (t, h, w) positions


class ModelRunner:
    def __init__(
        self,
        config: Any,
        state_dict: dict[str, torch.Tensor],
        *,
        dtype: str = "float32",
        kv_cache_dtype: str = "auto",
        block_size: int = 16,
        num_blocks: int = 1024,
        max_model_len: int = 4096,
        device: str = "cpu",
        weight_quant: str = "none",
        lm_head_quant: str = "same",
        weight_quant_max_rows: int = 0,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got '{dtype}'")
        if kv_cache_dtype not in ("auto", KV_INT8, *DTYPES):
            raise ValueError(
                f"kv_cache_dtype must be one of {['auto', *DTYPES, KV_INT8]}, got '{kv_cache_dtype}'"
            )
        if weight_quant not in WEIGHT_QUANTS:
            raise ValueError(f"weight_quant must be one of {list(WEIGHT_QUANTS)}, got '{weight_quant}'")
        self.spec = ModelSpec.from_hf_config(config, max_model_len)
        self.dtype = DTYPES[dtype]
        self.kv_int8 = kv_cache_dtype == KV_INT8
        if self.kv_int8:
            self.kv_dtype = torch.int8
        else:
            self.kv_dtype = self.dtype if kv_cache_dtype == "auto" else DTYPES[kv_cache_dtype]
        self.device = torch.device(device)
        if weight_quant != "none":
            why = weight_quant_works(weight_quant, self.device)
            if why is not None:
                raise ValueError(f"{why}; use weight_quant 'none'")
        if weight_quant_max_rows < 0:
            raise ValueError(f"weight_quant_max_rows must be >= 0, got {weight_quant_max_rows}")
        self.weight_quant = weight_quant
        if lm_head_quant not in ("same", *WEIGHT_QUANTS):
            raise ValueError(
                f"lm_head_quant must be one of {['same', *WEIGHT_QUANTS]}, got '{lm_head_quant}'"
            )
        # the head's own quantization only applies when the body is quantized
        head = weight_quant if lm_head_quant == "same" else lm_head_quant
        self.lm_head_quant = head if weight_quant != "none" else "none"
        if self.lm_head_quant not in ("none", weight_quant):
            why = weight_quant_works(self.lm_head_quant, self.device)
            if why is not None:
                raise ValueError(f"{why}; choose another lm_head_quant")
        # > 0: forwards of more rows (prefill, big batches) use the float weights, kept alongside: the
        # quantized kernels win while weight bytes bound the step and lose once compute does
        self.quant_max_rows = weight_quant_max_rows if weight_quant != "none" else 0
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        s = self.spec
        self.q_size = s.num_heads * s.head_dim
        self.kv_size = s.num_kv_heads * s.head_dim
        self.scale = 1.0 / math.sqrt(s.head_dim)
        self.rope = RopeTables(config, s.head_dim, max_model_len)
        self.cos, self.sin_signed = self._rope_rows(self.rope.cos, self.rope.sin)
        columns = mrope_columns(config, s.head_dim)  # Qwen2-VL's M-RoPE (mrope.py); None: 1-D
        self.mrope_columns = columns.to(self.device) if columns is not None else None
        if columns is not None and self.rope.dynamic:
            raise ValueError("dynamic NTK RoPE scaling is not supported with M-RoPE (3-D positions)")
        self._init_weights()
        self.packed: list[dict[str, torch.Tensor]] | None = None
        self.packed_lm_head: torch.Tensor | None = None
        self._packers: list[dict[str, PackedWeight]] | None = None  # what `packed` holds, refreshed per load
        self._packer_lm_head: PackedWeight | None = None
        self.weights_released = False  # release_weights() freed them; the next load brings them all
        self._released: list[tuple[torch.Tensor, int]] = []  # (tensor, storage bytes) to re-allocate
        self.quantized: list[dict[str, QuantLinear]] | None = None
        self.quantized_lm_head: QuantLinear | None = None
        self.use_packed = onednn_packing_works(self.device, self.dtype)
        self.load_weights(state_dict.items(), strict=True)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # int8 K/V: float32 scales per token and KV head, [layers, blocks, block_size, kv_heads]
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.routing: list[torch.Tensor] = []

    def step_routing(self) -> torch.Tensor | None:
        """The last full forward's expert ids `[T, sparse layers, top_k]` (int16), or None (dense model)."""
        if not self.routing:
            return None
        return torch.stack(self.routing, dim=1).to(torch.int16)

    def _rope_rows(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and the signed sin in the engine's dtype: rotate_half(x) * sin == roll(x, half) * sin_signed,
        with the first half of sin negated (exact)."""
        half = self.spec.head_dim // 2
        sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return cos.to(self.device, self.dtype), sin_signed.to(self.device, self.dtype)

    def _dynamic_rope(self, batch: StepBatch, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Dynamic NTK: rows of sequences longer than the trained window get the frequencies of their
        sequence's length after this step (in place), as transformers does with a KV cache."""
        seq_lens = batch.positions + 1  # decode rows: one token, the sequence's newest
        for c in batch.prefills:
            seq_lens[c.row : c.row + c.num_tokens] = c.start_pos + c.num_tokens
        if int(seq_lens.max()) <= self.rope.window:
            return
        rows, c, s = self.rope.dynamic_rows(batch.positions, seq_lens)
        c, s = self._rope_rows(c, s)
        cos.index_copy_(0, rows.to(self.device), c)
        sin.index_copy_(0, rows.to(self.device), s)

    # ---- weights -------------------------------------------------------------------------------

    def _empty(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=self.dtype, device=self.device)

    def _init_weights(self) -> None:
        s = self.spec
        self.embed = self._empty(s.vocab_size, s.hidden_size)
        self.lm_head = self.embed if s.tie_word_embeddings else self._empty(s.vocab_size, s.hidden_size)
        self.final_norm = self._empty(s.hidden_size)
        self.layers: list[dict[str, torch.Tensor]] = []
        for li in range(s.num_layers):
            layer = {
                "in_norm": self._empty(s.hidden_size),
                "wqkv": self._empty(self.q_size + 2 * self.kv_size, s.hidden_size),
                "wo": self._empty(s.hidden_size, self.q_size),
                "post_norm": self._empty(s.hidden_size),
            }
            mlp_size = self._mlp_size(li)
            if mlp_size:  # the dense MLP, or an MoE layer's shared expert
                layer["wgu"] = self._empty(2 * mlp_size, s.hidden_size)
                layer["wd"] = self._empty(s.hidden_size, mlp_size)
            if s.moe is not None and s.moe.sparse_layers[li]:
                m, inter = s.moe, s.moe.expert_intermediate_size
                layer["router"] = self._empty(m.num_experts, s.hidden_size)
                layer["experts_gu"] = self._empty(m.num_experts, 2 * inter, s.hidden_size)
                layer["experts_d"] = self._empty(m.num_experts, s.hidden_size, inter)
                if m.shared_intermediate_size:
                    layer["shared_gate"] = self._empty(1, s.hidden_size)
            if s.qkv_bias:
                layer["bqkv"] = self._empty(self.q_size + 2 * self.kv_size)
            if s.qk_norm or s.qk_norm_proj:
                layer["q_norm"] = self._empty(self.q_size if s.qk_norm_proj else s.head_dim)
                layer["k_norm"] = self._empty(self.kv_size if s.qk_norm_proj else s.head_dim)
            self.layers.append(layer)

    def _mlp_size(self, li: int) -> int:
        """Intermediate size of layer li's dense MLP (its shared expert in an MoE layer; 0: none)."""
        m = self.spec.moe
        if m is None or not m.sparse_layers[li]:
            return self.spec.intermediate_size
        return m.shared_intermediate_size

    _LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

    def weight_for(self, name: str) -> tuple[torch.Tensor, tuple[int, str]] | None:
        """The engine tensor (or fused slice of one) that the HF parameter `name` maps to, and its slot
        (layer index, key; -1 and the name outside the layers); None to skip."""
        s = self.spec
        top = {
            "model.embed_tokens.weight": "embed",
            "lm_head.weight": "lm_head",
            "model.norm.weight": "final_norm",
        }
        if name in top:
            return getattr(self, top[name]), (-1, top[name])
        if name.endswith("rotary_emb.inv_freq"):
            return None
        m = self._LAYER_RE.match(name)
        if not m or int(m.group(1)) >= s.num_layers:
            raise KeyError(name)
        li = int(m.group(1))
        layer, rest = self.layers[li], m.group(2)
        q, kv, inter = self.q_size, self.kv_size, self._mlp_size(li)
        if "router" in layer:  # an MoE layer: its MLP names are the shared expert's
            rest = {
                "mlp.gate.weight": "router",
                "mlp.experts.gate_up_proj": "experts_gu",
                "mlp.experts.down_proj": "experts_d",
                "mlp.shared_expert_gate.weight": "shared_gate",
            }.get(rest, rest.replace("mlp.shared_expert.", "mlp.", 1))
            if rest in layer:
                return layer[rest], (li, rest)
        table: dict[str, tuple[str, int, int] | str] = {
            "input_layernorm.weight": "in_norm",
            "post_attention_layernorm.weight": "post_norm",
            "self_attn.o_proj.weight": "wo",
            "mlp.down_proj.weight": "wd",
            "self_attn.q_proj.weight": ("wqkv", 0, q),
            "self_attn.k_proj.weight": ("wqkv", q, q + kv),
            "self_attn.v_proj.weight": ("wqkv", q + kv, q + 2 * kv),
            "self_attn.q_proj.bias": ("bqkv", 0, q),
            "self_attn.k_proj.bias": ("bqkv", q, q + kv),
            "self_attn.v_proj.bias": ("bqkv", q + kv, q + 2 * kv),
            "mlp.gate_proj.weight": ("wgu", 0, inter),
            "mlp.up_proj.weight": ("wgu", inter, 2 * inter),
            "self_attn.q_norm.weight": "q_norm",
            "self_attn.k_norm.weight": "k_norm",
        }
        entry = table.get(rest)
        if entry is None:
            raise KeyError(name)
        if isinstance(entry, str):
            if entry not in layer:
                raise KeyError(name)
            return layer[entry], (li, entry)
        key, lo, hi = entry
        if key not in layer:
            raise KeyError(name)
        return layer[key][lo:hi], (li, key)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = False) -> int:
        """Copy HF-named tensors into the engine's weights in place; returns how many were loaded.

        `strict` requires every engine tensor to be covered (used at construction, and after
        `release_weights`, whose storage is re-allocated first; a load that fails leaves it released)."""
        restoring = self.weights_released
        if restoring:
            for tensor, nbytes in self._released:
                tensor.untyped_storage().resize_(nbytes)
        try:
            count = self._load(weights, strict or restoring)
        except ValueError as err:
            if restoring:
                self._free_weights()
                raise ValueError(
                    f"the engine's weights were released; a load must bring all of them: {err}"
                ) from None
            raise
        self.weights_released = False
        self._released = []
        return count

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every dense weight tensor, each once (a tied head is the embedding tensor)."""
        tensors = [
            self.embed,
            self.lm_head,
            self.final_norm,
            *(t for layer in self.layers for t in layer.values()),
        ]
        return list({id(t): t for t in tensors}.values())

    def weight_storage_bytes(self) -> int:
        """Bytes of memory the weights hold now: dense storages, oneDNN-packed and quantized copies."""
        total = sum(t.untyped_storage().nbytes() for t in self.weight_tensors())
        total += sum(w.nbytes for _, _, w in self.packed_weights())
        quantized = [*(q for layer in self.quantized or [] for q in layer.values()), self.quantized_lm_head]
        return total + sum(q.nbytes() for q in quantized if q is not None)

    def release_weights(self) -> None:
        """Free the weights' memory: dense storages resized to 0 bytes (the tensors and their views stay),
        packed and quantized copies dropped. Nothing may run a forward until the next `load_weights`,
        which must bring every weight (the caller, PagedEngine, refuses requests until then)."""
        if not self.weights_released:
            self._released = [(t, t.untyped_storage().nbytes()) for t in self.weight_tensors()]
        self._free_weights()

    def _free_weights(self) -> None:
        for tensor, _ in self._released:
            tensor.untyped_storage().resize_(0)
        self.packed = self.packed_lm_head = self._packers = self._packer_lm_head = None
        self.quantized = self.quantized_lm_head = None
        self.weights_released = True
        if self.device.type == "cpu":
            _trim_heap()

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool) -> int:
        loaded: set[str] = set()
        touched: set[tuple[int, str]] = set()
        unknown: list[str] = []
        for raw_name, tensor in weights:
            name = raw_name.removeprefix("base_model.model.")
            try:
                found = self.weight_for(name)
            except KeyError:
                unknown.append(raw_name)
                continue
            if found is None:
                continue
            target, slot = found
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"weight '{raw_name}' has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
            with torch.no_grad():
                target.copy_(tensor.detach())
            loaded.add(name)
            touched.add(slot)
        if unknown:
            raise ValueError(f"unknown parameter names for a {self.spec.model_type} model: {unknown[:5]}")
        if strict:
            required = {"model.embed_tokens.weight", "model.norm.weight"}
            if not self.spec.tie_word_embeddings:
                required.add("lm_head.weight")
            for i in range(self.spec.num_layers):
                required.update(
                    f"model.layers.{i}.{p}"
                    for p in (
                        "input_layernorm.weight",
                        "post_attention_layernorm.weight",
                        "self_attn.o_proj.weight",
                        "self_attn.q_proj.weight",
                        "self_attn.k_proj.weight",
                        "self_attn.v_proj.weight",
                    )
                )
                required.update(f"model.layers.{i}.{p}" for p in self._mlp_names(i))
            missing = sorted(required - loaded)
            if missing:
                raise ValueError(f"state dict lacks {len(missing)} parameters, e.g. {missing[:3]}")
        if loaded and self.weight_quant != "none":
            self._quantize()
        if self.use_packed and loaded:
            self._pack(touched)
        return len(loaded)

    def packed_weights(self) -> list[tuple[str, torch.Tensor, PackedWeight]]:
        """(name, dense weight, its oneDNN-packed copy) of every packed GEMM weight; empty when none is packed."""
        out = [
            (f"{li}.{k}", _gemm_weights(layer)[k], p)
            for li, (layer, packers) in enumerate(zip(self.layers, self._packers or [], strict=False))
            for k, p in packers.items()
        ]
        if self._packer_lm_head is not None:
            out.append(("lm_head", self.lm_head, self._packer_lm_head))
        return out

    def _mlp_names(self, li: int) -> list[str]:
        """HF names of layer li's MLP parameters (after the shared expert's renaming in _target)."""
        layer = self.layers[li]
        names = (
            ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"] if "wgu" in layer else []
        )
        if "router" in layer:
            names = [n.replace("mlp.", "mlp.shared_expert.") for n in names]
            names += ["mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        if "shared_gate" in layer:
            names.append("mlp.shared_expert_gate.weight")
        return names

    def _quantize(self) -> None:
        """Re-quantize every GEMM weight (after each load, like `_pack`: the quantized copies are not views)."""
        q = self.weight_quant
        self.quantized = [
            {k: quantize_linear(w, q) for k, w in _gemm_weights(layer).items()} for layer in self.layers
        ]
        head = self.lm_head_quant
        self.quantized_lm_head = quantize_linear(self.lm_head, head) if head != "none" else None

    def _pack(self, touched: set[tuple[int, str]]) -> None:
        """Bring the oneDNN-packed copies of the GEMM weights not quantized up to date after a load (they
        are not views): built on the first load; afterwards those of the `touched` slots are refreshed,
        in place where their layout allows (engine/onednn.py)."""
        if self.quantized is None or self.quant_max_rows:
            if self._packers is None:
                self._packers = [
                    {k: PackedWeight(w) for k, w in _gemm_weights(layer).items()} for layer in self.layers
                ]
            else:
                for li, layer in enumerate(self.layers):
                    for k, w in _gemm_weights(layer).items():
                        if (li, _slot_key(k)) in touched:
                            self._packers[li][k].refresh(w)
            self.packed = [{k: p.tensor for k, p in layer.items()} for layer in self._packers]
        if self.quantized_lm_head is None or self.quant_max_rows:
            head = {(-1, "lm_head"), (-1, "embed")} if self.spec.tie_word_embeddings else {(-1, "lm_head")}
            if self._packer_lm_head is None:
                self._packer_lm_head = PackedWeight(self.lm_head)
            elif touched & head:
                self._packer_lm_head.refresh(self.lm_head)
            self.packed_lm_head = self._packer_lm_head.tensor

    def weight_bytes(self) -> int:
        """Bytes of GEMM weights held (quantized where quantized; every expert of an MoE), embedding lookup
        excluded: what one dense forward reads."""
        total = 0
        for li, layer in enumerate(self.layers):
            for k, w in _gemm_weights(layer).items():
                qz = self.quantized[li][k] if self.quantized is not None else None
                total += qz.nbytes() if qz is not None else w.numel() * w.element_size()
        head = self.quantized_lm_head
        return total + (
            head.nbytes() if head is not None else self.lm_head.numel() * self.lm_head.element_size()
        )

    def _linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        packed: torch.Tensor | None,
        bias: torch.Tensor | None = None,
        quantized: QuantLinear | None = None,
    ) -> torch.Tensor:
        if quantized is not None and (not self.quant_max_rows or x.shape[0] <= self.quant_max_rows):
            return quantized(x, bias)
        if packed is not None and (self.dtype == torch.float32 or x.shape[0] <= _BF16_PACKED_MAX_ROWS):
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return F.linear(x, weight, bias)

    # ---- KV cache ------------------------------------------------------------------------------

    def allocate_kv_cache(self) -> None:
        if self.k_cache is not None:
            return
        s = self.spec
        shape = (s.num_layers, self.num_blocks, self.block_size, s.num_kv_heads, s.head_dim)
        # uninitialised: zeroing the whole pool cost ~0.3 s per RL step (1.5 GB) when it is re-allocated
        # after every update; instead each block is zeroed when it is handed out (`zero_blocks`), and
        # block 0, the padding of decode block tables, now: masked slots are read, and 0 x NaN is NaN
        self.k_cache = torch.empty(shape, dtype=self.kv_dtype, device=self.device)
        self.v_cache = torch.empty(shape, dtype=self.kv_dtype, device=self.device)
        if self.kv_int8:
            self.k_scale = torch.empty(shape[:-1], dtype=torch.float32, device=self.device)
            self.v_scale = torch.empty(shape[:-1], dtype=torch.float32, device=self.device)
        self.zero_blocks([0])

    def zero_blocks(self, blocks: list[int]) -> None:
        """Zero these blocks in every layer (blocks just handed out hold stale or uninitialised memory)."""
        if not blocks or self.k_cache is None or self.v_cache is None:
            return
        idx = torch.tensor(sorted(set(blocks)), device=self.device)
        for t in (self.k_cache, self.v_cache, self.k_scale, self.v_scale):
            if t is not None:
                t.index_fill_(1, idx, 0)

    def release_kv_cache(self) -> None:
        self.k_cache = None
        self.v_cache = None
        self.k_scale = None
        self.v_scale = None

    def kv_cache_bytes(self) -> int:
        s = self.spec
        per = s.num_layers * self.num_blocks * self.block_size * s.num_kv_heads * s.head_dim
        scales = 2 * 4 * (per // s.head_dim) if self.kv_int8 else 0
        return 2 * per * torch.tensor([], dtype=self.kv_dtype).element_size() + scales

    def _write_kv(self, li: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        KV, hd = self.spec.num_kv_heads, self.spec.head_dim
        assert self.k_cache is not None and self.v_cache is not None
        kc, vc = self.k_cache[li].view(-1, KV, hd), self.v_cache[li].view(-1, KV, hd)
        if not self.kv_int8:
            kc.index_copy_(0, slots, k.to(self.kv_dtype))  # .to is a no-op when dtypes match
            vc.index_copy_(0, slots, v.to(self.kv_dtype))
            return
        assert self.k_scale is not None and self.v_scale is not None
        for cache, scales, x in ((kc, self.k_scale, k), (vc, self.v_scale, v)):
            q, scale = quantize_kv(x)
            cache.index_copy_(0, slots, q)
            scales[li].view(-1, KV).index_copy_(0, slots, scale)

    def _read_kv(
        self, li: int, blocks: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of these blocks, `[len(blocks) * block_size, kv_heads, head_dim]`, in `dtype`."""
        KV, hd = self.spec.num_kv_heads, self.spec.head_dim
        assert self.k_cache is not None and self.v_cache is not None
        k = self.k_cache[li].index_select(0, blocks).view(-1, KV, hd)
        v = self.v_cache[li].index_select(0, blocks).view(-1, KV, hd)
        if not self.kv_int8:
            return k.to(dtype), v.to(dtype)
        assert self.k_scale is not None and self.v_scale is not None
        ks = self.k_scale[li].index_select(0, blocks).view(-1, KV)
        vs = self.v_scale[li].index_select(0, blocks).view(-1, KV)
        return dequantize_kv(k, ks, dtype), dequantize_kv(v, vs, dtype)

    def _as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """x rounded as the pool stores it (so a decode stage holds what a gather would read)."""
        if self.kv_int8:
            return dequantize_kv(*quantize_kv(x), x.dtype)
        if self.kv_dtype != x.dtype:
            return x.to(self.kv_dtype).to(x.dtype)
        return x

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        assert self.k_cache is not None and self.v_cache is not None
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for t in (self.k_cache, self.v_cache, self.k_scale, self.v_scale):
            if t is not None:
                t.index_copy_(1, dst, t.index_select(1, src))

    # ---- forward -------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: StepBatch, num_layers: int | None = None) -> torch.Tensor:
        """Next-token logits `[len(logit_rows), vocab]` in float32; writes the batch's K/V to the cache.
        `num_layers` runs only the first that many layers before the final norm and head (an early-exit
        draft: it writes K/V of those layers only). A full forward of an MoE leaves in `routing` each
        sparse layer's expert ids `[T, top_k]` of every row, in layer order (see `step_routing`)."""
        assert self.k_cache is not None and self.v_cache is not None
        s = self.spec
        eps = s.rms_norm_eps
        T = batch.input_ids.shape[0]
        self.routing = []
        x = F.embedding(batch.input_ids, self.embed)
        if batch.embed_rows is not None:  # image placeholders take their features (engine/vision.py)
            x = x.index_copy(0, batch.embed_rows, batch.embeds.to(x.dtype))
        # index_select, not advanced indexing: the latter is much slower on large CPU tensors
        cos = self.cos.index_select(0, batch.positions)
        sin = self.sin_signed.index_select(0, batch.positions)
        if self.rope.dynamic:
            self._dynamic_rope(batch, cos, sin)
        if batch.mrope_rows is not None:  # image rows: each rotary section at its own component
            assert self.mrope_columns is not None and batch.mrope_positions is not None
            for table, out in ((self.cos, cos), (self.sin_signed, sin)):
                rows = mrope_rows(table, batch.mrope_positions, self.mrope_columns)
                out.index_copy_(0, batch.mrope_rows, rows)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        H, KV, hd = s.num_heads, s.num_kv_heads, s.head_dim
        half = hd // 2
        for li, layer in enumerate(self.layers[:num_layers]):
            h = _rms_norm(x, layer["in_norm"], eps)
            pk = self.packed[li] if self.packed is not None else {}
            qz = self.quantized[li] if self.quantized is not None else {}
            qkv = self._linear(h, layer["wqkv"], pk.get("wqkv"), layer.get("bqkv"), qz.get("wqkv"))
            if s.qk_norm_proj or s.clip_qkv is not None:
                qkv = self._olmoe_qkv(qkv, layer)
            v = qkv[:, self.q_size + self.kv_size :].view(T, KV, hd)
            if s.qk_norm:
                q = _rms_norm(qkv[:, : self.q_size].view(T, H, hd), layer["q_norm"], eps)
                k = _rms_norm(
                    qkv[:, self.q_size : self.q_size + self.kv_size].view(T, KV, hd), layer["k_norm"], eps
                )
                q = q * cos + q.roll(half, -1) * sin
                k = k * cos + k.roll(half, -1) * sin
            else:  # q and k heads rotated together
                qk = qkv[:, : self.q_size + self.kv_size].view(T, H + KV, hd)
                qk = qk * cos + qk.roll(half, -1) * sin
                q, k = qk[:, :H], qk[:, H:]
            self._write_kv(li, batch.slot_mapping, k, v)
            attn = self._attention(li, q, k, v, batch)
            x = x + self._linear(attn, layer["wo"], pk.get("wo"), quantized=qz.get("wo"))
            h = _rms_norm(x, layer["post_norm"], eps)
            if "router" in layer:
                x = x + self._moe(li, layer, h, pk, qz, record=num_layers is None)
                continue
            x = x + self._mlp(h, layer, pk, qz)
        if batch.logit_rows.shape[0] != T:  # else every row is a logit row, in order (decode only)
            x = x.index_select(0, batch.logit_rows)
        x = _rms_norm(x, self.final_norm, eps)
        return self._linear(x, self.lm_head, self.packed_lm_head, quantized=self.quantized_lm_head).float()

    def _olmoe_qkv(self, qkv: torch.Tensor, layer: dict[str, torch.Tensor]) -> torch.Tensor:
        """OLMoE's q/k RMSNorm over each whole projection (not per head), then q, k and v clamped to
        [-clip_qkv, clip_qkv], as transformers' OlmoeAttention does before RoPE."""
        s, q, kv = self.spec, self.q_size, self.kv_size
        if s.qk_norm_proj:
            qn = _rms_norm(qkv[:, :q], layer["q_norm"], s.rms_norm_eps)
            kn = _rms_norm(qkv[:, q : q + kv], layer["k_norm"], s.rms_norm_eps)
            qkv = torch.cat((qn, kn, qkv[:, q + kv :]), dim=-1)
        if s.clip_qkv is not None:
            qkv = qkv.clamp(-s.clip_qkv, s.clip_qkv)
        return qkv

    def _mlp(
        self, h: torch.Tensor, layer: dict[str, torch.Tensor], pk: dict[str, Any], qz: dict[str, Any]
    ) -> torch.Tensor:
        gu = self._linear(h, layer["wgu"], pk.get("wgu"), quantized=qz.get("wgu"))
        gate, up = gu.chunk(2, dim=-1)
        return self._linear(F.silu(gate) * up, layer["wd"], pk.get("wd"), quantized=qz.get("wd"))

    def _moe(
        self,
        li: int,
        layer: dict[str, torch.Tensor],
        h: torch.Tensor,
        pk: dict[str, Any],
        qz: dict[str, Any],
        record: bool,
    ) -> torch.Tensor:
        """An MoE block: route (the router in float, never quantized), run the selected experts sparsely,
        add the gated shared expert; the choices go to `routing` when `record`."""
        moe = self.spec.moe
        assert moe is not None
        weights, ids = route(F.linear(h, layer["router"]), moe)
        if record:
            self.routing.append(ids)

        def linear(e: int, which: str, rows: torch.Tensor) -> torch.Tensor:
            key = f"{which}.{e}"
            w = layer["experts_gu" if which == "gu" else "experts_d"][e]
            return self._linear(rows, w, pk.get(key), quantized=qz.get(key))

        out = sparse_experts(h, weights, ids, moe.num_experts, linear)
        if "shared_gate" in layer:
            out = out + torch.sigmoid(F.linear(h, layer["shared_gate"])) * self._mlp(h, layer, pk, qz)
        return out

    def _attention(
        self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch
    ) -> torch.Tensor:
        s = self.spec
        H, KV, hd = s.num_heads, s.num_kv_heads, s.head_dim
        g = H // KV
        T = q.shape[0]
        groups = batch.decode_groups
        only_group = len(groups) == 1 and not batch.prefills and groups[0].num_rows == T
        out = None if only_group else torch.empty(T, H * hd, dtype=q.dtype, device=q.device)
        for grp in groups:
            r0, D = grp.row, grp.num_rows
            # the g query heads of a KV head act as g "query positions"
            qd = q[r0 : r0 + D].view(D, KV, g, hd)
            if grp.stage is not None:
                ks, vs = grp.stage.k[li], grp.stage.v[li]  # [rows, KV, capacity, hd]
                kn, vn = k[r0 : r0 + D].reshape(D * KV, hd), v[r0 : r0 + D].reshape(D * KV, hd)
                kn, vn = self._as_stored(kn), self._as_stored(vn)  # stage what the pool holds
                ks.view(-1, hd).index_copy_(0, grp.write_index, kn)
                vs.view(-1, hd).index_copy_(0, grp.write_index, vn)
                kd, vd = ks[:D, :, : grp.width], vs[:D, :, : grp.width]
            else:
                assert grp.block_tables is not None
                L = grp.block_tables.shape[1] * self.block_size
                kd, vd = self._read_kv(li, grp.block_tables.view(-1), q.dtype)
                kd, vd = kd.view(D, L, KV, hd).transpose(1, 2), vd.view(D, L, KV, hd).transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=grp.mask, scale=self.scale)
            if out is None:  # a decode-only step in one group: no copy into a shared output
                return o.reshape(D, H * hd)
            out[r0 : r0 + D] = o.reshape(D, H * hd)
        assert out is not None
        for c in batch.prefills:
            r0, n = c.row, c.num_tokens
            qc = q[r0 : r0 + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
            if c.start_pos == 0:
                kc, vc = k[r0 : r0 + n], v[r0 : r0 + n]
                mask, causal = None, True
            else:
                ctx = c.start_pos + n
                kc, vc = self._read_kv(li, c.block_ids, q.dtype)
                kc, vc = kc[:ctx], vc[:ctx]
                qpos = torch.arange(c.start_pos, ctx, device=q.device)
                mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]
                causal = False
            o = F.scaled_dot_product_attention(
                qc,
                kc.transpose(0, 1).unsqueeze(0),
                vc.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=causal,
                scale=self.scale,
                enable_gqa=True,
            )
            out[r0 : r0 + n] = o[0].transpose(0, 1).reshape(n, H * hd)
        return out
