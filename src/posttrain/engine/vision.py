"""The paged engine's vision path, for every VLM family (`models.vision.VisionFamily`): the engine's own
copies of the vision modules that run at prefill, image features by content hash, the split of a VLM's
weights into the language model's (the paged forward's, under Llama names) and the vision side's, and
the prompt's placeholder checks.

The features of a request's images replace the input embeddings at its placeholder positions (in
order), as transformers' VLMs do; the prefix cache keys those positions by image hash (see
`Sequence.block_key`). Does not schedule or sample; preprocessing and the vision forward are the
family's.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from posttrain.engine.types import BadRequestError
from posttrain.models.vision import ImageInputs, VisionFamily
from posttrain.types import ContentError, ImagePart


class VisionPrefill(nn.Module):
    """A VLM's vision modules (the engine's own copies), computing each image's features
    `[image tokens, text hidden]` once and keeping the latest `cache_images` by content hash."""

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
        self.family = inputs.family
        self.parts = nn.ModuleDict(
            {n: copy.deepcopy(getattr(core, n)) for n in self.family.vision_modules}
        ).to(device=device, dtype=dtype)
        self.parts.eval()
        self.config = model.config
        self.inputs = inputs
        self.dtype, self.device = dtype, device
        self.cache_images = cache_images
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()

    @torch.inference_mode()
    def features(self, images: list[ImagePart]) -> torch.Tensor:
        """`[image tokens of the images, hidden]` features, in order."""
        todo = [img for img in dict.fromkeys(images, None) if img.sha256 not in self._cache]
        if todo:
            try:
                pixels = self.inputs.hf_inputs(todo)
                counts = [self.inputs.image_tokens(img) for img in todo]
            except ContentError as err:
                raise BadRequestError(str(err)) from None
            pixels = {k: v.to(self.device) for k, v in pixels.items()}
            feats = self.family.features(self.parts, self.config, pixels, tower_grad=False)
            if feats.shape[0] != sum(counts):
                raise ValueError(
                    f"the vision modules give {feats.shape[0]} features for {len(todo)} image(s), the "
                    f"processor's layout {sum(counts)} placeholders: the model folder is inconsistent"
                )
            for img, f in zip(todo, feats.split(counts), strict=True):
                self._cache[img.sha256] = f
                while len(self._cache) > self.cache_images:
                    self._cache.popitem(last=False)
        for img in images:
            self._cache.move_to_end(img.sha256)
        return torch.cat([self._cache[img.sha256] for img in images])

    def load_vision_weights(self, items: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy vision-side HF tensors in place; the feature cache is dropped. Returns how many."""
        params = self.parts.state_dict()
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
    weights: Iterable[tuple[str, torch.Tensor]], family: VisionFamily
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """(language tensors under Llama names, vision tensors under their own names)."""
    text, vision = [], []
    for name, tensor in weights:
        t = family.text_name(name)
        if t is None:
            vision.append((name, tensor))
        else:
            text.append((t, tensor))
    return text, vision


def check_placeholders(prompt: list[int], images: list[ImagePart], inputs: ImageInputs) -> list[int]:
    """The prompt's placeholder positions; BadRequestError unless they are as many as the images' layouts
    hold."""
    pos = [i for i, t in enumerate(prompt) if t == inputs.image_token_id]
    try:
        counts = [inputs.image_tokens(img) for img in images]
    except ContentError as err:
        raise BadRequestError(str(err)) from None
    if len(pos) != sum(counts):
        raise BadRequestError(
            f"the prompt holds {len(pos)} image placeholder tokens; {len(images)} image(s) need "
            f"{'+'.join(map(str, counts)) or 0} ({sum(counts)})"
        )
    return pos
