"""PagedEngine: the embedded inference engine (paged KV cache, continuous batching, prefix sharing).

Owns the request lifecycle: validation, per-sequence generators, building each step's flat batch,
stop conditions, forking the n samples of a request after one prefill, image features at the
placeholders of a vision model's prompt (engine/vision.py), speculative drafts (prompt lookup,
or early exit: the model's first layers), the constrained-decoding mask, the async driver that batches
concurrent `agenerate`/`stream` callers through one stepping loop, weight reloads and KV statistics.
The forward pass is model_runner.py, scheduling scheduler.py, block accounting block_manager.py.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from posttrain.engine.block_manager import BlockManager
from posttrain.engine.constrained import GrammarCompiler, mask_logits
from posttrain.engine.decode_stage import DecodeStager
from posttrain.engine.model_runner import DTYPES, DecodeGroup, ModelRunner, PrefillChunk, StepBatch
from posttrain.engine.mrope import prompt_rope
from posttrain.engine.registry import register_engine
from posttrain.engine.sampling import sample, seed_for
from posttrain.engine.scheduler import Scheduler
from posttrain.engine.sequence import Sequence
from posttrain.engine.speculative import NgramIndex, can_speculate, verify
from posttrain.engine.stops import end_of_turn_ids
from posttrain.engine.types import (
    BadRequestError,
    Completion,
    Engine,
    GenerationOutput,
    GenerationRequest,
    StreamDelta,
    step_thread,
    validate_request,
)
from posttrain.engine.vision import VisionPrefill, check_placeholders, split_weights
from posttrain.models.vision import image_inputs, is_vision_config

if TYPE_CHECKING:
    from posttrain.config import EngineConfig

SPECULATIVE_METHODS = ("none", "ngram", "early_exit")
_UNDRAFTED = -1  # an early-exit draft's slot before its token is drafted (scheduled, then filled)


@dataclass
class _RequestState:
    request_id: str
    request: GenerationRequest
    generators: list[torch.Generator]
    arrival_s: float
    completions: list[Completion | None]
    first_token_s: float | None = None
    future: asyncio.Future | None = None
    queue: asyncio.Queue | None = None
    emitted_text: dict[int, str] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return all(c is not None for c in self.completions)


def _hf_config_and_state(model: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    if isinstance(model, tuple) and len(model) == 2:
        return model
    if hasattr(model, "config") and hasattr(model, "state_dict"):
        base = model
        if hasattr(model, "merge_and_unload") and hasattr(model, "peft_config"):
            raise ValueError(
                "pass a merged model (posttrain.models.merged_state_dict) rather than a PEFT wrapper"
            )
        return base.config, base.state_dict()
    raise TypeError(
        f"model must be a transformers PreTrainedModel or a (config, state_dict) pair, got {type(model).__name__}"
    )


class PagedEngine(Engine):
    """Generates with a paged KV cache; see `posttrain.engine` for the contract."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        dtype: str = "float32",
        kv_cache_dtype: str = "auto",
        block_size: int = 16,
        num_blocks: int = 2048,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 4096,
        enable_prefix_caching: bool = True,
        decode_staging: bool = True,
        device: str = "cpu",
        weight_quant: str = "none",
        lm_head_quant: str = "same",
        weight_quant_max_rows: int = 0,
        speculative: str = "none",
        num_speculative_tokens: int = 4,
        prompt_lookup_min: int = 2,
        prompt_lookup_max: int = 4,
        speculative_max_batch: int = 4,
        early_exit_layers: int = 8,
        seed: int = 0,
    ) -> None:
        for name, value in (
            ("block_size", block_size),
            ("num_blocks", num_blocks),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
            ("num_speculative_tokens", num_speculative_tokens),
            ("speculative_max_batch", speculative_max_batch),
            ("early_exit_layers", early_exit_layers),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {list(SPECULATIVE_METHODS)}, got '{speculative}'")
        NgramIndex(prompt_lookup_min, prompt_lookup_max)  # validates the range
        config, state = _hf_config_and_state(model)
        self.vision: VisionPrefill | None = None
        if is_vision_config(config):  # a VLM: the paged forward runs its language model
            inputs = image_inputs(tokenizer)
            if inputs is None:
                raise ValueError(
                    "a vision model needs the tokenizer its loader returns (models.load_tokenizer), "
                    "which carries the image inputs"
                )
            if dtype not in DTYPES:
                raise ValueError(f"dtype must be one of {list(DTYPES)}, got '{dtype}'")
            self.vision = VisionPrefill(model, inputs, DTYPES[dtype], torch.device(device))
            config, state = config.text_config, dict(split_weights(state.items(), inputs.family)[0])
        self.runner = ModelRunner(
            config,
            state,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            block_size=block_size,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            device=device,
            weight_quant=weight_quant,
            lm_head_quant=lm_head_quant,
            weight_quant_max_rows=weight_quant_max_rows,
        )
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.caches_prefixes = enable_prefix_caching
        self.scheduler = Scheduler(self.bm, max_num_seqs, max_num_batched_tokens)
        s = self.runner.spec
        slot_elems = s.num_layers * s.num_kv_heads * s.head_dim  # K (or V) elements of one token
        self.stager = (
            DecodeStager(
                (s.num_layers, s.num_kv_heads, s.head_dim),
                self.runner.dtype,
                self.runner.device,
                block_size=block_size,
                max_rows=max_num_seqs,
                max_len=max_model_len,
                # staged copies hold at most as many token slots as the pool (in the compute dtype)
                max_bytes=2 * num_blocks * block_size * slot_elems * self.runner.dtype.itemsize,
            )
            if decode_staging
            else None
        )
        self.speculative = speculative
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup = (prompt_lookup_min, prompt_lookup_max)
        self.speculative_max_batch = speculative_max_batch
        if speculative == "early_exit" and early_exit_layers >= s.num_layers:
            raise ValueError(
                f"early_exit_layers must be below the model's {s.num_layers} layers, got {early_exit_layers}"
            )
        self.early_exit_layers = early_exit_layers
        self.spec_counts = {"verify_steps": 0, "draft_tokens": 0, "accepted_tokens": 0}
        self.eos_ids = set(end_of_turn_ids(model, tokenizer))
        self.grammars = GrammarCompiler(tokenizer, self.runner.spec.vocab_size, sorted(self.eos_ids))
        self.version = 0
        self._seed_rng = torch.Generator().manual_seed(seed)
        self._ids = itertools.count()
        self._states: dict[str, _RequestState] = {}
        self._seq_state: dict[int, _RequestState] = {}
        self._step_lock = threading.Lock()
        self._pending: list[tuple[_RequestState, list[Sequence]]] = []
        self._aborts: list[str] = []
        self._driver: asyncio.Task | None = None
        self._peak: dict | None = None
        self.num_steps = 0
        # MoE: expert ids [block_size, layers, k] of full blocks by prefix hash, for prefix-cache hits
        self._routing_cache: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._placed: list[tuple[Sequence, int, int, int]] = []  # last batch: (seq, row, start, n)

    # ---- requests ------------------------------------------------------------------------------

    def _make_state(self, req: GenerationRequest) -> tuple[_RequestState, list[Sequence]]:
        self._check_weights()
        validate_request(req, self.runner.spec.vocab_size, self.max_model_len, self.vision is not None)
        p = req.params
        need = -(-min(len(req.prompt_token_ids) + p.max_tokens, self.max_model_len) // self.block_size)
        if need > self.bm.num_blocks:
            raise BadRequestError(
                f"a request of {len(req.prompt_token_ids)} prompt + {p.max_tokens} new tokens needs {need} KV blocks; "
                f"the pool holds {self.bm.num_blocks} (raise num_blocks or lower max_tokens)"
            )
        rid = req.request_id if req.request_id is not None else f"req-{next(self._ids)}"
        if rid in self._states:
            raise BadRequestError(f"request_id '{rid}' is already in flight")
        base = p.seed if p.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        gens = [torch.Generator().manual_seed(seed_for(base, i)) for i in range(p.n)]
        now = time.perf_counter()
        state = _RequestState(rid, req, gens, now, [None] * p.n)
        seq = Sequence(rid, 0, req.prompt_token_ids, p, gens[0], now, num_forks=p.n)
        if p.json_schema is not None:
            seq.constraint = self.grammars.matcher(p.json_schema)
        if self.vision is not None:
            at = check_placeholders(req.prompt_token_ids, req.images, self.vision.inputs)
            seq.set_images(req.images, at, [self.vision.inputs.image_tokens(i) for i in req.images])
            if req.images and self.runner.mrope_columns is not None:  # M-RoPE: 3-D positions
                seq.set_rope(*prompt_rope(self.vision.inputs, len(req.prompt_token_ids), at, req.images))
        return state, [seq]

    def _admit(self, state: _RequestState, seqs: list[Sequence]) -> None:
        self._states[state.request_id] = state
        for seq in seqs:
            self._seq_state[id(seq)] = state
            self.scheduler.add(seq)

    def _finish_seq(self, seq: Sequence, reason: str) -> Completion:
        state = self._seq_state.pop(id(seq))
        seq.finish_reason = reason
        routing = self._routing_of(seq)  # before finish frees its blocks
        self.scheduler.finish(seq)
        ids = seq.output_ids
        text_ids = ids[:-1] if reason == "stop" and ids and self._is_stop_token(seq, ids[-1]) else ids
        tops = list(seq.top_logprobs) if seq.params.top_logprobs > 0 else None
        comp = Completion(
            list(ids), list(seq.logprobs), self.tokenizer.decode(text_ids), reason, tops, routing
        )
        state.completions[seq.index] = comp
        return comp

    def _is_stop_token(self, seq: Sequence, token: int) -> bool:
        return token in seq.params.stop_token_ids or (not seq.params.ignore_eos and token in self.eos_ids)

    def _stop_reason(self, seq: Sequence) -> str | None:
        p = seq.params
        out = seq.output_ids
        if self._is_stop_token(seq, out[-1]):
            return "stop"
        if p.stop:
            width = max(len(s) for s in p.stop) + 3
            tail = self.tokenizer.decode(out[-width:])
            if any(s in tail for s in p.stop):
                return "stop"
        if len(out) >= p.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    # ---- one step ------------------------------------------------------------------------------

    def _build_batch(
        self, work: list[tuple[Sequence, int]]
    ) -> tuple[StepBatch, list[tuple[Sequence, int]], list[tuple[Sequence, int]]]:
        """The step's flat batch; (sequence, logit row) of each that samples one token, and (sequence,
        first logit row) of each that verifies a draft (one row per position from its last token on)."""
        bs = self.block_size
        dev = self.runner.device
        decodes = [s for s, n in work if n == 1]
        prefills = [(s, n) for s, n in work if n > 1]  # prompt chunks, and drafts to verify
        if self.stager is not None:
            staged = self.stager.plan(
                [(s.kv_key, s.num_computed, s.block_table) for s in decodes],
                self.runner.k_cache,
                self.runner.v_cache,
                self.runner.k_scale,
                self.runner.v_scale,
            )
            placed = {i for g in staged for i in g.members}
            # past the staging budget: the rest gather their blocks, longest context first (_decode_groups)
            gathered = sorted(
                (s for i, s in enumerate(decodes) if i not in placed), key=lambda s: -s.num_computed
            )
            decodes = [decodes[i] for g in staged for i in g.members]
            groups, row = [], 0
            for g in staged:
                groups.append(
                    DecodeGroup(
                        row,
                        len(g.members),
                        g.mask,
                        stage=g.stage,
                        write_index=g.write_index,
                        width=g.width,
                    )
                )
                row += len(g.members)
            for grp in self._decode_groups(gathered):
                grp.row += row
                groups.append(grp)
            decodes += gathered
        else:
            # longest context first, so decode rows of similar length sit together (see _decode_groups)
            decodes.sort(key=lambda s: -s.num_computed)
            groups = self._decode_groups(decodes)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        samplers: list[tuple[Sequence, int]] = []
        verifiers: list[tuple[Sequence, int]] = []
        chunks: list[PrefillChunk] = []
        self._placed = []
        embed_rows: list[int] = []
        embeds: list[torch.Tensor] = []
        mrows: list[int] = []
        mpos: list[tuple[int, int, int]] = []
        for seq, n in [(s, 1) for s in decodes] + prefills:
            start = seq.num_computed
            row = len(ids)
            self._placed.append((seq, row, start, n))
            src = seq.token_ids + seq.draft if seq.draft else seq.token_ids
            ids.extend(src[start : start + n])
            pos.extend(seq.rope_positions(start, n))
            if seq.mrope_at:  # M-RoPE: the image rows, whose position components differ
                hit = [p for p in range(start, min(start + n, seq.num_prompt)) if p in seq.mrope_at]
                mrows.extend(row + p - start for p in hit)
                mpos.extend(seq.mrope_at[p] for p in hit)
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if n > 1:
                nb = -(-(start + n) // bs)
                chunks.append(PrefillChunk(row, n, start, torch.tensor(table[:nb], device=dev)))
            if seq.image_at:
                self._image_rows(seq, start, n, row, embed_rows, embeds)
            if seq.draft:
                verifiers.append((seq, len(logit_rows)))
                logit_rows.extend(range(row, row + n))
            elif start + n == len(seq):
                samplers.append((seq, len(logit_rows)))
                logit_rows.append(row + n - 1)
        batch = StepBatch(
            input_ids=torch.tensor(ids, device=dev),
            positions=torch.tensor(pos, device=dev),
            slot_mapping=torch.tensor(slots, device=dev),
            decode_groups=groups,
            prefills=chunks,
            logit_rows=torch.tensor(logit_rows, device=dev, dtype=torch.long),
        )
        if embed_rows:
            batch.embed_rows = torch.tensor(embed_rows, device=dev)
            batch.embeds = torch.cat(embeds)
        if mrows:
            batch.mrope_rows = torch.tensor(mrows, device=dev)
            batch.mrope_positions = torch.tensor(mpos, device=dev).T.contiguous()
        return batch, samplers, verifiers

    def _image_rows(
        self, seq: Sequence, start: int, n: int, row: int, rows: list[int], embeds: list[torch.Tensor]
    ) -> None:
        """Add the batch rows of seq's image placeholders in [start, start + n) and their features (the
        vision tower runs on the sequence's first prefill chunk that reaches a placeholder)."""
        hit = [(p, seq.image_at[p][1]) for p in range(start, start + n) if p in seq.image_at]
        if not hit:
            return
        if seq.image_embeds is None:
            assert self.vision is not None
            seq.image_embeds = self.vision.features(seq.images)
        rows.extend(row + p - start for p, _ in hit)
        embeds.append(seq.image_embeds[torch.tensor([i for _, i in hit], device=seq.image_embeds.device)])

    def _keep_routing(self) -> None:
        """MoE: keep each row's expert ids on its sequence, by position (a recomputed or re-verified
        position overwrites what it had)."""
        routing = self.runner.step_routing()
        if routing is None:
            return
        for seq, row, start, n in self._placed:
            if len(seq.routing) < start + n:
                seq.routing.extend([None] * (start + n - len(seq.routing)))
            for i in range(n):
                seq.routing[start + i] = routing[row + i]

    def _routing_of(self, seq: Sequence) -> list[list[list[int]]] | None:
        """The expert ids of every position of `seq` fed to the model (all but its last token): positions
        its prefix-cache hits skipped come from the routing cache, and its full blocks enter it. None for
        a dense model, or when a position's routing is unknown (its cached block's routing was evicted)."""
        if self.runner.spec.moe is None:
            return None
        bs, n = self.block_size, len(seq.token_ids) - 1
        rows = (seq.routing + [None] * n)[:n]
        for j, h in enumerate(seq.block_hashes):
            block = rows[j * bs : (j + 1) * bs]
            if len(block) == bs and all(r is not None for r in block):
                self._routing_cache[h] = torch.stack(block)  # type: ignore[arg-type]
                self._routing_cache.move_to_end(h)
                while len(self._routing_cache) > self.bm.num_blocks:
                    self._routing_cache.popitem(last=False)
            elif h in self._routing_cache:
                rows[j * bs : j * bs + len(block)] = list(self._routing_cache[h][: len(block)])
        if any(r is None for r in rows):
            return None
        return torch.stack(rows).tolist() if rows else []  # type: ignore[arg-type]

    def _decode_groups(
        self, seqs: list[Sequence], max_groups: int = 4, slack: float = 1.25, ahead: int = 0
    ) -> list[DecodeGroup]:
        """Split decode rows (sorted by context, longest first) so padding stays near `slack` x the real length.
        `ahead` > 0: each row decodes that many positions past its next one (an early-exit draft step)."""
        bs = self.block_size
        dev = self.runner.device
        ctx_lens = [s.num_computed + 1 + ahead for s in seqs]
        nbs = [-(-n // bs) for n in ctx_lens]
        bounds: list[tuple[int, int]] = []
        start, total = 0, 0
        for i, nb in enumerate(nbs):
            if (
                i > start
                and len(bounds) < max_groups - 1
                and nbs[start] * (i - start + 1) > slack * (total + nb)
            ):
                bounds.append((start, i))
                start, total = i, 0
            total += nb
        if seqs:
            bounds.append((start, len(seqs)))
        groups = []
        for lo, hi in bounds:
            width = nbs[lo]
            rows = zip(seqs[lo:hi], nbs[lo:hi], strict=True)
            tables = torch.tensor([s.block_table[:nb] + [0] * (width - nb) for s, nb in rows], device=dev)
            ctx = torch.tensor(ctx_lens[lo:hi], device=dev)
            mask = (torch.arange(width * bs, device=dev)[None, :] < ctx[:, None])[:, None, None, :]
            groups.append(DecodeGroup(lo, hi - lo, mask, block_tables=tables))
        return groups

    def _fork(self, parent: Sequence) -> list[Sequence]:
        state = self._seq_state[id(parent)]
        children = []
        for i in range(1, parent.num_forks):
            child = parent.fork(i, state.generators[i])
            self.bm.fork(parent, child)
            self._seq_state[id(child)] = state
            self.scheduler.running.append(child)
            children.append(child)
        parent.num_forks = 1
        return children

    def _step(self) -> list[tuple[_RequestState, Sequence, int, float, str | None]]:
        """Run one scheduled forward and sample; returns (state, seq, token, logprob, finish_reason) events."""
        with self._step_lock:
            self._check_weights()
            self._propose_drafts()
            work = self.scheduler.schedule()
            if not work:
                if self.scheduler.has_work():
                    raise RuntimeError(
                        "the scheduler cannot make progress: the KV pool is too small for one sequence"
                    )
                return []
            self.runner.allocate_kv_cache()
            self.runner.zero_blocks(self.bm.drain_taken())  # before copy-on-write fills some of them
            self.runner.copy_blocks(self.bm.pending_copies)
            self.bm.pending_copies = []
            if self.speculative == "early_exit":
                self._draft_early_exit(work)
            batch, samplers, verifiers = self._build_batch(work)
            logits = self.runner.forward(batch)
            self._keep_routing()
            for seq, n in work:
                if not seq.draft:  # a verified draft's computed tokens are known after acceptance
                    seq.num_computed += n
                    self.bm.register_full_blocks(seq)
            self.num_steps += 1
            self._track_peak()
            events = [self._accept(seq, logits[r : r + len(seq.draft) + 1]) for seq, r in verifiers]
            if not samplers:
                return events
            rows: list[int] = []
            seqs: list[Sequence] = []
            for seq, r in samplers:
                group = [seq] + (self._fork(seq) if seq.num_forks > 1 else [])
                rows.extend([r] * len(group))
                seqs.extend(group)
            if rows != list(range(logits.shape[0])):
                logits = logits.index_select(0, torch.tensor(rows))
            logits = mask_logits(logits, [s.constraint for s in seqs])
            tokens, logprobs, tops = sample(
                logits,
                [s.params for s in seqs],
                [s.token_ids if s.params.repetition_penalty != 1.0 else [] for s in seqs],
                [s.generator for s in seqs],
                [s.output_ids if s.params.penalised else [] for s in seqs],
            )
            now = time.perf_counter()
            for seq, tok, lp, top in zip(seqs, tokens, logprobs, tops, strict=True):
                seq.token_ids.append(tok)
                seq.logprobs.append(lp)
                if top is not None:
                    seq.top_logprobs.append(top)
                state = self._seq_state[id(seq)]
                if state.first_token_s is None:
                    state.first_token_s = now
                reason = self._stop_reason(seq)
                if reason is not None:
                    self._finish_seq(seq, reason)
                elif seq.constraint is not None:
                    seq.constraint.consume(tok)
                events.append((state, seq, tok, lp, reason))
            if self.stager is not None and not self.scheduler.running:
                self.stager.clear()  # idle: hand the staged copies' memory back
            return events

    def _propose_drafts(self) -> None:
        """Give each decoding sequence a draft while few enough decode for it to pay: a prompt-lookup one
        (ngram), or (early_exit) room for one the scheduler sizes and `_draft_early_exit` then fills."""
        if self.speculative == "none":
            return
        decoding = [s for s in self.scheduler.running if s.is_decoding]
        small = len(decoding) <= self.speculative_max_batch
        for seq in decoding:
            seq.draft = []
            if not small or not can_speculate(seq.params):
                continue
            room = min(
                self.num_speculative_tokens,
                seq.params.max_tokens - len(seq.output_ids) - 1,  # every accepted token is emitted
                self.max_model_len - len(seq),  # positions written: len(seq) - 1 .. len(seq) - 1 + k
            )
            if room <= 0:
                continue
            if self.speculative == "early_exit":
                seq.draft = [_UNDRAFTED] * room
                continue
            if seq.ngram is None:
                seq.ngram = NgramIndex(*self.prompt_lookup)
            seq.ngram.sync(seq.token_ids)
            seq.draft = seq.ngram.propose(room)

    def _draft_early_exit(self, work: list[tuple[Sequence, int]]) -> None:
        """Fill the scheduled drafts with greedy tokens of the model's first `early_exit_layers` layers, the
        final norm and the head: one partial forward per draft position, batched over the drafting rows.
        They write K/V of those layers at the draft positions, which the verifying forward then rewrites
        with every layer's, so the draft never changes what the full model computes."""
        seqs = sorted((s for s, _ in work if s.draft), key=lambda s: -s.num_computed)
        if not seqs:
            return
        bs = self.block_size
        dev = self.runner.device
        drafts: list[list[int]] = [[] for _ in seqs]
        last = [s.token_ids[-1] for s in seqs]
        for i in range(max(len(s.draft) for s in seqs)):
            rows = [j for j, s in enumerate(seqs) if len(s.draft) > i]  # still longest context first
            active = [seqs[j] for j in rows]
            pos = [s.num_computed + i for s in active]
            batch = StepBatch(
                input_ids=torch.tensor([last[j] for j in rows], device=dev),
                positions=torch.tensor(
                    [p + s.rope_delta for s, p in zip(active, pos, strict=True)], device=dev
                ),
                slot_mapping=torch.tensor(
                    [s.block_table[p // bs] * bs + p % bs for s, p in zip(active, pos, strict=True)],
                    device=dev,
                ),
                decode_groups=self._decode_groups(active, ahead=i),
                prefills=[],
                logit_rows=torch.arange(len(rows), device=dev),
            )
            best = self.runner.forward(batch, num_layers=self.early_exit_layers).argmax(-1).tolist()
            for j, tok in zip(rows, best, strict=True):
                drafts[j].append(tok)
                last[j] = tok
        for seq, draft in zip(seqs, drafts, strict=True):
            seq.draft = draft

    def _accept(
        self, seq: Sequence, logits: torch.Tensor
    ) -> tuple[_RequestState, Sequence, int, float, str | None]:
        """Verify seq's draft against its logit rows; append what is accepted plus one target token."""
        state = self._seq_state[id(seq)]
        draft, seq.draft = seq.draft, []
        tokens, logprobs, accepted, tops = verify(logits, draft, seq.params, seq.generator)
        c = self.spec_counts
        c["verify_steps"] += 1
        c["draft_tokens"] += len(draft)
        c["accepted_tokens"] += accepted
        start = seq.num_computed  # the K/V of positions start .. start + accepted now hold the real tokens
        reason = None
        for i, (tok, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            seq.token_ids.append(tok)
            seq.logprobs.append(lp)
            if tops is not None:
                seq.top_logprobs.append(tops[i])
            reason = self._stop_reason(seq)
            if reason is not None:
                break
        seq.num_computed = min(start + 1 + accepted, len(seq.token_ids))
        self.bm.register_full_blocks(seq)
        if reason is not None:
            self._finish_seq(seq, reason)
        return state, seq, seq.token_ids[-1], seq.logprobs[-1], reason

    def _track_peak(self) -> None:
        used = self.bm.num_blocks - self.bm.num_free
        if self._peak is None or used >= self._peak["blocks_allocated"]:
            self._peak = self.bm.stats(self.scheduler.running)

    def _output(self, state: _RequestState) -> GenerationOutput:
        self._states.pop(state.request_id, None)
        ttft = (state.first_token_s or state.arrival_s) - state.arrival_s
        comps = [c for c in state.completions if c is not None]
        return GenerationOutput(state.request_id, list(state.request.prompt_token_ids), comps, ttft)

    def _abort_request(self, request_id: str) -> None:
        """Drop a request's sequences (between steps only) and free their blocks."""
        state = self._states.pop(request_id, None)
        if state is None:
            return
        for seq in [
            q
            for q in list(self.scheduler.running) + list(self.scheduler.waiting)
            if q.request_id == request_id
        ]:
            if seq.block_table:
                self.bm.free_seq(seq)
            if seq in self.scheduler.running:
                self.scheduler.running.remove(seq)
            else:
                self.scheduler.waiting.remove(seq)
            self._seq_state.pop(id(seq), None)

    def _abort_all(self, err: BaseException) -> None:
        with self._step_lock:  # a cancelled driver's step may still be running in its worker thread
            self._drop_everything(err)

    def _drop_everything(self, err: BaseException) -> None:
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            if seq.block_table:
                self.bm.free_seq(seq)
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()
        if self.stager is not None:
            self.stager.clear()
        for state in self._states.values():
            if state.future is not None and not state.future.done():
                state.future.set_exception(err)
            if state.queue is not None:
                state.queue.put_nowait(err)
        self._states.clear()
        self._seq_state.clear()
        self._pending.clear()

    # ---- public API ----------------------------------------------------------------------------

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationOutput]:
        """Generate every request (batched together); blocks until all are done."""
        if self._driver is not None and not self._driver.done():
            raise RuntimeError(
                "generate() called while async requests are in flight; use agenerate() from that loop"
            )
        made = [self._make_state(r) for r in requests]
        ids = [s.request_id for s, _ in made]
        if len(set(ids)) != len(ids):
            raise BadRequestError("duplicate request_id in one generate() call")
        for state, seqs in made:
            self._admit(state, seqs)
        try:
            while not all(state.done for state, _ in made):
                self._step()
        except BaseException as err:
            self._abort_all(err)
            raise
        return [self._output(state) for state, _ in made]

    async def agenerate(self, request: GenerationRequest) -> GenerationOutput:
        """Generate one request; concurrent callers on one event loop are batched by one stepping loop."""
        state, seqs = self._make_state(request)
        state.future = asyncio.get_running_loop().create_future()
        self._submit(state, seqs)
        return await state.future

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        """Yield StreamDelta objects as tokens are generated; each completion's last delta has a finish_reason."""
        state, seqs = self._make_state(request)
        state.queue = asyncio.Queue()
        self._submit(state, seqs)
        remaining = request.params.n
        try:
            while remaining:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    remaining -= 1
                yield item
        finally:
            if remaining:  # the consumer went away (e.g. a client disconnected): stop generating for it
                self._aborts.append(state.request_id)
            else:
                self._states.pop(state.request_id, None)

    def _submit(self, state: _RequestState, seqs: list[Sequence]) -> None:
        if state.request_id in self._states or any(
            s.request_id == state.request_id for s, _ in self._pending
        ):
            raise BadRequestError(f"request_id '{state.request_id}' is already in flight")
        self._pending.append((state, seqs))
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive())

    async def _drive(self) -> None:
        """The one stepping loop: each step runs in a worker thread so other coroutines progress between steps."""
        try:
            while True:
                for state, seqs in self._pending:
                    self._admit(state, seqs)
                self._pending.clear()
                while self._aborts:
                    self._abort_request(self._aborts.pop())
                if not self.scheduler.has_work():
                    return
                loop = asyncio.get_running_loop()
                events = await loop.run_in_executor(step_thread(), self._step)
                self._deliver(events)
        except BaseException as err:
            self._abort_all(err)
            if not isinstance(err, Exception):
                raise

    def _deliver(self, events: list[tuple[_RequestState, Sequence, int, float, str | None]]) -> None:
        for state, seq, _tok, _lp, reason in events:
            if state.queue is not None:
                ids = seq.output_ids
                text_ids = ids[:-1] if reason == "stop" and self._is_stop_token(seq, ids[-1]) else ids
                text = self.tokenizer.decode(text_ids)
                if reason is None and text.endswith("\ufffd"):
                    text = state.emitted_text.get(
                        seq.index, ""
                    )  # wait for the rest of a multi-byte character
                prev = state.emitted_text.get(seq.index, "")
                new_ids = ids[seq.num_emitted :]
                new_lps = seq.logprobs[seq.num_emitted :]
                new_tops = seq.top_logprobs[seq.num_emitted :] if seq.params.top_logprobs > 0 else None
                seq.num_emitted = len(ids)
                state.emitted_text[seq.index] = text
                state.queue.put_nowait(
                    StreamDelta(
                        state.request_id, seq.index, new_ids, new_lps, text[len(prev) :], reason, new_tops
                    )
                )
            if state.future is not None and state.done and not state.future.done():
                state.future.set_result(self._output(state))

    def load_weights(
        self,
        weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        version: int | None = None,
    ) -> None:
        """Copy HF-named weights in place (a `base_model.model.` prefix is stripped); bumps `version`.

        The prefix cache is dropped (its K/V belong to the old weights); sequences in flight keep the
        K/V they already computed."""
        items = weights.items() if isinstance(weights, dict) else weights
        with self._step_lock:
            if self.vision is not None:
                items, vision = split_weights(items, self.vision.family)
                self.vision.load_vision_weights(vision)
            self.runner.load_weights(items)
            self.bm.reset_prefix_cache()
            self._routing_cache.clear()
            self.version = self.version + 1 if version is None else int(version)

    def release_kv_cache(self) -> None:
        """Free the KV block pool (e.g. while a colocated learner trains); the next step re-allocates it."""
        with self._step_lock:
            self._release_kv("the KV cache")

    def release_weights(self) -> None:
        """Free the weights' memory and the KV pool (a colocated learner is about to train). Requests are
        refused (RuntimeError) until the next `load_weights`, which must bring every weight and
        re-allocates them; an image model's vision tower keeps its weights."""
        with self._step_lock:
            self._release_kv("the weights")
            self.runner.release_weights()
            self._routing_cache.clear()

    def _release_kv(self, what: str) -> None:
        if self.scheduler.has_work() or self._pending:
            raise RuntimeError(f"cannot release {what} while requests are in flight")
        self.runner.release_kv_cache()
        self.bm.reset_prefix_cache()
        if self.stager is not None:
            self.stager.clear()

    def _check_weights(self) -> None:
        if self.runner.weights_released:
            raise RuntimeError(
                "the engine's weights are released (release_weights, placement.offload_engine_weights) "
                "until the next load_weights; no request runs on freed memory"
            )

    def kv_stats(self) -> dict:
        """Current and peak KV usage: blocks allocated, tokens stored, waste fraction, prefix-cache hits."""
        now = self.bm.stats(self.scheduler.running)
        peak = self._peak or now
        return {
            **now,
            "peak_blocks_allocated": peak["blocks_allocated"],
            "peak_tokens_stored": peak["tokens_stored"],
            "peak_tokens_logical": peak["tokens_logical"],
            "peak_waste_frac": peak["waste_frac"],
            "preemptions": self.scheduler.num_preemptions,
            "kv_cache_bytes": self.runner.kv_cache_bytes(),
            "kv_cache_allocated": self.runner.k_cache is not None,
            "decode_stage_bytes": self.stager.nbytes() if self.stager is not None else 0,
        }

    def speculation_stats(self) -> dict[str, int]:
        """Counts since the last reset: steps that verified a draft, draft tokens, accepted ones."""
        return dict(self.spec_counts)

    def reset_stats(self) -> None:
        for key in self.spec_counts:
            self.spec_counts[key] = 0
        self._peak = None
        self.bm.prefix_hit_tokens = 0
        self.bm.shared_fork_blocks = 0
        self.scheduler.num_preemptions = 0


@register_engine("paged")
def build_paged(engine_cfg: EngineConfig, model: Any, tokenizer: Any, *, seed: int = 0) -> PagedEngine:
    """engine.backend=paged: the embedded engine, sized by the config's KV and batching settings."""
    return PagedEngine(
        model,
        tokenizer,
        dtype=engine_cfg.resolved_dtype(),
        kv_cache_dtype=engine_cfg.kv_cache_dtype,
        block_size=engine_cfg.block_size,
        num_blocks=engine_cfg.num_kv_blocks,
        max_num_seqs=engine_cfg.max_num_seqs,
        max_num_batched_tokens=engine_cfg.max_num_batched_tokens,
        max_model_len=engine_cfg.max_model_len,
        enable_prefix_caching=engine_cfg.enable_prefix_caching,
        decode_staging=engine_cfg.decode_staging,
        device=engine_cfg.device,
        weight_quant=engine_cfg.weight_quant,
        lm_head_quant=engine_cfg.lm_head_quant,
        weight_quant_max_rows=engine_cfg.weight_quant_max_rows,
        speculative=engine_cfg.speculative,
        num_speculative_tokens=engine_cfg.num_speculative_tokens,
        prompt_lookup_min=engine_cfg.prompt_lookup_min,
        prompt_lookup_max=engine_cfg.prompt_lookup_max,
        speculative_max_batch=engine_cfg.speculative_max_batch,
        early_exit_layers=engine_cfg.early_exit_layers,
        seed=seed,
    )
