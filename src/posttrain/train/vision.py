"""The Learner's vision path for VLM policies of every family (`models.vision.VisionFamily`): replays a
sample's images (by content hash, from an `ImageStore`) through the model's own vision modules with the
preprocessing the engine used, and puts the features at the placeholder positions of the decoder's
input embeddings; which vision parts train (`model.vision`). Does not know where the images came from.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from posttrain.models.vision import ImageInputs, ImageStore, VisionFamily, placeholder_positions
from posttrain.train.batch import ModelInputs


class LearnerVision:
    """Builds `inputs_embeds` for micro-batches whose rows hold images; owns nothing trainable."""

    def __init__(self, inputs: ImageInputs, store: ImageStore, train_tower: bool) -> None:
        self.inputs = inputs
        self.store = store
        self.train_tower = train_tower

    @property
    def family(self) -> VisionFamily:
        return self.inputs.family

    def features(self, lm: Any, keys: list[str], device: torch.device) -> Tensor:
        """`[image tokens of the keys' images, hidden]` features of the stored images, in order."""
        unique = list(dict.fromkeys(keys))
        images = [self.store.get(k) for k in unique]
        pixels = {k: v.to(device) for k, v in self.inputs.hf_inputs(images).items()}
        feats = self.family.features(lm.model, lm.config, pixels, tower_grad=self.train_tower)
        per = feats.split([self.inputs.image_tokens(img) for img in images])
        at = {k: i for i, k in enumerate(unique)}
        return torch.cat([per[at[k]] for k in keys])

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
        (prompt and observation image tokens, not sampled ones), and for an M-RoPE family (Qwen2-VL)
        `[3, R, C]` position ids, each row's as the engine computed them. Raises if a row's placeholders
        and images disagree."""
        if not any(images):
            return inputs
        embed = lm.get_input_embeddings()
        x = embed(inputs.input_ids)
        flat: list[int] = []
        keys: list[str] = []
        positions = inputs.position_ids
        for r, row_images in enumerate(images):
            n = int(lengths[r])
            cols = placeholder_positions(
                token_ids[r, :n].tolist(), loss_mask[r, :n].tolist(), self.inputs.image_token_id
            )
            parts = [self.store.get(k) for k in row_images]
            want = sum(self.inputs.image_tokens(img) for img in parts)
            if len(cols) != want:
                raise ValueError(
                    f"row {r}: {len(cols)} image placeholders for {len(row_images)} image(s) whose "
                    f"layouts hold {want}"
                )
            base = int(inputs.flat_offset[r])
            flat.extend(base + c for c in cols)
            keys.extend(row_images)
            rope = self.family.rope_positions(self.inputs, n, cols, parts) if parts else None
            if rope is not None:  # M-RoPE: the row's 3-D positions, `[3, R, C]` for the whole micro-batch
                if positions.dim() == 2:
                    positions = positions.unsqueeze(0).repeat(3, 1, 1)
                positions.view(3, -1)[:, base : base + n] = rope[0].to(positions.device)
        if not keys:
            return inputs
        feats = self.features(lm, keys, x.device).to(x.dtype)
        h = x.shape[-1]
        idx = torch.tensor(flat, device=x.device)
        x = x.reshape(-1, h).index_copy(0, idx, feats).view_as(x)
        return ModelInputs(
            inputs.input_ids,
            positions,
            inputs.attention_mask,
            inputs.flat_offset,
            inputs.tokens,
            inputs.cells,
            inputs_embeds=x,
        )


def set_vision_trainable(lm: Any, family: VisionFamily, train_tower: bool, train_projector: bool) -> None:
    """Freeze or unfreeze the vision tower and the projector (the language side is the caller's)."""
    for names, on in ((family.tower_modules, train_tower), (family.projector_modules, train_projector)):
        for name in names:
            for p in lm.model.get_submodule(name).parameters():
                p.requires_grad_(on)


def vision_learner(model_cfg: Any, lm: Any, store: ImageStore | None = None) -> LearnerVision | None:
    """The Learner's vision path for a VLM `lm` (None for a text-only one), with the image
    inputs of `model_cfg.spec`'s tokenizer and an in-memory store unless one is given."""
    from posttrain.models import load_tokenizer
    from posttrain.models.vision import image_inputs, is_vision_config

    if not is_vision_config(lm.config):
        return None
    inputs = image_inputs(load_tokenizer(model_cfg.spec))
    if inputs is None:
        raise ValueError(f"model.spec {model_cfg.spec!r} is not a vision spec, but the policy is a VLM")
    return LearnerVision(inputs, store if store is not None else ImageStore(), model_cfg.vision.train_tower)
