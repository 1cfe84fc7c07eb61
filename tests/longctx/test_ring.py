"""Ring attention over gloo in 2 and 4 CPU processes equals full attention: outputs within 1e-5 and
gradients within 1e-4, causal and not, odd lengths, grouped-query heads, packed rows (documents back to
back, padding at the end) against a block-diagonal mask; zigzag shards balance the
causal work; the activations a rank keeps for backward shrink with the number of ranks."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from posttrain.bench.longctx import saved_bytes_and_seconds
from posttrain.longctx.ring import ring_attention, shard, unshard, zigzag_positions

CASES = [  # (length, heads, kv heads, causal, documents per row: their lengths, or None for one sequence)
    (37, 2, 2, True, None),
    (37, 2, 2, False, None),
    (64, 4, 2, True, None),
    (9, 1, 1, True, None),
    # packed rows: row 0 three documents and 4 padding cells, row 1 two documents filling it; a
    # document shorter than a zigzag chunk, and documents that straddle ranks
    (37, 2, 2, True, ([5, 20, 8], [30, 7])),
    (37, 2, 1, False, ([5, 20, 8], [30, 7])),
]


def segment_ids(length: int, docs: tuple[list[int], ...]) -> torch.Tensor:
    """`[rows, length]` document ids: row i's documents back to back (ids 0, 1, ...), then -1 padding."""
    out = torch.full((len(docs), length), -1, dtype=torch.long)
    for i, lens in enumerate(docs):
        out[i, : sum(lens)] = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    return out


def _full(q, k, v, causal, segments=None):
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n = q.shape[2]
    if causal:
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    if segments is not None:  # block-diagonal: a query sees its own document (padding: other padding)
        same = segments[:, None, :, None] == segments[:, None, None, :]
        scores = scores.masked_fill(~same, float("-inf"))
    return torch.softmax(scores, -1) @ v


def _worker(rank: int, world: int, init: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = []
    for length, heads, kv_heads, causal, docs in CASES:
        g = torch.Generator().manual_seed(length * 10 + heads)
        seg = None if docs is None else segment_ids(length, docs)
        q = torch.randn(2, heads, length, 8, generator=g, dtype=torch.float64)
        k = torch.randn(2, kv_heads, length, 8, generator=g, dtype=torch.float64)
        v = torch.randn(2, kv_heads, length, 8, generator=g, dtype=torch.float64)
        dout = torch.randn(2, heads, length, 8, generator=g, dtype=torch.float64)
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = _full(*ref_in, causal, seg)
        ref.backward(dout)
        local = [shard(t, 2, world, rank).float().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*local, length=length, causal=causal, segments=seg)
        out.backward(shard(dout, 2, world, rank).float())
        errors = {"out": float((out.double() - shard(ref, 2, world, rank)).abs().max())}
        for name, mine, theirs in zip("qkv", local, ref_in, strict=True):
            errors[f"d{name}"] = float((mine.grad.double() - shard(theirs.grad, 2, world, rank)).abs().max())
        results.append(errors)
    # memory: what one rank keeps for backward, for a 512-token causal sequence
    n = 512
    q = torch.randn(1, 2, n, 16)
    local = [shard(q, 2, world, rank).requires_grad_() for _ in range(3)]
    saved, _ = saved_bytes_and_seconds(lambda: ring_attention(*local, length=n, causal=True))
    with open(f"{out_dir}/rank{rank}.json", "w") as fh:
        json.dump({"cases": results, "saved_bytes": saved}, fh)
    dist.destroy_process_group()


def _spawn(world: int, tmp_path) -> list[dict]:
    # fork: the workers start without importing torch again (4 spawned interpreters took ~40 s on 2 busy cores)
    mp.start_processes(
        _worker,
        args=(world, f"file://{tmp_path}/rendezvous", str(tmp_path)),
        nprocs=world,
        start_method="fork",
    )
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_equals_full_attention(world, tmp_path):
    ranks = _spawn(world, tmp_path)
    for rank in ranks:
        for case, errors in zip(CASES, rank["cases"], strict=True):
            assert errors["out"] < 1e-5, (case, errors)
            assert max(errors["dq"], errors["dk"], errors["dv"]) < 1e-4, (case, errors)
    # saved for backward: q, k, v, out (float32) and the log-sum-exp, of this rank's 512 / world tokens
    local = 512 // world
    assert all(r["saved_bytes"] == 4 * (4 * 2 * local * 16 + 2 * local) for r in ranks)


def test_zigzag_shards_cover_the_sequence_once_and_balance_causal_work():
    for length, world in ((37, 2), (64, 4), (9, 4), (1000, 8)):
        parts = [zigzag_positions(length, world, r) for r in range(world)]
        assert sorted(torch.cat(parts).tolist()) == list(range(length))
        # causal work of a rank = sum over its queries of (position + 1) visible keys
        work = [int((p + 1).sum()) for p in parts]
        if length % (2 * world) == 0:
            assert len(set(work)) == 1
        assert max(work) / min(work) < 1.2 or length < 4 * world
    x = torch.arange(2 * 37 * 3).view(2, 37, 3)
    assert torch.equal(unshard([shard(x, 1, 4, r) for r in range(4)], 1), x)
    with pytest.raises(ValueError, match="rank must be in"):
        zigzag_positions(10, 2, 2)


def test_segments_of_the_wrong_shape_are_refused():
    q = torch.zeros(2, 1, 5, 4)
    with pytest.raises(ValueError, match=r"segments must be \[batch, length\] = \[2, 9\], got \[2, 5\]"):
        ring_attention(q, q, q, length=9, segments=torch.zeros(2, 5, dtype=torch.long))
