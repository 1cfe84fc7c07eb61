"""The paged engine's vision path for LLaVA-style models: the vision tower and projector that run at
prefill, image features by content hash, the split of a VLM's weights into the language model's (the
paged forward's, under Llama names) and the vision side's, and the prompt's placeholder checks.

The features of a request's images replace the input embeddings at its placeholder positions (in
order), as transformers' LLaVA does; the prefix cache keys those positions by image hash (see
`Sequence.block_key`). Does not schedule, sample, or preprocess pixels (models/vision.py does).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from posttrain.engine.types import BadRequestError
from posttrain.models.vision import ImageInputs
from posttrain.types import ContentError, ImagePart

_VISION_PREFIXES = (
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "vision_tower.",
    "multi_modal_projector.",
)
_TEXT_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.", ""),
)


def text_name(name: str) -> str | None:
    """The language model's parameter under the Llama names the paged forward maps, or None for a vision
    parameter (`base_model.model.` stripped first)."""
    name = name.removeprefix("base_model.model.")
    if name.startswith(_VISION_PREFIXES):
        return None
    for old, new in _TEXT_RENAMES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


class VisionPrefill(nn.Module):
    """A VLM's vision tower and projector (the engine's own copies), computing each image's features
    `[tokens_per_image, text hidden]` once and keeping the latest `cache_images` by content hash."""

    def __init__(
        self,
        model: Any,
        inputs: ImageInputs,
        dtype: torch.dtype,
        device: torch.device,
        cache_images: int = 64,
    ) -> None:
        super().__init__()
        core = getattr(model, "model", model)
        self.vision_tower = copy.deepcopy(core.vision_tower).to(device=device, dtype=dtype).eval()
        self.projector = copy.deepcopy(core.multi_modal_projector).to(device=device, dtype=dtype).eval()
        self.layer = model.config.vision_feature_layer
        self.strategy = model.config.vision_feature_select_strategy
        self.inputs = inputs
        self.dtype, self.device = dtype, device
        self.cache_images = cache_images
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()

    @torch.inference_mode()
    def features(self, images: list[ImagePart]) -> torch.Tensor:
        """`[len(images) * tokens_per_image, hidden]` features, in order (as LLaVA's get_image_features)."""
        todo = [img for img in dict.fromkeys(images, None) if img.sha256 not in self._cache]
        if todo:
            try:
                pixels = self.inputs.pixel_values(todo).to(self.device, self.dtype)
            except ContentError as err:
                raise BadRequestError(str(err)) from None
            out = self.vision_tower(pixels, output_hidden_states=True, return_dict=True)
            if isinstance(self.layer, int):
                feat = out.hidden_states[self.layer]
                feat = feat[:, 1:] if self.strategy == "default" else feat
            else:
                pool = [out.hidden_states[i] for i in self.layer]
                feat = torch.cat([h[:, 1:] for h in pool] if self.strategy == "default" else pool, dim=-1)
            feats = self.projector(feat)
            if feats.shape[1] != self.inputs.tokens_per_image:
                raise ValueError(
                    f"the vision tower gives {feats.shape[1]} features per image, the processor "
                    f"{self.inputs.tokens_per_image} placeholders: the model folder is inconsistent"
                )
            for img, f in zip(todo, feats, strict=True):
                self._cache[img.sha256] = f
                while len(self._cache) > self.cache_images:
                    self._cache.popitem(last=False)
        for img in images:
            self._cache.move_to_end(img.sha256)
        return torch.cat([self._cache[img.sha256] for img in images])

    def load_vision_weights(self, items: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy vision-side HF tensors in place; the feature cache is dropped. Returns how many."""
        params = {
            **{f"vision_tower.{k}": v for k, v in self.vision_tower.state_dict().items()},
            **{f"multi_modal_projector.{k}": v for k, v in self.projector.state_dict().items()},
        }
        n = 0
        for raw, tensor in items:
            name = raw.removeprefix("base_model.model.").removeprefix("model.")
            if name not in params:
                raise ValueError(f"unknown vision parameter '{raw}'")
            with torch.no_grad():
                params[name].copy_(tensor.detach())
            n += 1
        self._cache.clear()
        return n


def split_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """(language tensors under Llama names, vision tensors under their own names)."""
    text, vision = [], []
    for name, tensor in weights:
        t = text_name(name)
        if t is None:
            vision.append((name, tensor))
        else:
            text.append((t, tensor))
    return text, vision


def check_placeholders(prompt: list[int], images: list[ImagePart], inputs: ImageInputs) -> list[int]:
    """The prompt's placeholder positions; BadRequestError unless there are tokens_per_image of them per
    image."""
    pos = [i for i, t in enumerate(prompt) if t == inputs.image_token_id]
    want = len(images) * inputs.tokens_per_image
    if len(pos) != want:
        raise BadRequestError(
            f"the prompt holds {len(pos)} image placeholder tokens; {len(images)} image(s) need "
            f"{inputs.tokens_per_image} each ({want})"
        )
    return pos
