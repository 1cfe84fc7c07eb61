"""The Qwen2-VL / Qwen2.5-VL family: dynamic-resolution images (the image processor's `image_grid_thw`, a
run of `t*h*w / merge**2` placeholders between `<|vision_start|>` and `<|vision_end|>` per image), the
vision transformer with its 2x2 patch merger, the tiny random `tiny:qwen2_vl`, and the M-RoPE positions
(temporal/height/width per token, as transformers' `get_rope_index` computes them for images).

Positions are not the token index: an image of `gh x gw` merged patches advances the text position by
`max(gh, gw)`, so every token after it sits at a smaller position than its index (`rope_delta`). Does
not generate or train.
"""

from __future__ import annotations

import copy
import io
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.models.vision import (
    ImageInputs,
    VisionFamily,
    attach_image_inputs,
    image_inputs,
    random_vlm,
    tiny_text_config,
)
from posttrain.types import ContentError, ImagePart

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
_SPECIAL = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

# tiny:qwen2_vl: 4 px patches merged 2x2 (8 px per image token), images resized to 256..4096 pixels
_TINY_PATCH, _TINY_MERGE = 4, 2
_TINY_MIN_PIXELS, _TINY_MAX_PIXELS = 16 * 16, 64 * 64
# what a Qwen2VLTextConfig takes from the tiny language config (models.vision.tiny_text_config)
_TEXT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
)


def mrope_positions(
    length: int, runs: list[tuple[int, tuple[int, int, int]]], merge: int
) -> tuple[torch.Tensor, int]:
    """M-RoPE positions `[3, length]` (temporal, height, width) and the rope delta (max position + 1 -
    length: what a token generated after these ones adds to its index). `runs`: (first placeholder
    index, image_grid_thw) of each image in order; its `t * (h / merge) * (w / merge)` tokens get the
    grid's coordinates offset by the text position before it, every other token the next text position.
    """
    pos = torch.empty(3, length, dtype=torch.long)
    cur = at = 0
    for start, (t, h, w) in runs:
        if start < at:
            raise ValueError(f"image run at {start} overlaps the previous one (which ends at {at})")
        gh, gw = h // merge, w // merge
        n = t * gh * gw
        if start + n > length:
            raise ValueError(f"an image of {n} tokens at {start} runs past the sequence ({length} tokens)")
        pos[:, at:start] = torch.arange(start - at) + cur
        cur += start - at
        pos[0, start : start + n] = torch.arange(t).repeat_interleave(gh * gw) + cur
        pos[1, start : start + n] = torch.arange(gh).repeat_interleave(gw).repeat(t) + cur
        pos[2, start : start + n] = torch.arange(gw).repeat(t * gh) + cur
        cur += max(gh, gw)
        at = start + n
    pos[:, at:] = torch.arange(length - at) + cur
    delta = int(pos.max()) + 1 - length if length else 0
    return pos, delta


