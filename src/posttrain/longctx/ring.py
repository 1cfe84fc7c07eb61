"""Ring attention: context-parallel attention over torch.distributed, forward and backward.

The sequence is split over the ranks of a process group in zigzag order (2 * world chunks; rank r holds
chunks r and 2 * world - 1 - r, so under a causal mask every rank has the same work). Each rank keeps
its queries; the K/V blocks travel around the ring with asynchronous send/recv that overlap the
attention of the block in hand, and the partial results are merged with the log-sum-exp rule. The
backward pass sends the blocks round again with their dK/dV accumulators, which arrive back at their
owner complete. A rank holds O(L / world) activations for backward, and one (L / world)^2 score block
at a time. Packed rows (several documents back to back in one row) pass `segments`, each position's
document id: a query then sees only keys of its own document (and, causal, not after it). Every rank
holds the whole `[batch, length]` id matrix, so a block's mask needs no communication. Does not know
about models or tasks.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def zigzag_positions(length: int, world: int, rank: int) -> Tensor:
    """Global positions of rank `rank`'s tokens: chunks `rank` and `2 * world - 1 - rank` of 2 * world
    near-equal chunks (lengths need not divide evenly)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    chunks = torch.arange(length).tensor_split(2 * world)
    return torch.cat((chunks[rank], chunks[2 * world - 1 - rank]))


def shard(x: Tensor, dim: int, world: int, rank: int) -> Tensor:
    """This rank's zigzag shard of `x` along `dim` (the sequence dimension)."""
    return x.index_select(dim, zigzag_positions(x.shape[dim], world, rank).to(x.device))


def unshard(shards: list[Tensor], dim: int) -> Tensor:
    """The whole sequence back from every rank's shard, in rank order."""
    world = len(shards)
    length = sum(s.shape[dim] for s in shards)
    order = torch.cat([zigzag_positions(length, world, r) for r in range(world)])
    out = torch.empty_like(torch.cat(shards, dim))
    return out.index_copy_(dim, order.to(out.device), torch.cat(shards, dim))


