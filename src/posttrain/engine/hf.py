"""HFEngine: transformers' `generate` behind the engine interface, the baseline the paged engine is measured against.

Batches requests with identical sampling parameters into one left-padded `generate` call (n samples
as n rows). Logprobs come from the raw logits after temperature and repetition penalty, like the
paged engine's, and so do top logprobs (`top_logprobs` N > 0). Sampling draws each row from its own torch.Generator (`seed_for(seed, index)`, as the
paged engine does) inside a logits processor, never from the global generator, so a seeded request
gives the same tokens whatever runs in other threads. Does not page, share prefixes or batch
continuously: that is what it is the baseline for.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from posttrain.engine.registry import refuse_paged_only, register_engine
from posttrain.engine.sampling import apply_repetition_penalty, sample_row, seed_for, top_of_logprobs
from posttrain.engine.stops import end_of_turn_ids
from posttrain.engine.types import (
    BadRequestError,
    Completion,
    Engine,
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
    validate_request,
)

if TYPE_CHECKING:
    from posttrain.config import EngineConfig


class _RowSampler:
    """A logits processor that samples every row with its own generator (sampling.sample_row) and leaves
    only that token possible, so HF's greedy step takes it."""

    def __init__(
        self, params: SamplingParams, prompts: list[list[int]], width: int, generators: list[torch.Generator]
    ):
        self.params, self.prompts, self.width, self.generators = params, prompts, width, generators

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(scores, -float("inf"))
        for row in range(scores.shape[0]):
            history = self.prompts[row] + input_ids[row, self.width :].tolist()
            token, _, _ = sample_row(scores[row].float(), self.params, history, self.generators[row])
            out[row, token] = 0.0
        return out


