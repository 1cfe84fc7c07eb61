"""The Qwen2.5-VL family: Qwen2-VL's adapter (models/qwen2_vl.py: the same processor, placeholder layout,
M-RoPE and language model), for `Qwen2_5_VLForConditionalGeneration`, whose vision transformer (RMSNorm,
SwiGLU blocks) attends within windows in all but its full-attention blocks; and `tiny:qwen2_5_vl`.
Does not generate or train.
"""

from __future__ import annotations

from typing import Any

from posttrain.models.qwen2_vl import Qwen2VLFamily, tiny_parts
from posttrain.models.vision import random_vlm

TINY_WINDOW_PX = 16  # tiny:qwen2_5_vl's attention windows: 2x2 image tokens of 8 px


class Qwen2_5VLFamily(Qwen2VLFamily):
    name = "qwen2_5_vl"
    model_types = ("qwen2_5_vl",)

    def tiny(self, seed: int) -> tuple[Any, Any]:
        from transformers import Qwen2_5_VLForConditionalGeneration

        config, tok = self.tiny_parts()
        return random_vlm(Qwen2_5_VLForConditionalGeneration, config, seed), tok

    def tiny_parts(self) -> tuple[Any, Any]:
        return tiny_parts(self, window_size=TINY_WINDOW_PX)


FAMILY = Qwen2_5VLFamily()


def tiny_qwen2_5_vl(seed: int = 0) -> tuple[Any, Any]:
    """tiny:qwen2_vl's sizes as a Qwen2.5-VL: its first vision block attends within 16 px windows (2x2
    image tokens), the second to the whole image; the same tokenizer and image processor."""
    return FAMILY.tiny(seed)