def _block(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of q over one K/V block: (output, log-sum-exp); rows with nothing visible give 0, -inf."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = torch.matmul(torch.exp(scores - safe), v)
    return out, lse


def _mask(q_pos: Tensor, k_pos: Tensor, causal: bool, segments: Tensor | None) -> Tensor | None:
    """Which keys each query sees: `[q, k]` (causal), `[batch, 1, q, k]` (with segments), or None (all)."""
    mask = (q_pos[:, None] >= k_pos[None, :]) if causal else None
    if segments is None:
        return mask
    same = (segments[:, q_pos, None] == segments[:, None, k_pos])[:, None]
    return same if mask is None else same & mask


class _Ring:
    """The ring neighbours of this rank, and one asynchronous exchange of tensors with them."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.send_to = (
            dist.get_global_rank(group, (self.rank + 1) % self.world)
            if group
            else (self.rank + 1) % self.world
        )
        self.recv_from = (
            dist.get_global_rank(group, (self.rank - 1) % self.world)
            if group
            else (self.rank - 1) % self.world
        )

    def block_len(self, length: int, step: int) -> int:
        """Tokens of the block this rank holds at `step` of a pass (the block of rank - step)."""
        return zigzag_positions(length, self.world, (self.rank - step) % self.world).numel()

    def start(self, tensors: list[Tensor], recv_len: int, tag: int = 0) -> tuple[list[Tensor], list[Any]]:
        """Send `tensors` to the next rank and receive the previous rank's, `recv_len` tokens long (dim 2),
        into fresh buffers (async); exchanges in flight together use different tags."""
        received = [t.new_empty((*t.shape[:2], recv_len, *t.shape[3:])) for t in tensors]
        ops = [
            dist.P2POp(dist.isend, t.contiguous(), self.send_to, self.group, tag + i)
            for i, t in enumerate(tensors)
        ]
        ops += [
            dist.P2POp(dist.irecv, r, self.recv_from, self.group, tag + i) for i, r in enumerate(received)
        ]
        return received, dist.batch_isend_irecv(ops)


def _wait(reqs: list[Any]) -> None:
    for r in reqs:
        r.wait()


class RingAttention(torch.autograd.Function):
    """softmax(q k^T * scale [+ causal mask]) v over the whole sequence, each rank holding its zigzag shard
    of q, k, v `[batch, heads, local_len, head_dim]`; `length` is the whole sequence's length; `segments`
    (None, or `[batch, length]` on every rank) restricts each query to the keys of its own segment."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        length: int,
        causal: bool,
        group: Any,
        scale: float,
        segments: Tensor | None,
    ) -> Tensor:
        ring = _Ring(group)
        q_pos = zigzag_positions(length, ring.world, ring.rank).to(q.device)
        out = torch.zeros_like(q, dtype=torch.float32)
        lse = torch.full((*q.shape[:-1], 1), float("-inf"), dtype=torch.float32, device=q.device)
        block = [k, v]
        for step in range(ring.world):
            reqs: list[Any] = []
            if step + 1 < ring.world:  # the next block is on its way while this one is computed
                nxt, reqs = ring.start(block, ring.block_len(length, step + 1))
            owner = (ring.rank - step) % ring.world
            k_pos = zigzag_positions(length, ring.world, owner).to(q.device)
            mask = _mask(q_pos, k_pos, causal, segments)
            o, l_blk = _block(q.float(), block[0].float(), block[1].float(), mask, scale)
            merged = torch.logaddexp(lse, l_blk)
            safe = torch.where(torch.isinf(merged), torch.zeros_like(merged), merged)
            out = out * torch.exp(lse - safe) + o * torch.exp(l_blk - safe)
            lse = merged
            if reqs:
                _wait(reqs)
                block = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.length, ctx.causal, ctx.group, ctx.scale = length, causal, group, scale
        ctx.segments = segments  # an integer id matrix: no gradient, nothing for autograd to track
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        scale, length = ctx.scale, ctx.length
        q_pos = zigzag_positions(length, ring.world, ring.rank).to(q.device)
        qf, do = q.float(), grad_out.float()
        delta = (do * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(qf)
        block = [
            k.float(),
            v.float(),
            torch.zeros_like(k, dtype=torch.float32),
            torch.zeros_like(v, dtype=torch.float32),
        ]
        for step in range(ring.world):
            owner = (ring.rank - step) % ring.world
            reqs: list[Any] = []
            if (
                step + 1 < ring.world
            ):  # K and V go on ahead; their gradients follow once this step adds to them
                nxt_kv, reqs = ring.start(block[:2], ring.block_len(length, step + 1))
            kb, vb, dk, dv = block
            k_pos = zigzag_positions(length, ring.world, owner).to(q.device)
            scores = torch.matmul(qf, kb.transpose(-1, -2)) * scale
            mask = _mask(q_pos, k_pos, ctx.causal, ctx.segments)
            p = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse))
            if mask is not None:
                p = p.masked_fill(~mask, 0.0)
            dv = dv + torch.matmul(p.transpose(-1, -2), do)
            ds = p * (torch.matmul(do, vb.transpose(-1, -2)) - delta)
            dq = dq + torch.matmul(ds, kb) * scale
            dk = dk + torch.matmul(ds.transpose(-1, -2), qf) * scale
            if ring.world == 1:
                break
            # to the next rank (the owner, after W hops); from the previous one, the block we get next
            grads, greqs = ring.start([dk, dv], ring.block_len(length, step + 1), tag=2)
            _wait(greqs)
            if reqs:
                _wait(reqs)
                block = [*nxt_kv, *grads]
            else:
                dk, dv = grads  # our own block's gradients, back from its trip round the ring
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    length: int,
    causal: bool = True,
    group: Any = None,
    scale: float | None = None,
    segments: Tensor | None = None,
) -> Tensor:
    """Context-parallel attention of this rank's zigzag shards (see `RingAttention`); differentiable.

    `k` and `v` may have fewer heads than `q` (grouped-query attention): they are repeated to match.
    `scale` multiplies the scores (None: 1 / sqrt(head_dim)). `segments`: the whole sequence's segment
    (document) id per position, `[batch, length]`, the same on every rank; a query sees only keys with its
    id. Give every padding cell one id of its own (e.g. -1): it then sees only padding, never empty."""
    if q.shape[1] != k.shape[1]:
        if q.shape[1] % k.shape[1]:
            raise ValueError(
                f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})"
            )
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if segments is not None and tuple(segments.shape) != (q.shape[0], length):
        raise ValueError(
            f"segments must be [batch, length] = [{q.shape[0]}, {length}], got {list(segments.shape)}"
        )
    expected = zigzag_positions(length, dist.get_world_size(group), dist.get_rank(group)).numel()
    if q.shape[2] != expected or k.shape[2] != expected:
        raise ValueError(
            f"this rank's shard of a length-{length} sequence has {expected} tokens, got {q.shape[2]}"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return RingAttention.apply(q, k, v, length, causal, group, scale, segments)