def image_runs(
    placeholders: list[int], grids: list[tuple[int, int, int]], merge: int
) -> list[tuple[int, tuple[int, int, int]]]:
    """(first placeholder index, grid) of each image: the placeholders split in order into runs of each
    grid's token count; ValueError unless the counts add up and every run is contiguous."""
    counts = [t * (h // merge) * (w // merge) for t, h, w in grids]
    if sum(counts) != len(placeholders):
        raise ValueError(
            f"{len(placeholders)} image placeholders for {len(grids)} image(s) of "
            f"{'+'.join(map(str, counts)) or 0} tokens"
        )
    runs, off = [], 0
    for grid, n in zip(grids, counts, strict=True):
        run = placeholders[off : off + n]
        if run and run[-1] - run[0] != n - 1:
            raise ValueError(f"the placeholders of image {len(runs)} are not one contiguous run")
        runs.append((run[0] if run else off, grid))
        off += n
    return runs


class Qwen2VLFamily(VisionFamily):
    """`Qwen2VLForConditionalGeneration`: the vision transformer `visual` (its `merger` is the projector)
    maps each image's patches onto the text hidden size, one feature per 2x2 merged patch; the language
    model is Qwen2 with 3-D (M-RoPE) positions. Qwen2.5-VL (models/qwen2_5_vl.py) differs only inside
    `visual`."""

    name = "qwen2_vl"
    model_types = ("qwen2_vl",)
    tower_modules = ("visual",)
    projector_modules = ("visual.merger",)
    text_renames = (("model.language_model.", "model."),)

    @property
    def vision_modules(self) -> tuple[str, ...]:
        return self.tower_modules  # the merger lives inside `visual`

    def folder_inputs(self, config: Any, processor: Any) -> ImageInputs:
        if getattr(config, "image_token_id", None) is None:
            raise ValueError("the Qwen2-VL config has no image_token_id")
        return _inputs_for(self, config, processor.tokenizer, processor.image_processor)

    def grid(self, inputs: ImageInputs, image: ImagePart) -> tuple[int, int, int]:
        """The image's `image_grid_thw` (1, patch rows, patch columns) after the processor's resize."""
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(image.png)) as im:
                width, height = im.size
        except (UnidentifiedImageError, OSError, SyntaxError) as err:
            raise ContentError(f"an image does not decode as a PNG ({err})") from None
        return _grid(inputs.image_processor, height, width)

    def hf_inputs(self, inputs: ImageInputs, pil: list[Any]) -> dict[str, Any]:
        out = inputs.image_processor(images=pil, return_tensors="pt")
        return {"pixel_values": out["pixel_values"].float(), "image_grid_thw": out["image_grid_thw"]}

    def layout(self, inputs: ImageInputs, image: ImagePart) -> str:
        t, h, w = self.grid(inputs, image)
        merge = inputs.image_processor.merge_size
        return VISION_START + inputs.image_token * (t * (h // merge) * (w // merge)) + VISION_END

    def features(self, modules: Any, config: Any, pixels: dict[str, Any], tower_grad: bool) -> Any:
        # the merger sits inside `visual`, after the blocks: which of them record gradients is their
        # requires_grad (set_vision_trainable freezes the tower, not the merger, unless train_tower)
        visual = modules.visual
        dtype = next(visual.parameters()).dtype
        out = visual(pixels["pixel_values"].to(dtype), grid_thw=pixels["image_grid_thw"])
        return out.pooler_output

    def rope_positions(
        self, inputs: ImageInputs, length: int, placeholders: list[int], images: list[ImagePart]
    ) -> tuple[torch.Tensor, int] | None:
        merge = inputs.image_processor.merge_size
        grids = [self.grid(inputs, img) for img in images]
        return mrope_positions(length, image_runs(placeholders, grids, merge), merge)

    def tiny(self, seed: int) -> tuple[Any, Any]:
        from transformers import Qwen2VLForConditionalGeneration

        config, tok = self.tiny_parts()
        return random_vlm(Qwen2VLForConditionalGeneration, config, seed), tok

    def tiny_parts(self) -> tuple[Any, Any]:
        """`tiny:<name>`'s config and tokenizer (image inputs attached)."""
        return tiny_parts(self)

    def tiny_tokenizer(self) -> Any:
        return self.tiny_parts()[1]

    def load_processor(self, path: Any) -> Any:
        from transformers import AutoImageProcessor, AutoTokenizer

        return ImageTextProcessor(
            AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path)
        )

    def processor(self, model: Any, tokenizer: Any) -> Any:
        vis = image_inputs(tokenizer)
        assert vis is not None
        return ImageTextProcessor(tokenizer, vis.image_processor)


@dataclass
class ImageTextProcessor:
    """The tokenizer and image processor of a Qwen2-VL folder, loaded and saved as transformers does, but
    without `Qwen2VLProcessor`, which also needs a video processor (and so torchvision) even for
    images."""

    tokenizer: Any
    image_processor: Any

    def save_pretrained(self, path: Any) -> None:
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)


FAMILY = Qwen2VLFamily()


def _grid(image_processor: Any, height: int, width: int) -> tuple[int, int, int]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    patch, merge = image_processor.patch_size, image_processor.merge_size
    size = image_processor.size
    try:
        h, w = smart_resize(
            height,
            width,
            factor=patch * merge,
            min_pixels=size["shortest_edge"],
            max_pixels=size["longest_edge"],
        )
    except ValueError as err:
        raise ContentError(f"an image of {width}x{height} px is refused: {err}") from None
    return 1, h // patch, w // patch


def _inputs_for(family: VisionFamily, config: Any, tokenizer: Any, image_processor: Any) -> ImageInputs:
    token_id = int(config.image_token_id)
    token = tokenizer.convert_ids_to_tokens(token_id)
    # run_length 0: an image's run of placeholders depends on its size (`layout`)
    return ImageInputs(family, image_processor, token, token_id, 0)


def qwen2_vl_config(
    text_config: dict[str, Any],
    tokenizer: Any,
    *,
    patch_size: int,
    merge_size: int,
    vision_hidden: int,
    vision_layers: int,
    vision_heads: int,
    initializer_range: float = 0.02,
    window_size: int | None = None,
) -> Any:
    """A Qwen2-VL config over `text_config` (Qwen2VLTextConfig fields), with the tokenizer's vision
    tokens and a vision transformer of `vision_layers` blocks merging `merge_size` x `merge_size`
    patches onto the text hidden size. With `window_size` (px), a Qwen2.5-VL config: its vision blocks
    (RMSNorm, SwiGLU) attend within windows of that size, all but the last, which attends to the image."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _SPECIAL}
    common = dict(
        depth=vision_layers,
        num_heads=vision_heads,
        patch_size=patch_size,
        spatial_merge_size=merge_size,
        temporal_patch_size=2,
        initializer_range=initializer_range,
    )
    if window_size is None:
        cls, vision = (
            Qwen2VLConfig,
            dict(common, embed_dim=vision_hidden, hidden_size=text_config["hidden_size"]),
        )
    else:
        cls, vision = (
            Qwen2_5_VLConfig,
            dict(
                common,
                hidden_size=vision_hidden,
                intermediate_size=2 * vision_hidden,
                out_hidden_size=text_config["hidden_size"],
                window_size=window_size,
                fullatt_block_indexes=[vision_layers - 1],
            ),
        )
    return cls(
        text_config=text_config,
        vision_config=vision,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=bool(text_config.get("tie_word_embeddings", False)),
    )


def tiny_parts(family: VisionFamily, window_size: int | None = None) -> tuple[Any, Any]:
    """tiny:qwen2_vl's config (Qwen2.5-VL's with `window_size`) and tokenizer (the SmolLM2 tokenizer plus
    the vision tokens, `family`'s image inputs attached)."""
    from transformers import Qwen2VLImageProcessorPil

    from posttrain.models.text import embedded_tokenizer

    tok = copy.deepcopy(embedded_tokenizer())
    missing = [t for t in _SPECIAL if t not in tok.get_vocab()]
    if missing:
        tok.add_special_tokens({"additional_special_tokens": missing})
    base = tiny_text_config(tok)
    text = {k: getattr(base, k) for k in _TEXT_FIELDS}
    # head_dim 16: 8 rotary frequencies, in M-RoPE sections of 2 (temporal) + 3 (height) + 3 (width)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    config = qwen2_vl_config(
        text,
        tok,
        patch_size=_TINY_PATCH,
        merge_size=_TINY_MERGE,
        vision_hidden=32,
        vision_layers=2,
        vision_heads=2,
        initializer_range=0.2,
        window_size=window_size,
    )
    processor = Qwen2VLImageProcessorPil(
        patch_size=_TINY_PATCH,
        merge_size=_TINY_MERGE,
        temporal_patch_size=2,
        size={"shortest_edge": _TINY_MIN_PIXELS, "longest_edge": _TINY_MAX_PIXELS},
    )
    return config, attach_image_inputs(tok, _inputs_for(family, config, tok, processor))


def tiny_qwen2_vl(seed: int = 0) -> tuple[Any, Any]:
    """A tiny random Qwen2-VL (4 px patches merged 2x2, images resized to 16x16..64x64 px, so 4 to 64
    image tokens; a 2-block vision transformer of width 32; a 2-layer Qwen2 language model with M-RoPE
    sections 2/3/3) with the SmolLM2 tokenizer plus the vision tokens; (model, tokenizer) with the
    image inputs attached."""
    return FAMILY.tiny(seed)
