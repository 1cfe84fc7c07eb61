"""LoRA wrapping through peft: adapters on the named projections, merge for export and weight sync."""

from __future__ import annotations

import warnings
from typing import Any


def wrap_lora(
    model: Any,
    rank: int,
    alpha: float,
    dropout: float,
    target_modules: list[str],
    exclude_modules: str | None = None,
) -> Any:
    """Return a peft model with LoRA adapters; the base weights are frozen. `exclude_modules` (a regex
    over module names) keeps adapters off modules that share a target's name (a VLM's vision tower)."""
    from peft import LoraConfig, get_peft_model

    present = {name.split(".")[-1] for name, _ in model.named_modules()}
    targets = [t for t in target_modules if t in present]
    if not targets:
        raise ValueError(f"none of the LoRA target modules {target_modules} exist in this model")
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets,
        bias="none",
        exclude_modules=exclude_modules,
    )
    with warnings.catch_warnings():
        # peft reads model.is_gradient_checkpointing, which transformers 5 deprecates: a FutureWarning about the
        # two libraries' versions that no posttrain user can act on. Only that one is silenced.
        warnings.filterwarnings(
            "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        return get_peft_model(model, config)


def merged_state_dict(model: Any) -> dict[str, Any]:
    """Plain HF-named weights with LoRA deltas merged in, without modifying the model."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return {k: v.detach() for k, v in model.state_dict().items()}
    import copy

    merged = copy.deepcopy(model).merge_and_unload()
    return {k: v.detach() for k, v in merged.state_dict().items()}
