"""Context-parallel Learner ranks (`trainer.context_parallel: N`): every sequence split zigzag over N
processes, attention through `posttrain.longctx.ring`, logprobs (and a critic's values) gathered.

Each rank holds the whole model and gets the whole batch (the same calls in the same order, as tensor
parallelism does); in a forward it runs the decoder over its zigzag shard of every row only (chunks r and
2N-1-r of 2N, with their true position ids), the attention of the HF model going round the ring (the
`ring` attention implementation registered with transformers here, set on the policy, the reference and
the critic's decoder). Each rank computes the logprobs and entropy (and the critic's values) of the
targets its positions predict; a sum over the ranks gives every rank the full `[rows, L]` matrices, so the
losses, the GAE advantages and the metrics are the single process's.
The gathered matrices pass their gradient straight back (every rank computes the same loss), the ring's
backward returns each rank the dK/dV its tokens received from the others, and the parameter gradients
(the policy's and the critic's) are summed over the ranks before clipping: the sum is the single-process
gradient.

With trainer.data_parallel or tensor_parallel > 1 too, `train.distributed.parallelize_dp_cp` makes each
rank one of a cp group inside a dp x cp (x tp) mesh (FSDP2 sums the gradients then, the critic's too;
under tp a rank's ring carries its share of the heads). Rows are padded, one sequence each (causal
attention never reads the padding at a row's end), or under trainer.packing packed first-fit as in the
one-process Learner (`train.batch.pack_rows`): each packed row is split zigzag like any other, its
position ids restart per sequence, and the ring masks attention to each sequence's own tokens from the
segment ids every rank holds. Shared-prompt micro-batches and dynamic NTK (its frequencies depend on a
rank's positions) are not supported. Does not know about environments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from posttrain.longctx.ring import ring_attention, zigzag_positions
from posttrain.train.batch import pack_rows
from posttrain.train.forward import Targets, causal_lm, chunked_logprobs, scatter_rows, select_targets

ATTENTION = "ring"


def _ring_attention_forward(
    module: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention interface over the ring: `query` etc. are this rank's zigzag shard
    `[batch, heads, local, head_dim]`; `ring_length`, `ring_group` and `ring_segments` (packed rows'
    segment ids, or None) come in through the decoder's kwargs."""
    if "ring_length" not in kwargs:
        raise RuntimeError(
            "the ring attention implementation runs only inside a context-parallel Learner forward "
            "(ring_length not given)"
        )
    if dropout:
        raise ValueError(f"context parallelism does not support attention dropout (got {dropout})")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("context parallelism does not support sliding-window attention")
    out = ring_attention(
        query,
        key,
        value,
        length=int(kwargs["ring_length"]),
        causal=True,
        group=kwargs.get("ring_group"),
        scale=scaling,
        segments=kwargs.get("ring_segments"),
    )
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    # the ring applies the causal mask from global positions (and packed rows' segment ids); padding sits
    # at the end of each row
    return None


def register_ring_attention() -> None:
    """Register `ring` with transformers' attention and mask interfaces (idempotent)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(ATTENTION, _ring_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, _no_mask)


class _SumOverRanks(torch.autograd.Function):
    """Forward: the sum over the ranks of each rank's (disjoint) matrices. Backward: the gradient as it
    is (every rank computes the same loss from the sum), and zeros for `anchor`, this rank's decoder
    output, so that every rank runs the whole backward (its ring steps are collectives) even when none
    of its positions carries a loss."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, group: Any, *parts: Tensor) -> tuple[Tensor, ...]:
        ctx.anchor_shape, ctx.anchor_dtype = anchor.shape, anchor.dtype
        out = []
        for p in parts:
            total = p.detach().clone()
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
            out.append(total)
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        zeros = torch.zeros(ctx.anchor_shape, dtype=ctx.anchor_dtype, device=grads[0].device)
        return (zeros, None, *grads)


