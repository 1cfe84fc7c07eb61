"""Training batches: `Sample` (one trajectory as token ids), the typed `Batch`, micro-batch planning
and the model inputs for a micro-batch, padded or packed.

Layout: every per-token tensor is `[rows, max_len]` in token-position layout; column t is token t, and
its logprob is predicted from position t-1, so column 0 never carries a loss. Packing places several
sequences in one row with a block-diagonal causal mask and per-sequence position ids. No model here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch
from torch import Tensor


@dataclass
class Sample:
    """One sequence (a trajectory), built from the engine's token ids directly."""

    token_ids: list[int]
    loss_mask: list[int]  # 1 on model-generated tokens
    behavior_logprobs: list[float]  # per token, from the engine (0.0 where mask is 0)
    reward: float
    group_id: int  # samples of one GRPO group share group_id
    policy_version: int = 0
    images: list[str] = field(default_factory=list)  # content hashes of the placeholders' images, in order
    # MoE: the engine's expert ids per position fed (len(token_ids) - 1), [position][layer][top_k]
    routing: list[list[list[int]]] | None = None

    def validate(self, index: int = 0) -> None:
        n = len(self.token_ids)
        if n < 2:
            raise ValueError(
                f"sample {index}: needs at least 2 tokens (a prompt token and a generated one), got {n}"
            )
        if len(self.loss_mask) != n or len(self.behavior_logprobs) != n:
            raise ValueError(
                f"sample {index}: token_ids, loss_mask and behavior_logprobs must have the same length; got "
                f"{n}, {len(self.loss_mask)}, {len(self.behavior_logprobs)}"
            )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError(f"sample {index}: loss_mask must hold only 0 and 1")
        if self.loss_mask[0] != 0:
            raise ValueError(
                f"sample {index}: loss_mask[0] is 1, but the first token has no logprob (nothing predicts it); "
                "a sample must start with at least one prompt token"
            )
        if self.routing is not None and len(self.routing) != n - 1:
            raise ValueError(
                f"sample {index}: routing must cover the {n - 1} positions fed to the model (all tokens but "
                f"the last), got {len(self.routing)}"
            )
        if not any(self.loss_mask):
            raise ValueError(f"sample {index}: loss_mask has no 1s: there is no generated token to train on")


