"""One sequence being generated: its tokens, how many have KV in the cache, its block table.

Owns per-sequence state (tokens, sampled logprobs, the sampling generator, stop bookkeeping). Does
not allocate blocks (block_manager.py) or decide when it runs (scheduler.py).
"""

from __future__ import annotations

import enum
import itertools

import torch

from posttrain.engine.constrained import Constraint
from posttrain.engine.speculative import NgramIndex
from posttrain.engine.types import SamplingParams
from posttrain.types import ImagePart

_UIDS = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Tokens = prompt + generated; `num_computed` of them have their K/V in the cache."""

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt: list[int],
        params: SamplingParams,
        generator: torch.Generator,
        arrival_s: float,
        num_forks: int = 1,
    ) -> None:
        self.request_id = request_id
        self.index = index  # which of the request's n completions
        self.token_ids: list[int] = list(prompt)
        self.num_prompt = len(prompt)
        self.params = params
        self.generator = generator
        self.arrival_s = arrival_s
        self.num_forks = num_forks  # > 1: fork into this many sequences when the prompt is prefilled
        self.num_computed = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chain hashes of this sequence's full, computed blocks
        self.logprobs: list[float] = []
        # per generated token, the top-N (token, logprob) pairs; filled only when params.top_logprobs > 0
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.first_token_s: float | None = None
        self.num_emitted = 0  # completion tokens already handed to a stream
        self.uid = next(_UIDS)  # unique for the process's lifetime (id() may be reused)
        self.num_frees = 0  # times its blocks were freed (preemption): cached K/V from before are stale
        self.draft: list[int] = []  # speculative tokens to verify after the last one (never in token_ids)
        self.ngram: NgramIndex | None = None  # prompt-lookup index over token_ids (speculative engines)
        self.constraint: Constraint | None = None  # the grammar of params.json_schema, at this position
        # MoE: per position fed to the model so far, its expert ids [sparse layers, top_k] (None: not seen)
        self.routing: list[torch.Tensor | None] = []
        # vision: the images behind the prompt's placeholders; position -> (image sha256, feature index)
        self.images: list[ImagePart] = []
        self.image_at: dict[int, tuple[str, int]] = {}
        self.image_embeds: torch.Tensor | None = None  # [placeholders, hidden], computed at first prefill
        # M-RoPE (Qwen2-VL): the (t, h, w) positions of prompt tokens whose components differ (image
        # rows), the prompt's RoPE positions, and what a token after the prompt adds to its index
        self.mrope_at: dict[int, tuple[int, int, int]] = {}
        self.prompt_positions: list[int] | None = None
        self.rope_delta = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    def set_images(self, images: list[ImagePart], positions: list[int], counts: list[int]) -> None:
        """The images filling the placeholders at `positions`, in order, `counts[i]` for image i."""
        owner = [img.sha256 for img, n in zip(images, counts, strict=True) for _ in range(n)]
        self.images = list(images)
        self.image_at = {p: (owner[i], i) for i, p in enumerate(positions)}

    def set_rope(self, positions: torch.Tensor, delta: int) -> None:
        """The prompt's M-RoPE positions `[3, num_prompt]` and the rope delta (models/qwen2_vl.py)."""
        if tuple(positions.shape) != (3, self.num_prompt):
            raise ValueError(
                f"M-RoPE positions of shape {tuple(positions.shape)} for {self.num_prompt} tokens"
            )
        differ = ((positions != positions[:1]).any(dim=0)).nonzero().flatten().tolist()
        self.mrope_at = {p: tuple(positions[:, p].tolist()) for p in differ}
        self.prompt_positions = positions[0].tolist()
        self.rope_delta = int(delta)

    def rope_positions(self, start: int, n: int) -> list[int] | range:
        """The RoPE positions of tokens start .. start + n: their indices, or under M-RoPE the prompt's
        (temporal) positions and, after the prompt, the index plus the rope delta."""
        if self.prompt_positions is None:
            return range(start, start + n)
        head = self.prompt_positions[start : start + n]
        return head + [p + self.rope_delta for p in range(max(start, self.num_prompt), start + n)]

    def block_key(self, j: int, block_size: int) -> tuple:
        """What the prefix cache keys block j by: its token ids, plus the hash of the image behind each
        placeholder in it (two images behind the same placeholder ids never share a block)."""
        lo, hi = j * block_size, (j + 1) * block_size
        tokens = tuple(self.token_ids[lo:hi])
        if not self.image_at:
            return tokens
        return tokens + tuple(self.image_at[p][0] for p in range(lo, hi) if p in self.image_at)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def kv_key(self) -> tuple[int, int]:
        """Names this sequence's cached K/V: changes when they are dropped (see decode_stage.py)."""
        return (self.uid, self.num_frees)

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_decoding(self) -> bool:
        """One token (the last sampled) lacks K/V: the next step decodes (or verifies a draft after it)."""
        return len(self.token_ids) - self.num_computed == 1

    def fork(self, index: int, generator: torch.Generator) -> Sequence:
        """A sibling sharing this sequence's tokens so far (the block table is shared by the block manager)."""
        child = Sequence(self.request_id, index, self.token_ids, self.params, generator, self.arrival_s)
        child.num_prompt = self.num_prompt
        child.num_computed = self.num_computed
        child.block_hashes = list(self.block_hashes)
        child.logprobs = list(self.logprobs)
        child.top_logprobs = list(self.top_logprobs)
        child.status = self.status
        child.ngram = self.ngram.copy() if self.ngram is not None else None
        child.constraint = self.constraint.copy() if self.constraint is not None else None
        child.routing = list(self.routing)
        child.images, child.image_at, child.image_embeds = self.images, self.image_at, self.image_embeds
        child.mrope_at, child.prompt_positions = self.mrope_at, self.prompt_positions
        child.rope_delta = self.rope_delta
        return child
