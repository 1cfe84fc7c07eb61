"""The Learner's vision path for LLaVA-style policies: replays a sample's images (by content hash, from
an `ImageStore`) through the model's own vision tower and projector with the preprocessing the engine
used, and puts the features at the placeholder positions of the decoder's input embeddings; which
vision parts train (`model.vision`). Does not know where the images came from.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from posttrain.models.vision import ImageInputs, ImageStore, placeholder_positions
from posttrain.train.batch import ModelInputs

# the vision modules peft must leave alone (their attention projections share the language side's names)
VISION_MODULES = r".*(vision_tower|multi_modal_projector).*"


class LearnerVision:
    """Builds `inputs_embeds` for micro-batches whose rows hold images; owns nothing trainable."""

    def __init__(self, inputs: ImageInputs, store: ImageStore, train_tower: bool) -> None:
        self.inputs = inputs
        self.store = store
        self.train_tower = train_tower

    def features(self, lm: Any, keys: list[str], device: torch.device) -> Tensor:
        """`[len(keys) * tokens_per_image, hidden]` features of the stored images, in order."""
        unique = list(dict.fromkeys(keys))
        pixels = self.inputs.pixel_values([self.store.get(k) for k in unique]).to(device)
        core = lm.model
        cfg = lm.config
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.train_tower):
            tower = core.vision_tower(pixels.to(core.vision_tower.dtype), output_hidden_states=True)
            layer, strategy = cfg.vision_feature_layer, cfg.vision_feature_select_strategy
            if isinstance(layer, int):
                feat = tower.hidden_states[layer]
                feat = feat[:, 1:] if strategy == "default" else feat
            else:
                pool = [tower.hidden_states[i] for i in layer]
                feat = torch.cat([h[:, 1:] for h in pool] if strategy == "default" else pool, dim=-1)
        feats = core.multi_modal_projector(feat)  # trains when its parameters require grad
        at = {k: i for i, k in enumerate(unique)}
        return torch.cat([feats[at[k]] for k in keys])

    def attach(
        self,
        lm: Any,
        inputs: ModelInputs,
        token_ids: Tensor,
        loss_mask: Tensor,
        lengths: Tensor,
        images: list[list[str]],
    ) -> ModelInputs:
        """`inputs` with `inputs_embeds`: the token embeddings, image features at each row's placeholders
        (prompt and observation image tokens, not sampled ones). Raises if a row's placeholders and
        images disagree."""
        if not any(images):
            return inputs
        embed = lm.get_input_embeddings()
        x = embed(inputs.input_ids)
        flat: list[int] = []
        keys: list[str] = []
        for r, row_images in enumerate(images):
            n = int(lengths[r])
            cols = placeholder_positions(
                token_ids[r, :n].tolist(), loss_mask[r, :n].tolist(), self.inputs.image_token_id
            )
            if len(cols) != len(row_images) * self.inputs.tokens_per_image:
                raise ValueError(
                    f"row {r}: {len(cols)} image placeholders for {len(row_images)} image(s) of "
                    f"{self.inputs.tokens_per_image} tokens each"
                )
            base = int(inputs.flat_offset[r])
            flat.extend(base + c for c in cols)
            keys.extend(row_images)
        if not keys:
            return inputs
        feats = self.features(lm, keys, x.device).to(x.dtype)
        h = x.shape[-1]
        idx = torch.tensor(flat, device=x.device)
        x = x.reshape(-1, h).index_copy(0, idx, feats).view_as(x)
        return ModelInputs(
            inputs.input_ids,
            inputs.position_ids,
            inputs.attention_mask,
            inputs.flat_offset,
            inputs.tokens,
            inputs.cells,
            inputs_embeds=x,
        )


def set_vision_trainable(lm: Any, train_tower: bool, train_projector: bool) -> None:
    """Freeze or unfreeze the vision tower and the projector (the language side is the caller's)."""
    for p in lm.model.vision_tower.parameters():
        p.requires_grad_(train_tower)
    for p in lm.model.multi_modal_projector.parameters():
        p.requires_grad_(train_projector)


def vision_learner(model_cfg: Any, lm: Any, store: ImageStore | None = None) -> LearnerVision | None:
    """The Learner's vision path for a LLaVA-style `lm` (None for a text-only one), with the image
    inputs of `model_cfg.spec`'s tokenizer and an in-memory store unless one is given."""
    from posttrain.models import load_tokenizer
    from posttrain.models.vision import image_inputs, is_vision_config

    if not is_vision_config(lm.config):
        return None
    inputs = image_inputs(load_tokenizer(model_cfg.spec))
    if inputs is None:
        raise ValueError(f"model.spec {model_cfg.spec!r} is not a vision spec, but the policy is a VLM")
    return LearnerVision(inputs, store if store is not None else ImageStore(), model_cfg.vision.train_tower)
