"""make_engine: the engine a config asks for, by `engine.backend` through the engine registry (paged, hf,
vllm, or any backend registered with `@register_engine`). Each backend's module maps `EngineConfig` to
its constructor; the optional vLLM one is imported only when asked for. Does not load models (models/ does).
"""

from __future__ import annotations

from typing import Any

from posttrain.config import EngineConfig
from posttrain.engine.registry import engine_builder
from posttrain.engine.types import Engine


def make_engine(engine_cfg: EngineConfig, model: Any, tokenizer: Any, *, seed: int = 0) -> Engine:
    """The engine registered as `engine_cfg.backend`, serving `model`; an unknown name raises
    UnknownEngineError (a ValueError) naming the registered ones; vLLM-only keys on another backend raise."""
    vllm_only = engine_cfg.vllm_only_settings()
    if engine_cfg.backend != "vllm" and vllm_only:
        raise ValueError(
            f"engine.backend={engine_cfg.backend} does not run {', '.join(vllm_only)}: those are the vllm "
            "backend's; leave them at their defaults"
        )
    return engine_builder(engine_cfg.backend)(engine_cfg, model, tokenizer, seed=seed)
