"""Quantized weights and KV cache of the paged engine (its "fast mode"), on integer or packed CPU kernels.

Owns the int8 linear (per-output-channel symmetric int8 weights x dynamically quantized int8 activations,
one scale per token, on fbgemm's integer GEMM via `torch.ops.quantized.linear_dynamic`), the weight-only
int8 linear (bf16 activations, `_weight_int8pack_mm`), the int4 linear (group-wise asymmetric 4-bit
weights, bf16 activations, `_weight_int4pack_mm_for_cpu`), checks that each kernel runs and is accurate
on this machine, and per-token-per-head int8 K/V (de)quantization. Does not decide which layers are
quantized or run the model: model_runner.py does.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F

WEIGHT_QUANTS = ("none", "int8", "int8_weight_only", "int4")
INT4_GROUP_SIZE = 32  # divides the hidden sizes of the supported small models (576 = 18 x 32)
KV_INT8 = "int8"


@contextlib.contextmanager
def _quantized_engine(name: str) -> Iterator[None]:
    # the packed weights are made for one backend; at run time the packed object carries it
    old = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = old


def _prepack_int8(weight: torch.Tensor) -> tuple[object, torch.Tensor]:
    """fbgemm-packed per-output-channel symmetric int8 weights (and their float32 scales)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    n = w.shape[0]
    with warnings.catch_warnings(), _quantized_engine("x86"):
        warnings.simplefilter("ignore")  # quantize_per_channel's deprecation notice, emitted per call
        qw = torch.quantize_per_channel(w, scale.double(), torch.zeros(n, dtype=torch.long), 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(qw, None), scale


class Int8Linear:
    """y = x W^T with W int8 per output channel and x quantized to int8 per token at each call.

    fbgemm's dynamic linear quantizes its whole input with one scale; each row is first scaled to unit
    max |x| (and the output scaled back), so every token gets its own scale and a loud row in the batch
    costs the others no precision (a batch still shares one zero point, so results can move by about one
    quantization step with the batch's make-up). `reduce_range` is off: this CPU's int8 path accumulates
    without the 16-bit saturation it guards against (checked by `int8_linear_works`)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.packed, self.scale = _prepack_int8(weight)

    def nbytes(self) -> int:
        return self.out_features * self.in_features + 4 * self.out_features

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        xf = x.float()
        row_max = xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
        y = torch.ops.quantized.linear_dynamic(xf / row_max, self.packed, False)
        y = y.mul_(row_max).to(x.dtype)
        return y if bias is None else y.add_(bias)


class Int4Linear:
    """Weight-only int4: groups of INT4_GROUP_SIZE input weights share a scale and a zero (asymmetric),
    activations stay bf16; the packed kernel dequantizes in registers (no float weight copy is made)."""

    def __init__(self, weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> None:
        n, k = weight.shape
        if k % group_size:
            raise ValueError(f"int4 weights need in_features divisible by {group_size}, got {k}")
        self.out_features, self.in_features, self.group_size = n, k, group_size
        w = weight.detach().float().view(n, k // group_size, group_size)
        lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
        scale = ((hi - lo) / 15.0).clamp_min(1e-12)
        q = torch.round((w - lo) / scale).clamp_(0, 15).to(torch.int32).view(n, k)
        # the kernel computes (q - 8) * scale + zero, so zero = lo + 8 * scale; layout [k / group, n, 2]
        zero = lo + 8.0 * scale
        self.scales_and_zeros = (
            torch.stack((scale.view(n, -1).t(), zero.view(n, -1).t()), dim=-1).contiguous().bfloat16()
        )
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)

    def nbytes(self) -> int:
        return self.out_features * self.in_features // 2 + self.scales_and_zeros.numel() * 2

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.bfloat16(), self.packed, self.group_size, self.scales_and_zeros
        ).to(x.dtype)
        return y if bias is None else y.add_(bias)


class Int8WeightOnlyLinear:
    """Weight-only int8: symmetric per-output-channel int8 weights, activations stay bfloat16; the packed
    kernel (`_weight_int8pack_mm`) scales in registers, so no float copy of the weights is read."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        self.weight = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        self.scale = scale.bfloat16()

    def nbytes(self) -> int:
        return self.out_features * self.in_features + 2 * self.out_features

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.bfloat16(), self.weight, self.scale).to(x.dtype)
        return y if bias is None else y.add_(bias)


QuantLinear = Int8Linear | Int4Linear | Int8WeightOnlyLinear


def quantize_linear(weight: torch.Tensor, method: str) -> QuantLinear:
    if method == "int8":
        return Int8Linear(weight)
    if method == "int4":
        return Int4Linear(weight)
    if method == "int8_weight_only":
        return Int8WeightOnlyLinear(weight)
    raise ValueError(f"weight_quant must be one of {list(WEIGHT_QUANTS[1:])} here, got '{method}'")


def weight_quant_works(method: str, device: torch.device) -> str | None:
    """None when `method`'s kernel runs on `device` and matches a float64 reference; else why not.

    The int8 case includes inputs where a 16-bit-saturating integer GEMM would go wrong (every product
    at its maximum), since integer matmul paths have miscomputed on some CPUs."""
    if device.type != "cpu":
        return f"weight_quant '{method}' runs on CPU kernels only (engine.device is '{device}')"
    g = torch.Generator().manual_seed(0)
    cases = [
        (torch.randn(64, 128, generator=g) * 0.05, torch.randn(5, 128, generator=g)),
        (torch.full((64, 128), 0.02), torch.ones(3, 128)),
    ]
    tol = {"int8": 0.03, "int8_weight_only": 0.03, "int4": 0.2}[method]
    for w, x in cases:
        try:
            got = quantize_linear(w, method)(x)
        except (RuntimeError, NotImplementedError, AttributeError) as err:
            return f"weight_quant '{method}': its kernel failed on this machine ({err})"
        ref = F.linear(x.double(), w.double())
        err = float(((got.double() - ref).abs().amax(dim=1) / ref.abs().amax(dim=1)).max())
        if not err <= tol:
            return f"weight_quant '{method}': its kernel is inaccurate on this machine (relative error {err:.3g})"
    return None


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per token and head: `x [..., head_dim]` -> (int8 values, float32 scales `[...]`)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / 127.0
    q = torch.round(xf / scale.clamp_min(1e-30).unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.unsqueeze(-1)).to(dtype)