@dataclass
class Batch:
    """A batch of sequences as right-padded `[B, L]` tensors plus what `step` computes for it."""

    token_ids: Tensor  # [B, L] long, 0 after a row's length
    lengths: Tensor  # [B] long
    loss_mask: Tensor  # [B, L] float, generated tokens
    behavior_logprobs: Tensor  # [B, L] float
    rewards: Tensor  # [B] float
    group_ids: Tensor  # [B] long
    policy_versions: Tensor  # [B] long
    routing: Tensor | None = None  # [B, L, sparse layers, top_k] the engine's expert ids; -1: unknown
    # set together by the RL step's prepare (train/update.py `prepare_batch`), before the update
    old_logprobs: Tensor | None = None  # learner logprobs before the update (the PPO ratio's denominator)
    ref_logprobs: Tensor | None = None
    old_values: Tensor | None = None
    advantages: Tensor | None = None
    returns: Tensor | None = None
    is_weights: Tensor | None = None  # truncated importance weights (behaviour -> learner), detached
    policy_mask: Tensor | None = None  # loss_mask minus ratio-masked tokens
    meta: dict = field(default_factory=dict)
    images: list[list[str]] = field(default_factory=list)  # per row (vision policies): image hashes; [] none

    @property
    def size(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def train_mask(self) -> Tensor:
        return self.policy_mask if self.policy_mask is not None else self.loss_mask

    def select(self, rows: Tensor | list[int]) -> Batch:
        """The rows `rows`, trimmed to their longest length."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.token_ids.device)
        width = int(self.lengths[idx].max().item()) if idx.numel() else 0
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                v = v[idx]
                if v.ndim >= 2:
                    v = v[:, :width]
            out[f.name] = v
        out["meta"] = dict(self.meta)
        out["images"] = [self.images[int(i)] for i in idx.tolist()] if self.images else []
        return replace(self, **out)

    def to(self, device: torch.device | str) -> Batch:
        return replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in fields(self)
                if isinstance(getattr(self, f.name), Tensor)
            },
        )


def build_batch(samples: list[Sample], device: torch.device | str = "cpu") -> Batch:
    """Validate samples and pad them into a `Batch`."""
    if not samples:
        raise ValueError("empty batch: step()/update() need at least one sample")
    for i, s in enumerate(samples):
        s.validate(i)
    lengths = [len(s.token_ids) for s in samples]
    b, width = len(samples), max(lengths)
    ids = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.float32)
    blp = torch.zeros(b, width, dtype=torch.float32)
    for i, s in enumerate(samples):
        n = lengths[i]
        ids[i, :n] = torch.tensor(s.token_ids, dtype=torch.long)
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        blp[i, :n] = torch.tensor(s.behavior_logprobs, dtype=torch.float32) * mask[i, :n]
    routing = None
    shapes = {(len(s.routing[0]), len(s.routing[0][0])) for s in samples if s.routing}
    if len(shapes) > 1:
        raise ValueError(f"samples' routing differ in [layers, top_k]: {sorted(shapes)}")
    if shapes:
        routing = torch.full((b, width, *shapes.pop()), -1, dtype=torch.long)
        for i, s in enumerate(samples):
            if s.routing:
                routing[i, : len(s.routing)] = torch.tensor(s.routing, dtype=torch.long)
    return Batch(
        token_ids=ids,
        lengths=torch.tensor(lengths, dtype=torch.long),
        loss_mask=mask,
        behavior_logprobs=blp,
        rewards=torch.tensor([float(s.reward) for s in samples], dtype=torch.float32),
        group_ids=torch.tensor([int(s.group_id) for s in samples], dtype=torch.long),
        policy_versions=torch.tensor([int(s.policy_version) for s in samples], dtype=torch.long),
        images=[list(s.images) for s in samples] if any(s.images for s in samples) else [],
        routing=routing,
    ).to(device)


def last_token_index(mask: Tensor) -> Tensor:
    """[B] index of each row's last masked position (rows must have at least one)."""
    width = mask.shape[1]
    pos = torch.arange(width, device=mask.device).expand_as(mask)
    return torch.where(mask > 0, pos, torch.full_like(pos, -1)).max(dim=1).values


def plan_micro_batches(lengths: list[int], token_budget: int, packed: bool) -> list[list[int]]:
    """Split rows (sorted by length, longest first) into micro-batches of at most `token_budget`
    tokens: the sum of lengths when packed, rows x longest when padded. A longer row goes alone."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    micro: list[list[int]] = []
    cur: list[int] = []
    cur_sum = cur_max = 0
    for i in order:
        n = lengths[i]
        new_sum, new_max = cur_sum + n, max(cur_max, n)
        cost = new_sum if packed else new_max * (len(cur) + 1)
        if cur and cost > token_budget:
            micro.append(cur)
            cur, cur_sum, cur_max = [], 0, 0
            new_sum, new_max = n, n
        cur.append(i)
        cur_sum, cur_max = new_sum, new_max
    if cur:
        micro.append(cur)
    return micro


def shared_prefix_length(token_ids: Tensor, loss_mask: Tensor, lengths: Tensor) -> int:
    """Tokens at the start of every row that are identical across rows and carry no loss (the
    prompt a GRPO group shares); 0 when the rows share nothing or there is only one row."""
    if token_ids.shape[0] < 2:
        return 0
    first_loss = int((loss_mask > 0).float().argmax(dim=1).min().item())
    bound = min(first_loss, int(lengths.min().item()) - 1)
    if bound <= 0:
        return 0
    same = (token_ids[:, :bound] == token_ids[:1, :bound]).all(dim=0)
    return bound if bool(same.all()) else int(same.float().argmin().item())


def _split_group(rows: list[int], lens: list[int], prefix: int, token_budget: int) -> list[list[int]]:
    """Split a group's rows (longest first) into as few chunks as fit `token_budget` positions each:
    a chunk computes its prefix once plus its rows' suffixes back to back, without padding
    (`forward.shared_prefix_hidden`), so fewer, longer chunks are always cheaper (measured: a
    second pass of the 135M model costs ~0.3 s more than the positions it saves). A row over the
    budget on its own still gets a chunk."""
    chunks: list[list[int]] = []
    used = 0
    for i in rows:
        suffix = lens[i] - prefix
        if chunks and used + suffix <= token_budget:
            chunks[-1].append(i)
            used += suffix
        else:
            chunks.append([i])
            used = prefix + suffix
    return chunks


def plan_shared_micro_batches(
    token_ids: Tensor,
    loss_mask: Tensor,
    lengths: Tensor,
    group_ids: Tensor,
    token_budget: int,
    packed: bool,
    min_prefix: int = 1,
) -> list[tuple[list[int], int]]:
    """Micro-batches as (rows, shared prefix length). The rows of one group whose prompt is identical
    go together, split into chunks by `_split_group` only when over budget (a chunk costs its prefix
    once plus its rows' suffixes), with their prefix length; rows that share nothing with their group (prefix shorter than
    `min_prefix`, or groups of one) fall back to `plan_micro_batches` with prefix 0."""
    plan: list[tuple[list[int], int]] = []
    loners: list[int] = []
    lens = [int(x) for x in lengths.tolist()]
    by_group: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids.tolist()):
        by_group.setdefault(int(g), []).append(i)
    for rows in by_group.values():
        idx = torch.as_tensor(rows, device=token_ids.device)
        p = shared_prefix_length(token_ids[idx], loss_mask[idx], lengths[idx])
        if p < min_prefix:
            loners.extend(rows)
            continue
        for chunk in _split_group(sorted(rows, key=lambda i: -lens[i]), lens, p, token_budget):
            plan.append((chunk, p) if len(chunk) > 1 else (chunk, 0))
    if loners:
        sub = plan_micro_batches([lens[i] for i in loners], token_budget, packed)
        plan.extend(([loners[j] for j in mb], 0) for mb in sub)
    return plan


@dataclass
class ModelInputs:
    """What the decoder sees for a micro-batch, and where each row's tokens landed in it."""

    input_ids: Tensor  # [R, C]
    position_ids: Tensor  # [R, C]; [3, R, C] under M-RoPE (train/vision.py)
    attention_mask: Tensor  # [R, C] (padded) or [R, 1, C, C] bool block-causal (packed)
    flat_offset: Tensor  # [B] offset of each row's token 0 in input_ids.view(-1)
    tokens: int  # real tokens (for throughput)
    cells: int  # R * C (tokens computed, padding included)
    inputs_embeds: Tensor | None = None  # [R, C, H] instead of input_ids' embeddings (train/vision.py)


def pack_rows(token_ids: Tensor, lens: list[int], pad_id: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sequences `token_ids[i, :lens[i]]` packed first-fit-decreasing into rows as wide as the longest:
    (ids `[R, C]`, position ids restarting at 0 per sequence, segment ids (the sequence's index; -1 on
    padding), the flat offset `[B]` of each sequence's token 0 in ids.view(-1))."""
    device = token_ids.device
    cap = max(lens)
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lens)), key=lambda i: -lens[i]):
        for j in range(len(bins)):
            if room[j] >= lens[i]:
                bins[j].append(i)
                room[j] -= lens[i]
                break
        else:
            bins.append([i])
            room.append(cap - lens[i])
    r = len(bins)
    ids = torch.full((r, cap), pad_id, dtype=torch.long, device=device)
    pos = torch.zeros((r, cap), dtype=torch.long, device=device)
    seg = torch.full((r, cap), -1, dtype=torch.long, device=device)
    offsets = torch.zeros(len(lens), dtype=torch.long, device=device)
    for j, members in enumerate(bins):
        at = 0
        for i in members:
            n = lens[i]
            ids[j, at : at + n] = token_ids[i, :n]
            pos[j, at : at + n] = torch.arange(n, device=device)
            seg[j, at : at + n] = i
            offsets[i] = j * cap + at
            at += n
    return ids, pos, seg, offsets


