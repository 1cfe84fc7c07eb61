"""make_engine: the engine a config asks for (paged, hf, or vllm behind the same interface).

Owns the mapping from `EngineConfig` to constructor arguments and the lazy import of the optional
vLLM backend. Does not load models (models/ does).
"""

from __future__ import annotations

from typing import Any

from posttrain.config import EngineConfig


def make_engine(engine_cfg: EngineConfig, model: Any, tokenizer: Any, *, seed: int = 0) -> Any:
    """A PagedEngine, HFEngine or VLLMEngine for `engine_cfg.backend`, serving `model`."""
    if engine_cfg.backend == "paged":
        from posttrain.engine.paged import PagedEngine

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
            seed=seed,
        )
    if engine_cfg.backend == "hf":
        from posttrain.engine.hf import HFEngine

        return HFEngine(
            model, tokenizer, max_model_len=engine_cfg.max_model_len, max_batch_size=engine_cfg.max_num_seqs, seed=seed
        )
    if engine_cfg.backend == "vllm":
        from posttrain.engine.vllm_backend import VLLMEngine

        return VLLMEngine(model, tokenizer, engine_cfg, seed=seed)
    raise ValueError(f"engine.backend must be one of paged, hf, vllm; got '{engine_cfg.backend}'")
