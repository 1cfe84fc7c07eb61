"""Inference: the paged engine (KV cache in blocks, continuous batching, prefix sharing, exact logprobs),
the HF `generate` baseline behind the same interface, and `make_engine` to pick one from the config
through the engine registry (`@register_engine(name)`, `list_engines()`). Knows nothing of rewards or tasks.

The contract every backend keeps (PagedEngine, HFEngine, VLLMEngine), typed as the `Engine` protocol
(`posttrain.engine.types`; members marked * have a default a backend inherits by subclassing it):

    engine.generate(requests: list[GenerationRequest]) -> list[GenerationOutput]    # batch, blocking
    await engine.agenerate(request) -> GenerationOutput   # * default: generate() on the step thread
        Concurrent callers on one asyncio loop are batched together by ONE background stepping loop
        (continuous batching); each engine step runs on the process's one step thread (types.step_thread),
        so other coroutines (sandbox I/O) progress between steps. Do not mix with generate() while async requests are in flight.
    async for delta in engine.stream(request): ...        # * StreamDelta(request_id, index, token_ids, logprobs, text, finish_reason,
                                                          # top_logprobs);
                                                          # closing the stream early aborts the request
    engine.load_weights(weights, version=None)            # HF names as in model.state_dict(), a "base_model.model."
                                                          # prefix is stripped; in place; bumps engine.version
    engine.release_kv_cache()                             # * free the KV pool; the next step re-allocates it
    engine.caches_prefixes: bool                          # * a prompt prefilled once is reused by later requests
                                                          # (the rollout collector then prefills a group's prompt
                                                          # once); default False
    engine.kv_stats() -> dict                             # * blocks_allocated, tokens_stored, waste_frac,
                                                          # prefix_hit_tokens, fork_shared_blocks, peak_*, preemptions
    engine.reset_stats()                                  # * restart the peaks and hit counters kv_stats reports

Completions (what the trainer relies on):
- `token_ids` include the stop token id when generation stopped on one (EOS of the model, or one of
  `stop_token_ids`), and end with the token that completed a stop string (nothing is trimmed).
- `logprobs[i]` is the logprob of `token_ids[i]` under the distribution it was sampled from: after
  repetition penalty and temperature, BEFORE top-k/top-p/min-p truncation. At temperature 0 (greedy)
  it is the logprob under the untempered softmax (after repetition penalty).
- `text` decodes `token_ids` without a trailing stop token; `finish_reason` is "stop" or "length".
- The same `seed` gives the same completions whatever else is batched (one torch.Generator per
  sequence); the i-th of `n` samples uses a generator derived from (seed, i). Without a seed, seeds
  come from the engine's own generator (seeded at construction), so a run is reproducible.
- The model's EOS ids always stop a completion unless `SamplingParams.ignore_eos` (benchmarks use it).
- PagedEngine extras: `release_weights()` (frees the weights with the KV pool; requests are refused
  until the next `load_weights`, which must bring every weight), `enable_prefix_caching`, `device`
  ("cpu", "cuda", ...), `seed`, `decode_staging`
  (default on: decoding sequences keep a contiguous copy of their K/V across steps, so decode attends
  without gathering blocks; costs a second copy of those sequences' K/V, `kv_stats()["decode_stage_bytes"]`,
  at most the pool's token slots in the compute dtype: past that, sequences decode from the pool);
  requests that can never fit (prompt >= max_model_len, more blocks than the pool) raise
  BadRequestError up front.
- After `load_weights` the prefix cache is dropped; sequences in flight keep the K/V they computed.
- Vision models (LLaVA-style, PagedEngine only; engine/vision.py): `GenerationRequest.images` fill the
  prompt's image placeholder runs in order; the vision tower runs at prefill and its features replace
  the embeddings there; the prefix cache keys blocks by image hash as well as token ids. The same
  logprob contract. Other backends, and text-only models, refuse images with BadRequestError.
"""

from posttrain.engine.factory import make_engine
from posttrain.engine.hf import HFEngine
from posttrain.engine.paged import PagedEngine
from posttrain.engine.registry import UnknownEngineError, engine_builder, list_engines, register_engine
from posttrain.engine.types import (
    BadRequestError,
    Completion,
    Engine,
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
    StreamDelta,
)

__all__ = [
    "BadRequestError",
    "Completion",
    "Engine",
    "GenerationOutput",
    "GenerationRequest",
    "HFEngine",
    "PagedEngine",
    "SamplingParams",
    "StreamDelta",
    "UnknownEngineError",
    "engine_builder",
    "list_engines",
    "make_engine",
    "register_engine",
]