class HFEngine(Engine):
    """`agenerate` and `stream` are the Engine defaults: each request runs `generate` in a worker thread on
    its own (no batching across concurrent callers); streams deliver whole completions."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_model_len: int = 4096,
        max_batch_size: int = 64,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_batch_size = max_batch_size
        self.caches_prefixes = False  # every generate() call computes its prompts from scratch
        self.version = 0
        self._ids = itertools.count()
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad)
        self.eos_ids = end_of_turn_ids(model, tokenizer)
        self._seed_rng = torch.Generator().manual_seed(seed)  # seeds of unseeded requests
        self._seed_lock = threading.Lock()

    def _key(self, p: SamplingParams) -> tuple:
        return (
            p.temperature,
            p.top_p,
            p.top_k,
            p.min_p,
            p.repetition_penalty,
            p.max_tokens,
            tuple(p.stop),
            tuple(p.stop_token_ids),
            p.seed,
            p.n,
            p.ignore_eos,
            p.top_logprobs,
        )

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationOutput]:
        for r in requests:
            validate_request(r, self.model.config.vocab_size, self.max_model_len)
            if r.params.presence_penalty or r.params.frequency_penalty:
                raise BadRequestError(
                    "the hf backend has no presence_penalty/frequency_penalty (transformers' generate has "
                    "only repetition_penalty); use the paged engine or leave them at 0"
                )
            if r.params.json_schema is not None:
                raise BadRequestError(
                    "the hf backend has no constrained decoding, so json_schema cannot be enforced; "
                    "use the paged engine"
                )
        outputs: list[GenerationOutput | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(self._key(r.params), []).append(i)
        for idxs in groups.values():
            per_call = max(1, self.max_batch_size // requests[idxs[0]].params.n)
            for k in range(0, len(idxs), per_call):
                chunk = idxs[k : k + per_call]
                for i, out in zip(chunk, self._generate_group([requests[i] for i in chunk]), strict=True):
                    outputs[i] = out
        return [o for o in outputs if o is not None]

    @torch.inference_mode()
    def _generate_group(self, reqs: list[GenerationRequest]) -> list[GenerationOutput]:
        p = reqs[0].params
        t0 = time.perf_counter()
        width = max(len(r.prompt_token_ids) for r in reqs)
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):
            n = len(r.prompt_token_ids)
            ids[i, width - n :] = torch.tensor(r.prompt_token_ids)
            mask[i, width - n :] = 1
        stop_ids = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_ids)
        ids, mask = ids.repeat_interleave(p.n, 0), mask.repeat_interleave(p.n, 0)  # row i * n + j
        kwargs: dict[str, Any] = dict(
            max_new_tokens=min(p.max_tokens, self.max_model_len - width),
            return_dict_in_generate=True,
            output_logits=True,
            pad_token_id=self.pad_id,
            eos_token_id=stop_ids or [self.model.config.vocab_size],  # an id never sampled: no stop
            do_sample=False,  # sampling happens in _RowSampler, with per-row generators
            temperature=None,
            top_p=None,
            top_k=None,
        )
        if p.temperature == 0.0:
            kwargs.update(repetition_penalty=p.repetition_penalty)
        else:
            generators = []
            for _ in reqs:
                if p.seed is not None:
                    base = p.seed
                else:
                    with self._seed_lock:
                        base = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
                generators.extend(torch.Generator().manual_seed(seed_for(base, j)) for j in range(p.n))
            prompts = [list(r.prompt_token_ids) for r in reqs for _ in range(p.n)]
            from transformers import LogitsProcessorList

            kwargs.update(logits_processor=LogitsProcessorList([_RowSampler(p, prompts, width, generators)]))
        if p.stop:
            kwargs.update(stop_strings=list(p.stop), tokenizer=self.tokenizer)
        out = self.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        ttft = time.perf_counter() - t0  # HF returns all at once: its first token is its last
        new = out.sequences[:, width:]
        raw = torch.stack(out.logits, dim=1).float() if out.logits else torch.empty(new.shape[0], 0, 1)
        results = []
        for i, r in enumerate(reqs):
            comps = []
            for j in range(p.n):
                row = i * p.n + j
                toks: list[int] = []
                lps: list[float] = []
                tops: list[list[tuple[int, float]]] = []
                reason = "length"
                history = list(r.prompt_token_ids)
                for t in range(new.shape[1]):
                    tok = int(new[row, t])
                    logits = apply_repetition_penalty(raw[row, t], history, p.repetition_penalty)
                    if p.temperature > 0.0:
                        logits = logits / p.temperature
                    toks.append(tok)
                    row_lps = torch.log_softmax(logits, -1)
                    lps.append(float(row_lps[tok]))
                    if p.top_logprobs > 0:
                        tops.append(top_of_logprobs(row_lps[None, :], [p.top_logprobs])[0])
                    history.append(tok)
                    if tok in stop_ids:
                        reason = "stop"
                        break
                    if p.stop and any(s in self.tokenizer.decode(toks) for s in p.stop):
                        reason = "stop"
                        break
                text_ids = toks[:-1] if reason == "stop" and toks and toks[-1] in stop_ids else toks
                top = tops[: len(toks)] if p.top_logprobs > 0 else None
                comps.append(Completion(toks, lps, self.tokenizer.decode(text_ids), reason, top))
            rid = r.request_id if r.request_id is not None else f"hf-{next(self._ids)}"
            results.append(GenerationOutput(rid, list(r.prompt_token_ids), comps, ttft))
        return results

    def load_weights(
        self,
        weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        version: int | None = None,
    ) -> None:
        items = weights.items() if isinstance(weights, dict) else weights
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        with torch.no_grad():
            for name, tensor in items:
                key = name.removeprefix("base_model.model.")
                if key not in params:
                    raise ValueError(f"unknown parameter name '{name}'")
                params[key].copy_(tensor)
        self.version = self.version + 1 if version is None else int(version)

    def release_kv_cache(self) -> None:
        """Nothing to release: HF allocates its cache per generate call."""


@register_engine("hf")
def build_hf(engine_cfg: EngineConfig, model: Any, tokenizer: Any, *, seed: int = 0) -> HFEngine:
    """engine.backend=hf: transformers' generate, the baseline (max_num_seqs caps a generate call's rows)."""
    refuse_paged_only("hf", engine_cfg)
    return HFEngine(
        model,
        tokenizer,
        max_model_len=engine_cfg.max_model_len,
        max_batch_size=engine_cfg.max_num_seqs,
        seed=seed,
    )