def make_inputs(token_ids: Tensor, lengths: Tensor, packed: bool, pad_id: int = 0) -> ModelInputs:
    """Padded: one row per sequence, 2-D attention mask. Packed: first-fit-decreasing into rows of the
    longest sequence's length, block-diagonal causal 4-D mask, position ids restarting per sequence.
    When packing would leave every sequence alone in its row, the padded layout is used: the same cells,
    and no `[rows, L, L]` mask (at 32k tokens 1 GB, and it keeps attention off the memory-efficient kernel)."""
    device = token_ids.device
    lens = [int(x) for x in lengths.tolist()]
    b = len(lens)
    if packed and (b == 1 or sum(sorted(lens)[:2]) > max(lens)):
        packed = False  # the two shortest do not fit one row: no two sequences would share a row
    if not packed:
        width = max(lens)
        ids = token_ids[:, :width]
        pos = torch.arange(width, device=device).expand(b, width).contiguous()
        att = (pos < lengths[:, None]).long()
        # padding cells at position 0: their outputs are never read, and a row's positions then rise only
        # over its sequence (dynamic NTK takes a sequence's length from them)
        pos = pos * att
        offsets = torch.arange(b, device=device) * width
        return ModelInputs(ids, pos, att, offsets, sum(lens), b * width)
    ids, pos, seg, offsets = pack_rows(token_ids, lens, pad_id)
    r, cap = ids.shape
    causal = torch.ones(cap, cap, dtype=torch.bool, device=device).tril()
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)
    # padding cells attend to themselves so no softmax row is empty (their outputs are never read)
    eye = torch.eye(cap, dtype=torch.bool, device=device)[None] & (seg[:, :, None] < 0)
    att = ((same & causal[None]) | eye)[:, None]
    return ModelInputs(ids, pos, att, offsets, sum(lens), r * cap)
