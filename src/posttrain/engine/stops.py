"""Which token ids end a completion for a model: every end-of-sequence id its config and generation
config list (an int or a list), the tokenizer's, and the end-of-turn marker its chat template closes
an assistant turn with (<|im_end|>, <|eot_id|>, <end_of_turn>, <|end|>). Decides nothing else.
"""

from __future__ import annotations

from typing import Any

END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|endofturn|>")


def _ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list | tuple):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def end_of_turn_ids(model: Any, tokenizer: Any) -> list[int]:
    """Sorted stop ids for `model` (a transformers model, its config, or a (config, state) pair) and `tokenizer`."""
    config = model[0] if isinstance(model, tuple) else getattr(model, "config", model)
    generation = getattr(model, "generation_config", None)
    ids = set(_ids(getattr(config, "eos_token_id", None)))
    ids.update(_ids(getattr(generation, "eos_token_id", None)))
    ids.update(_ids(getattr(tokenizer, "eos_token_id", None)))
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates (default, tool_use, ...)
        template = " ".join(t for t in template.values() if isinstance(t, str))
    if isinstance(template, str) and hasattr(tokenizer, "get_added_vocab"):
        added = tokenizer.get_added_vocab()
        ids.update(added[m] for m in END_OF_TURN_MARKERS if m in template and m in added)
    return sorted(ids)
