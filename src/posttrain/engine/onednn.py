"""oneDNN-packed GEMM weights of the CPU forward, and rewriting them in place after a weight load.

`PackedWeight` holds one weight in the blocked layout oneDNN's inner-product kernel reads (an opaque
tensor from `torch.ops.mkldnn._reorder_linear_weight`). Packing allocates a fresh tensor each time, and
on a reload the page faults of that fresh memory cost 5-8x the bytes' copy. Where the layout is known,
`refresh` instead writes the new dense weight into the existing packed memory with one strided copy.
Known means `find_layout` found `[out/B][in/K][B][K]` with no padding (B rows of K-element words: here
fp32 packs as K=1, bfloat16 as VNNI pairs, K=2) and checked it byte for byte against oneDNN's own
packing of a random weight of the same shape and dtype; any other layout is re-packed.
"""

from __future__ import annotations

import ctypes
import functools

import torch

PACK_BATCH_HINT = 64  # the batch size oneDNN picks the weight layout for


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A fresh oneDNN-packed copy of a dense `[out, in]` weight."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)


def packed_bytes_view(packed: torch.Tensor) -> torch.Tensor:
    """A dense uint8 tensor over the packed tensor's memory. It does not keep `packed` alive: the caller
    holds both, and never lets the view outlive it."""
    nbytes = torch.ops.mkldnn._nbytes(packed)
    buffer = (ctypes.c_char * nbytes).from_address(torch.ops.mkldnn.data_ptr(packed))
    return torch.frombuffer(buffer, dtype=torch.uint8)


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _blocked(dense: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """`dense` [out, in] as the `[out/rows][in/k][rows][k]` layout's 3-D view of k-element words (not copied)."""
    out, inp = dense.shape
    words = dense.contiguous().view(_WORDS[k * dense.element_size()])
    return words.view(out // rows, rows, inp // k).transpose(1, 2)


@functools.cache
def find_layout(out: int, inp: int, dtype: torch.dtype) -> tuple[int, int] | None:
    """(B, K) when oneDNN packs an `[out, inp]` weight of `dtype` as `[out/B][in/K][B][K]` without
    padding, checked on a random weight; None otherwise (such weights are re-packed on every load), also
    where this torch lacks the ops that expose a packed tensor's memory."""
    if out < 2 or inp < 2:
        return None
    try:
        return _probe_layout(out, inp, dtype)
    except (AttributeError, RuntimeError):
        return None


def _probe_layout(out: int, inp: int, dtype: torch.dtype) -> tuple[int, int] | None:
    size = torch.tensor([], dtype=dtype).element_size()
    probe = torch.zeros(out, inp, dtype=dtype)
    probe[1, 0] = 1.0  # lands at K: the words' length
    for j in range(1, min(inp, 9)):
        probe[0, j] = 1.0 + j  # (0, K) lands at B * K
    packed = pack(probe)
    if torch.ops.mkldnn._nbytes(packed) != out * inp * size:
        return None  # padded
    flat = packed_bytes_view(packed).view(dtype)
    k = int((flat == 1.0).nonzero()[0])
    if k < 1 or k >= min(inp, 9) or k * size not in _WORDS or inp % k:
        return None
    hits = (flat == 1.0 + k).nonzero()
    if not len(hits) or int(hits[0]) % k:
        return None
    rows = int(hits[0]) // k
    if rows < 1 or out % rows:
        return None
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out, inp, generator=gen).to(dtype)
    reference = pack(weight)
    expected = packed_bytes_view(reference)
    got = torch.empty_like(expected)
    got.view(_WORDS[k * size]).view(out // rows, inp // k, rows).copy_(_blocked(weight, rows, k))
    return (rows, k) if torch.equal(got, expected) else None


class PackedWeight:
    """One GEMM weight packed for oneDNN (`tensor`), refreshed from its dense weight after a load."""

    def __init__(self, dense: torch.Tensor) -> None:
        self.tensor = pack(dense)
        self.layout = find_layout(*dense.shape, dense.dtype)
        self._words: torch.Tensor | None = None  # the packed memory as [out/B, in/K, B] words
        if self.layout is not None:
            rows, k = self.layout
            out, inp = dense.shape
            words = packed_bytes_view(self.tensor).view(_WORDS[k * dense.element_size()])
            self._words = words.view(out // rows, inp // k, rows)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed tensor (its element count's, where this torch does not say)."""
        try:
            return int(torch.ops.mkldnn._nbytes(self.tensor))
        except (AttributeError, RuntimeError):
            return self.tensor.numel() * self.tensor.element_size()

    @property
    def in_place(self) -> bool:
        """Whether `refresh` rewrites the packed memory in place (else it packs a fresh copy)."""
        return self._words is not None

    def refresh(self, dense: torch.Tensor) -> None:
        """Make `tensor` the packing of `dense` (same shape and dtype as at construction)."""
        if self._words is None:
            self.tensor = pack(dense)
            return
        rows, k = self.layout
        self._words.copy_(_blocked(dense, rows, k))
