"""The Learner's weights as they travel to an engine: a `WeightUpdate` (full HF-named weights, or LoRA
adapters with their scaling), built from a (peft) model, and the adapted modules' base weights a LoRA
receiver merges into. Pure tensor helpers: no transport, no files (orchestrator/weight_sync.py sends them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

LORA_A, LORA_B = ".lora_A", ".lora_B"


@dataclass
class WeightUpdate:
    """One push. `kind="full"`: HF-named weights. `kind="lora"`: per module ``{module}.lora_A`` /
    ``{module}.lora_B`` tensors and `scaling[module]`; the receiver adds ``scaling * B @ A`` (transposed
    for fan-in-fan-out modules, listed in `transposed`) to its base ``{module}.weight``."""

    version: int
    kind: Literal["full", "lora"]
    tensors: dict[str, torch.Tensor]
    scaling: dict[str, float] = field(default_factory=dict)
    transposed: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes that travel: a tensor tied to another (embeddings and LM head) counts once."""
        unique, _ = dedupe(self.tensors)
        return sum(t.numel() * t.element_size() for t in unique.values())


def dedupe(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors with each shared storage once, {alias: name it shares with}) for tied weights."""
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            unique[name] = t
    return unique, aliases


def full_update(weights: dict[str, torch.Tensor], version: int) -> WeightUpdate:
    return WeightUpdate(version=int(version), kind="full", tensors=dict(weights))


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value, gathered from its shards (a collective); a plain tensor as it is."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def lora_update(model: Any, version: int) -> WeightUpdate:
    """The active LoRA adapters of a peft model, HF-named by module (``base_model.model.`` stripped).
    Adapters split by tensor parallelism are gathered whole, so the receiver merges the A and B one
    process would push; then every rank must call it (the gather is a collective)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    tensors: dict[str, torch.Tensor] = {}
    scaling: dict[str, float] = {}
    transposed: list[str] = []
    for name, module in base.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        adapters = [ad for ad in module.active_adapters if ad in module.lora_A]
        if len(adapters) != 1:
            raise ValueError(f"LoRA sync expects one active adapter per module; {name} has {adapters}")
        ad = adapters[0]
        if module.use_dora.get(ad, False):
            raise ValueError("syncing DoRA adapters is not supported; use plain LoRA")
        tensors[name + LORA_A] = _whole(module.lora_A[ad].weight.detach())
        tensors[name + LORA_B] = _whole(module.lora_B[ad].weight.detach())
        scaling[name] = float(module.scaling[ad])
        if getattr(module, "fan_in_fan_out", False):
            transposed.append(name)
    if not tensors:
        raise ValueError("the model has no LoRA layers to sync")
    return WeightUpdate(int(version), "lora", tensors, scaling, transposed)


def lora_base(model: Any) -> dict[str, torch.Tensor]:
    """Copies of the base ``{module}.weight`` of each LoRA-adapted module of a peft model: what a LoRA
    `Receiver` keeps to merge adapters into. Weights sharded or split over ranks are gathered whole
    (then every rank must call it, as `lora_update`)."""
    from peft.tuners.lora import LoraLayer

    return {
        f"{name}.weight": _whole(module.get_base_layer().weight.detach()).clone()
        for name, module in model.get_base_model().named_modules()
        if isinstance(module, LoraLayer)
    }
