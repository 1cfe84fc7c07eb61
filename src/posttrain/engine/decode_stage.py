"""Decode staging: a contiguous copy of the K/V of the sequences that decode together, kept across steps.

Owns, per decode group, `[layers, rows, kv_heads, capacity, head_dim]` K and V tensors holding each
member's context, so a decode step attends over a contiguous view instead of gathering every member's
blocks from the paged pool at every layer of every step. A member's row is filled from the pool once
(when it joins), then grows by the one token each step writes into both; rows leave when their sequence
stops decoding (finished, preempted, back to prefill). The paged pool stays the source of truth
(preemption, forks and prefix sharing read it). Does not decide who decodes or run the model.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from posttrain.engine.quant import dequantize_kv

# A stage whose capacity passes this x a fresh allocation's (its rows left, or its longest row did) is
# reallocated to fit: under continuous batching a stage rarely empties, and capacity that only grew kept
# every stage at its most rows x its longest context ever.
SHRINK_AT = 1.5


class DecodeStage:
    """One decode group: rows of K/V in the compute dtype, `lengths[r]` tokens valid in row r."""

    def __init__(self, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers, self.kv_heads, self.head_dim = shape
        self.dtype = dtype
        self.device = device
        self.keys: list[Hashable] = []
        self.lengths: list[int] = []
        self.k = self._zeros(0, 0)
        self.v = self._zeros(0, 0)

    def _zeros(self, rows: int, cap: int) -> torch.Tensor:
        # zeros, not empty: padded positions are masked out, and 0 * mask stays finite (garbage could be NaN)
        shape = (self.num_layers, rows, self.kv_heads, cap, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    @property
    def rows_capacity(self) -> int:
        return self.k.shape[1]

    @property
    def len_capacity(self) -> int:
        return self.k.shape[3]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def target_capacity(
        self, rows: int, length: int, max_rows: int, max_len: int, align: int, tight: bool = False
    ) -> tuple[int, int]:
        """The `(rows, length)` capacity `reserve` leaves for `rows` rows of `length` tokens: the current one
        while it fits and holds at most `SHRINK_AT` x what a fresh allocation would; otherwise a fresh one,
        with headroom (a quarter more rows, an eighth more tokens) so growth reallocates rarely. `tight`:
        whichever of the two is smaller (a stager at its byte bound)."""
        fresh_rows = min(max(rows, -(-5 * rows // 4)), max(rows, max_rows))
        fresh_len = length + max(length // 8, 2 * align)
        fresh_len = min(-(-fresh_len // align) * align, max(length, max_len))
        cur_rows, cur_len = self.rows_capacity, self.len_capacity
        fits = rows <= cur_rows and length <= cur_len
        limit = 1.0 if tight else SHRINK_AT
        if fits and cur_rows * cur_len <= limit * fresh_rows * fresh_len:
            return cur_rows, cur_len
        return fresh_rows, fresh_len

    def reserve(
        self, rows: int, length: int, max_rows: int, max_len: int, align: int, tight: bool = False
    ) -> None:
        """Make room for `rows` rows of `length` tokens (`target_capacity`); an oversized stage shrinks."""
        new_rows, new_len = self.target_capacity(rows, length, max_rows, max_len, align, tight)
        if (new_rows, new_len) == (self.rows_capacity, self.len_capacity):
            return
        k, v = self._zeros(new_rows, new_len), self._zeros(new_rows, new_len)
        n, cap = len(self.keys), min(self.len_capacity, new_len)
        if n:
            k[:, :n, :, :cap] = self.k[:, :n, :, :cap]
            v[:, :n, :, :cap] = self.v[:, :n, :, :cap]
        self.k, self.v = k, v

    def remove_row(self, r: int) -> None:
        """Drop row r; the last row moves into its place (one row copied, not the whole stage)."""
        last = len(self.keys) - 1
        if r != last:
            n = self.lengths[last]
            self.k[:, r, :, :n] = self.k[:, last, :, :n]
            self.v[:, r, :, :n] = self.v[:, last, :, :n]
            self.keys[r] = self.keys[last]
            self.lengths[r] = self.lengths[last]
        self.keys.pop()
        self.lengths.pop()

    def fill_row(
        self,
        r: int,
        length: int,
        block_table: list[int],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        """Copy the first `length` tokens of a sequence from the paged pool `[layers, blocks, bs, kv, hd]`
        (an int8 pool is dequantized with its scales `[layers, blocks, bs, kv]`)."""
        if length == 0:
            return
        bs = k_cache.shape[2]
        blocks = torch.tensor(block_table[: -(-length // bs)], device=k_cache.device)
        for pool, scales, dst in ((k_cache, k_scale, self.k), (v_cache, v_scale, self.v)):
            src = pool.index_select(1, blocks).flatten(1, 2)[:, :length]  # [layers, length, kv, hd]
            if scales is not None:
                src = dequantize_kv(src, scales.index_select(1, blocks).flatten(1, 2)[:, :length], self.dtype)
            dst[:, r, :, :length] = src.transpose(1, 2)


@dataclass
class StagedGroup:
    """What a step needs of one stage: which decode members sit in its rows, in row order."""

    stage: DecodeStage
    members: list[int]  # indices into the plan's `members`, row by row
    positions: torch.Tensor  # [rows] where each row's new token goes (its context length before the step)
    write_index: torch.Tensor  # [rows * kv_heads]: those slots in a layer's stage viewed as [-1, head_dim]
    width: int  # tokens attended after the step's write (the longest row)
    mask: torch.Tensor | None  # [rows, 1, 1, width] additive (0 / -inf); None when every row spans `width`


class DecodeStager:
    """Assigns decoding sequences to at most `max_groups` stages, keeping each stage's padding near
    `slack` x its real tokens; a sequence stays in its stage while it decodes (assignment is sticky).

    With `max_bytes`, the stages never hold more: a sequence joins only if they still fit it (reallocated
    without headroom if need be), and when staged rows outgrow it the longest leave. A sequence left out
    decodes from the pool (the caller gathers its blocks) and asks again next step."""

    def __init__(
        self,
        shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device,
        *,
        block_size: int,
        max_rows: int,
        max_len: int,
        max_groups: int = 4,
        slack: float = 1.25,
        max_bytes: int | None = None,
    ) -> None:
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        self.max_rows = max_rows
        self.max_len = max_len
        self.max_groups = max_groups
        self.slack = slack
        self.max_bytes = max_bytes
        self.cell_bytes = shape[0] * shape[1] * shape[2] * dtype.itemsize
        self.stages: list[DecodeStage] = []
        self.rows_filled = 0  # rows copied from the pool (joins), for tests and statistics

    def clear(self) -> None:
        self.stages = []

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.stages)

    @staticmethod
    def _need(stage: DecodeStage, extra: list[int]) -> tuple[int, int]:
        """Rows, and tokens of the longest row after the step's write, were rows of context `extra` to join."""
        return len(stage.keys) + len(extra), max(stage.lengths + extra) + 1

    def _stage_bytes(self, stage: DecodeStage, extra: list[int], tight: bool) -> int:
        """Stage's K and V bytes after `reserve`, were rows of context `extra` to join it."""
        if not stage.keys and not extra:
            return 0
        rows, longest = self._need(stage, extra)
        r, n = stage.target_capacity(rows, longest, self.max_rows, self.max_len, self.block_size, tight)
        return 2 * r * n * self.cell_bytes

    def _projected_bytes(self, pending: list[tuple[int, int]], tight: bool = False) -> int:
        """The stages' bytes after `reserve`, were the joiners `pending` (stage index, ctx) added."""
        return sum(
            self._stage_bytes(stage, [c for s, c in pending if s == si], tight)
            for si, stage in enumerate(self.stages)
        )

    def _evict_to_fit(self) -> None:
        """Past `max_bytes` with no joiner (the staged rows grew): the longest row of the largest stage
        leaves, until the rest fits; it decodes from the pool and asks to join again next step."""
        assert self.max_bytes is not None
        while self.stages and self._projected_bytes([], tight=True) > self.max_bytes:
            stage = max(self.stages, key=lambda st: self._stage_bytes(st, [], tight=True))
            stage.remove_row(max(range(len(stage.keys)), key=lambda r: stage.lengths[r]))
            self.stages = [st for st in self.stages if st.keys]

    def _choose(self, pending: list[tuple[int, int]], ctx: int) -> int:
        """The stage (index into self.stages) a new row of context `ctx` joins, creating one if needed.

        Prefers the stage where it adds the least padding among those whose padded size stays within
        `slack` x their real tokens; past `max_groups` stages, the least added padding wins."""
        fitting: list[tuple[int, int]] = []
        anywhere: list[tuple[int, int]] = []
        for si, stage in enumerate(self.stages):
            lengths = stage.lengths + [c for s, c in pending if s == si]
            width = max(lengths, default=0)
            new_width = max(width, ctx)
            real = sum(lengths) + ctx
            padded = (len(lengths) + 1) * new_width
            added = (padded - real) - (len(lengths) * width - sum(lengths))
            anywhere.append((added, si))
            if padded <= self.slack * real:
                fitting.append((added, si))
        if fitting:
            return min(fitting)[1]
        if len(self.stages) < self.max_groups:
            self.stages.append(DecodeStage(self.shape, self.dtype, self.device))
            return len(self.stages) - 1
        return min(anywhere)[1]

    def plan(
        self,
        members: list[tuple[Hashable, int, list[int]]],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> list[StagedGroup]:
        """Stage the step's decode members `(key, context length, block table)`: each gets a row holding its
        context; the step then writes one token per row. A key must change when a sequence's cached K/V do
        (the engine keys on sequence id and free count). A member in no returned group was not staged
        (see `max_bytes`)."""
        wanted = {key: (i, ctx) for i, (key, ctx, _) in enumerate(members)}
        for stage in self.stages:
            r = 0
            while r < len(stage.keys):
                hit = wanted.get(stage.keys[r])
                if hit is None or hit[1] != stage.lengths[r]:
                    stage.remove_row(r)
                else:
                    r += 1
        self.stages = [s for s in self.stages if s.keys]
        if self.max_bytes is not None:
            self._evict_to_fit()
        staged = {key for s in self.stages for key in s.keys}
        joining = sorted(
            (i for i, (key, _, _) in enumerate(members) if key not in staged), key=lambda i: -members[i][1]
        )
        pending: list[tuple[int, int]] = []  # (stage index, ctx) of joiners, in join order
        joins: list[tuple[int, int]] = []  # (stage index, member index)
        for i in joining:
            ctx = members[i][1]
            si = self._choose(pending, ctx)
            if (
                self.max_bytes is not None
                and self._projected_bytes([*pending, (si, ctx)], True) > self.max_bytes
            ):
                if not self.stages[si].keys and all(s != si for s, _ in pending):
                    self.stages.pop()  # the stage _choose opened for it (always the last) stays unopened
                continue
            pending.append((si, ctx))
            joins.append((si, i))
        # at the bound, every stage is reallocated without headroom (joins were admitted on that basis)
        tight = self.max_bytes is not None and self._projected_bytes(pending) > self.max_bytes
        for si, stage in enumerate(self.stages):
            rows, longest = self._need(stage, [c for s, c in pending if s == si])
            stage.reserve(rows, longest, self.max_rows, self.max_len, self.block_size, tight)
        for si, i in joins:
            stage = self.stages[si]
            key, ctx, table = members[i]
            stage.keys.append(key)
            stage.lengths.append(ctx)
            stage.fill_row(len(stage.keys) - 1, ctx, table, k_cache, v_cache, k_scale, v_scale)
            self.rows_filled += 1
        groups = []
        for stage in self.stages:
            order = [wanted[key][0] for key in stage.keys]
            ctx = torch.tensor(stage.lengths, device=self.device)
            width = max(stage.lengths) + 1
            mask = None
            if min(stage.lengths) + 1 < width:
                valid = torch.arange(width, device=self.device)[None, :] <= ctx[:, None]
                mask = torch.zeros(valid.shape, dtype=self.dtype, device=self.device)
                mask = mask.masked_fill_(~valid, float("-inf"))[:, None, None, :]
            kv, cap = stage.kv_heads, stage.len_capacity
            rows = torch.arange(len(order), device=self.device)[:, None] * kv
            heads = torch.arange(kv, device=self.device)[None, :]
            write_index = ((rows + heads) * cap + ctx[:, None]).reshape(-1)
            groups.append(StagedGroup(stage, order, ctx, write_index, width, mask))
            stage.lengths = [n + 1 for n in stage.lengths]  # the step writes one token per row
        return groups
