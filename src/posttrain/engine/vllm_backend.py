"""VLLMEngine: vLLM behind the engine interface, for GPUs (the `[vllm]` extra). Untested on this CPU machine.

Owns the translation between our request/result types and vLLM's `LLM.generate`, and weight reloads
through vLLM's model `load_weights`. Caveats, honestly: vLLM's processed logprobs may already be
top-k/top-p truncated (ours are not); seeds are vLLM's per-request seeds; the async methods run
the blocking `LLM.generate` in a thread (no cross-caller batching; use the paged engine or a vLLM
server for that). Does not run on CPU here.
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Iterable
from typing import Any

import torch

from posttrain.engine.registry import refuse_paged_only, register_engine
from posttrain.engine.stops import end_of_turn_ids
from posttrain.engine.types import (
    BadRequestError,
    Completion,
    Engine,
    GenerationOutput,
    GenerationRequest,
    validate_request,
)

VLLM_MISSING = (
    "engine.backend 'vllm' needs vLLM, which is not installed: pip install 'posttrain[vllm]' "
    "(GPU machines only); on CPU use engine.backend=paged"
)


class VLLMEngine(Engine):
    """`agenerate` and `stream` are the Engine defaults (the blocking `LLM.generate` in a worker thread)."""

    def __init__(self, model: Any, tokenizer: Any, engine_cfg: Any, *, seed: int = 0) -> None:
        try:
            import vllm
        except ImportError as err:
            raise ImportError(VLLM_MISSING) from err
        self._vllm = vllm
        self.tokenizer = tokenizer
        self.max_model_len = engine_cfg.max_model_len
        self.vocab_size = model.config.vocab_size
        self.version = 0
        self._asleep = False
        self._ids = itertools.count()
        self.caches_prefixes = engine_cfg.enable_prefix_caching
        self.eos_ids = end_of_turn_ids(
            model, tokenizer
        )  # vLLM reads generation_config, not the chat template's
        self._dir = tempfile.TemporaryDirectory(prefix="posttrain-vllm-")
        model.save_pretrained(self._dir.name)
        tokenizer.save_pretrained(self._dir.name)
        self.llm = vllm.LLM(
            model=self._dir.name,
            dtype=engine_cfg.resolved_dtype(),
            seed=seed,
            max_model_len=engine_cfg.max_model_len,
            max_num_seqs=engine_cfg.max_num_seqs,
            enable_prefix_caching=engine_cfg.enable_prefix_caching,
            logprobs_mode="processed_logprobs",
        )

    def _params(self, p: Any) -> Any:
        return self._vllm.SamplingParams(
            n=p.n,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k if p.top_k > 0 else -1,
            min_p=p.min_p,
            repetition_penalty=p.repetition_penalty,
            max_tokens=p.max_tokens,
            stop=list(p.stop),
            stop_token_ids=list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_ids),
            seed=p.seed,
            ignore_eos=p.ignore_eos,
            logprobs=p.top_logprobs,  # vLLM returns the top N plus the sampled token
            include_stop_str_in_output=True,
            skip_special_tokens=True,
        )

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationOutput]:
        for r in requests:
            validate_request(r, self.vocab_size, self.max_model_len)
            if r.params.json_schema is not None:
                raise BadRequestError(
                    "the vllm backend does not pass json_schema on (vLLM's guided-decoding API differs "
                    "between versions); use the paged engine for constrained decoding"
                )
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
        prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests]
        outs = self.llm.generate(prompts, [self._params(r.params) for r in requests], use_tqdm=False)
        results = []
        for r, out in zip(requests, outs, strict=True):
            comps = []
            for c in out.outputs:
                ids = list(c.token_ids)
                steps = list(c.logprobs or [])
                lps = [float(step[t].logprob) for step, t in zip(steps, ids, strict=False)]
                tops = None
                if r.params.top_logprobs > 0:
                    n = r.params.top_logprobs
                    tops = [
                        sorted(((int(t), float(v.logprob)) for t, v in step.items()), key=lambda e: -e[1])[:n]
                        for step in steps
                    ]
                reason = "stop" if c.finish_reason == "stop" else "length"
                comps.append(Completion(ids, lps, c.text, reason, tops))
            ttft = 0.0
            metrics = getattr(out, "metrics", None)
            if (
                metrics is not None
                and getattr(metrics, "first_token_time", None)
                and getattr(metrics, "arrival_time", None)
            ):
                ttft = metrics.first_token_time - metrics.arrival_time
            rid = r.request_id if r.request_id is not None else f"vllm-{next(self._ids)}"
            results.append(GenerationOutput(rid, list(r.prompt_token_ids), comps, ttft))
        return results

    def load_weights(
        self,
        weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        version: int | None = None,
    ) -> None:
        items = list(weights.items() if isinstance(weights, dict) else weights)
        items = [(k.removeprefix("base_model.model."), v) for k, v in items]
        self.llm.collective_rpc(lambda worker: worker.model_runner.model.load_weights(items))
        self.llm.reset_prefix_cache()
        self.version = self.version + 1 if version is None else int(version)

    def release_kv_cache(self) -> None:
        """vLLM's sleep mode level 1: drops the KV cache (and offloads weights); the next generate wakes it."""
        self.llm.sleep(level=1)
        self._asleep = True


@register_engine("vllm")
def build_vllm(engine_cfg: Any, model: Any, tokenizer: Any, *, seed: int = 0) -> VLLMEngine:
    """engine.backend=vllm (the `[vllm]` extra; GPU machines): vLLM's offline LLM serving `model`."""
    refuse_paged_only("vllm", engine_cfg)
    return VLLMEngine(model, tokenizer, engine_cfg, seed=seed)
