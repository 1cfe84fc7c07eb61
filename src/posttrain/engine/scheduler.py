"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Owns the waiting and running queues, the per-step token budget (chunked prefill: a long prompt is
split over steps; running decodes always go first, each with its speculative draft if it has one),
preemption by recompute when blocks run out (the most recently admitted sequence goes first, back to
the front of the queue, so the oldest always progresses: no starvation). Does not run the model or
sample.
"""

from __future__ import annotations

from collections import deque

from posttrain.engine.block_manager import BlockManager
from posttrain.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _slots(self, seq: Sequence) -> int:
        return seq.num_forks if seq.num_forks > 1 else 1

    def preempt(self, seq: Sequence) -> None:
        self.bm.free_seq(seq)
        seq.draft = []
        seq.status = Status.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step's work: (sequence, number of its tokens to compute). Running decodes (one token
        each) go first, so a long prompt's chunks never stall them; then running prefills, then waiting."""
        budget = self.max_num_batched_tokens
        out: list[tuple[Sequence, int]] = []
        preempted = False
        decodes = [s for s in self.running if s.is_decoding]
        for seq in decodes + [s for s in self.running if not s.is_decoding]:
            if budget <= 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this step
            if seq.draft and not seq.is_decoding:
                seq.draft = []
            n = min(seq.num_uncomputed + len(seq.draft), budget)
            del seq.draft[max(0, n - 1) :]  # a draft verifies after the last token, as far as the budget goes
            while not self.bm.ensure(seq, seq.num_computed + n):
                victim = self.running[-1]
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
                for j, (done, m) in enumerate(out):
                    if done is victim:  # already scheduled this step: give its tokens back
                        del out[j]
                        budget += m
                        break
            else:
                out.append((seq, n))
                budget -= n
        if preempted:
            return out
        used_slots = sum(self._slots(s) for s in self.running)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if used_slots + self._slots(seq) > self.max_num_seqs:
                break
            if not seq.block_table:
                self.bm.allocate_cached_prefix(seq)
            n = min(seq.num_uncomputed, budget)
            if not self.bm.ensure(seq, seq.num_computed + n):
                self.bm.free_seq(seq)  # drop its cached-prefix references until it can run
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            used_slots += self._slots(seq)
            out.append((seq, n))
            budget -= n
        return out

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self.bm.free_seq(seq)
        self.running.remove(seq)
