"""Loading weights and tokenizers (embedded default, HF folders, GGUF, tiny test models, Hub ids through
huggingface_hub's cache), chat templates and LoRA wrapping. Layers: `text.py` (text models), `vision.py`
and its families above it, `hub.py`, then `loading.py` (which spec is what). Does not generate or train."""

from posttrain.models.chat import encode_messages, render_messages, template_supports_tools
from posttrain.models.loading import (
    DEFAULT_SPEC,
    ModelInfo,
    ModelNotFoundError,
    cache_dir,
    ensure_embedded,
    list_local,
    load_policy,
    load_tokenizer,
    resolve,
)
from posttrain.models.lora import merged_state_dict, wrap_lora

__all__ = [
    "DEFAULT_SPEC",
    "ModelInfo",
    "ModelNotFoundError",
    "cache_dir",
    "encode_messages",
    "ensure_embedded",
    "list_local",
    "load_policy",
    "load_tokenizer",
    "merged_state_dict",
    "render_messages",
    "resolve",
    "template_supports_tools",
    "wrap_lora",
]
