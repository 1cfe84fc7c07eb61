"""The KV block pool's bookkeeping: free list, reference counts, prefix hashing, copy-on-write.

Owns which physical block holds which sequence's tokens. Full, computed blocks are hashed (chained
with the previous block's hash) so identical prompt prefixes across requests reuse them; forked
samples share blocks and copy the shared last partial block before writing to it. Freed blocks keep
their hash until reused (an LRU cache). A block's key is its token ids plus the content hashes of
the images behind any placeholders in it (`Sequence.block_key`). Does not touch tensors: copies are
returned to the runner.
"""

from __future__ import annotations

from collections import OrderedDict

from posttrain.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.taken: list[int] = []  # handed out since the last drain_taken()
        self.block_tokens: list[tuple | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) for the runner, before the next forward
        self.prefix_hit_tokens = 0
        self.shared_fork_blocks = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    def reset_prefix_cache(self) -> None:
        """Forget every hash (after a weight update the cached K/V belong to the old weights)."""
        self.hash_to_block.clear()
        self.block_hash = [None] * self.num_blocks
        self.block_tokens = [None] * self.num_blocks

    def drain_taken(self) -> list[int]:
        """Blocks handed out since the last call: their memory holds whatever was there before (the
        pool is allocated uninitialised), so the runner zeroes them before the next forward."""
        taken, self.taken = self.taken, []
        return taken

    def _take(self) -> int:
        block, _ = self.free.popitem(last=False)
        self.taken.append(block)
        h = self.block_hash[block]
        if h is not None and self.hash_to_block.get(h) == block:
            del self.hash_to_block[h]
        self.block_hash[block] = None
        self.block_tokens[block] = None
        self.ref_count[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free[block] = None  # most recently freed last: evicted last

    def _chain_hash(self, prev: int | None, tokens: tuple[int, ...]) -> int:
        return hash((prev, tokens))

    def allocate_cached_prefix(self, seq: Sequence) -> None:
        """Point a fresh sequence at cached blocks of its longest hashed prefix (at least one token stays uncomputed)."""
        assert not seq.block_table and seq.num_computed == 0
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        max_full = (len(seq) - 1) // bs  # keep >= 1 token to compute, so the step yields logits
        prev: int | None = None
        for j in range(max_full):
            tokens = seq.block_key(j, bs)
            h = self._chain_hash(prev, tokens)
            block = self.hash_to_block.get(h)
            if block is None or self.block_tokens[block] != tokens:
                break
            if self.ref_count[block] == 0:
                del self.free[block]
            self.ref_count[block] += 1
            seq.block_table.append(block)
            seq.block_hashes.append(h)
            prev = h
        seq.num_computed = len(seq.block_table) * bs
        self.prefix_hit_tokens += seq.num_computed

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Fresh blocks to let `seq` hold its first `num_tokens` tokens and write from num_computed on."""
        need = max(0, -(-num_tokens // self.block_size) - len(seq.block_table))
        j = seq.num_computed // self.block_size
        if j < len(seq.block_table) and self.ref_count[seq.block_table[j]] > 1:
            need += 1  # copy-on-write of a shared partial block
        return need

    def ensure(self, seq: Sequence, num_tokens: int) -> bool:
        """Allocate what `blocks_needed` says; False (and nothing changed) if the pool is short."""
        if self.blocks_needed(seq, num_tokens) > self.num_free:
            return False
        j = seq.num_computed // self.block_size
        if j < len(seq.block_table) and self.ref_count[seq.block_table[j]] > 1:
            old = seq.block_table[j]
            new = self._take()
            self.pending_copies.append((old, new))
            self.ref_count[old] -= 1
            seq.block_table[j] = new
        while len(seq.block_table) * self.block_size < num_tokens:
            seq.block_table.append(self._take())
        return True

    def free_seq(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed = 0
        seq.num_frees += 1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        child.block_table = list(parent.block_table)
        for block in child.block_table:
            self.ref_count[block] += 1
        self.shared_fork_blocks += len(child.block_table)

    def register_full_blocks(self, seq: Sequence) -> None:
        """Hash the blocks that became full and computed, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed // bs
        while len(seq.block_hashes) < num_full:
            j = len(seq.block_hashes)
            tokens = seq.block_key(j, bs)
            prev = seq.block_hashes[-1] if seq.block_hashes else None
            h = self._chain_hash(prev, tokens)
            block = seq.block_table[j]
            if self.block_hash[block] is None and h not in self.hash_to_block:
                self.block_hash[block] = h
                self.block_tokens[block] = tokens
                self.hash_to_block[h] = block
            seq.block_hashes.append(h)

    def stats(self, seqs: list[Sequence]) -> dict:
        """Blocks in use, tokens they hold (shared blocks counted once) and the waste fraction."""
        filled: dict[int, int] = {}
        logical = 0
        for seq in seqs:
            logical += seq.num_computed
            for j, block in enumerate(seq.block_table):
                n = max(0, min(self.block_size, seq.num_computed - j * self.block_size))
                filled[block] = max(filled.get(block, 0), n)
        used = self.num_blocks - self.num_free
        stored = sum(filled.values())
        capacity = len(filled) * self.block_size
        return {
            "blocks_total": self.num_blocks,
            "blocks_allocated": used,
            "blocks_in_tables": len(filled),
            "tokens_stored": stored,
            "tokens_logical": logical,
            "waste_frac": (1.0 - stored / capacity) if capacity else 0.0,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "fork_shared_blocks": self.shared_fork_blocks,
        }