@dataclass
class ContextParallel:
    """This process's place in a context-parallel group, and the Learner forward over its shards."""

    rank: int
    world: int
    group: Any = None
    packed: bool = False  # trainer.packing: several sequences per row, attention kept within each

    def positions(self, width: int, device: torch.device) -> Tensor:
        """Global positions of this rank's columns of a `width`-wide row (zigzag)."""
        return zigzag_positions(width, self.world, self.rank).to(device)

    def _shard_hidden(
        self, decoder: Any, batch: Any, mask: Tensor, autocast: Any
    ) -> tuple[Tensor, Tensor, Targets]:
        """This rank's decoder output `[b, local, H]` over its zigzag shard of every row (under `autocast`),
        the hidden states `[n, H]` predicting the targets of `mask` whose predicting position is this
        rank's, and those targets."""
        device = batch.token_ids.device
        segments = None
        if self.packed:
            ids, pos_ids, segments, offsets = pack_rows(batch.token_ids, [int(n) for n in batch.lengths])
        else:
            ids = batch.token_ids
            offsets = torch.arange(ids.shape[0], device=device) * ids.shape[1]
        rows, width = ids.shape
        pos = self.positions(width, device)
        local_of = torch.full((width,), -1, dtype=torch.long, device=device)
        local_of[pos] = torch.arange(pos.numel(), device=device)
        with autocast:
            out = decoder(
                input_ids=ids.index_select(1, pos),
                position_ids=pos_ids.index_select(1, pos) if self.packed else pos.expand(rows, -1),
                use_cache=False,
                ring_length=width,
                ring_group=self.group,
                ring_segments=segments,
            )
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        targets = select_targets(mask, batch.token_ids, offsets)
        # the predicting position's row and column in the (padded or packed) layout
        row, col = targets.src // width, targets.src % width
        here = local_of[col] >= 0  # the position predicting the target is this rank's
        src = row[here] * pos.numel() + local_of[col[here]]
        mine = Targets(targets.rows[here], targets.cols[here], src, targets.token[here])
        return hidden, hidden.reshape(-1, hidden.shape[-1])[mine.src], mine

    def policy_forward(
        self,
        model: Any,
        batch: Any,
        mask: Tensor,
        temperature: float,
        chunk_tokens: int,
        autocast: Any,
    ) -> tuple[Tensor, Tensor]:
        """The Learner's `(logprobs, entropy)` `[b, L]` of `mask`'s targets (the LM head by chunks of
        `chunk_tokens`, the decoder under the `autocast` context), this rank running its shard of every
        row; every rank returns the whole matrices."""
        lm = causal_lm(model)
        hidden, h, mine = self._shard_hidden(lm.get_decoder(), batch, mask, autocast)
        with autocast:
            lp, ent = chunked_logprobs(lm.get_output_embeddings(), h, mine.token, chunk_tokens, temperature)
        shape = tuple(batch.token_ids.shape)
        lp_full, ent_full = _SumOverRanks.apply(
            hidden, self.group, scatter_rows(lp, mine, shape), scatter_rows(ent, mine, shape)
        )
        return lp_full, ent_full

    def value_forward(self, critic: Any, batch: Any, mask: Tensor, autocast: Any) -> Tensor:
        """The Learner's values `[b, L]` (float32) at `mask`'s targets: the critic (`train.forward.ValueModel`)
        runs its decoder over this rank's shard of every row, its head on the positions predicting them;
        every rank returns the whole matrix."""
        hidden, h, mine = self._shard_hidden(critic.decoder, batch, mask, autocast)
        with autocast:
            v = critic.head(h).squeeze(-1).float()
        (v_full,) = _SumOverRanks.apply(
            hidden, self.group, scatter_rows(v, mine, tuple(batch.token_ids.shape))
        )
        return v_full

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the parameter gradients over the ranks (each rank's are those of its positions)."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        at = 0
        for g in grads:
            g.copy_(flat[at : at + g.numel()].view_as(g))
            at += g.numel()


def context_parallel_learner(learner: Any, group: Any = None) -> ContextParallel:
    """Make `learner` (built in each rank's process with the same config and seed) one rank of a
    `trainer.context_parallel`-way group over `group` (default: the whole initialised world)."""
    tc = learner.trainer_cfg
    n = int(tc.context_parallel)
    if learner.dynamic_rope:
        raise ValueError(
            "trainer.context_parallel > 1 does not support dynamic NTK rope scaling (its frequencies depend "
            "on the positions a rank holds); use yarn, linear or llama3"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            f"trainer.context_parallel={n} needs torch.distributed initialised with {n} processes, one "
            f"Learner in each (init_process_group, e.g. under torchrun --nproc-per-node {n})"
        )
    world = dist.get_world_size(group)
    if world != n:
        raise ValueError(f"trainer.context_parallel={n} but the process group has {world} ranks")
    register_ring_attention()
    for model in (learner.model, learner.reference):
        if model is not None:
            causal_lm(model).set_attn_implementation(ATTENTION)
    if learner.critic is not None:
        learner.critic.decoder.set_attn_implementation(ATTENTION)
    return ContextParallel(dist.get_rank(group), world, group, packed=bool(tc.packing))
