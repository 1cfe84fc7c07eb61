"""The Idefics3 / SmolVLM family (`Idefics3ForConditionalGeneration` with its `Idefics3Processor`): a
SigLIP-style vision transformer, the pixel-shuffle connector onto the Llama text model, and the
processor's prompt layout; and the tiny random `tiny:idefics3`.

An image is one square tile (the unsplit layout: `<fake_token_around_image><global-img>` + a run of
`<image>` + `<fake_token_around_image>`) or, when the image processor's `do_image_splitting` is on and
the image is larger than a tile, rows x cols tiles (`<fake_token_around_image><row_i_col_j>` + a run
each, a newline after each row) then the global tile. Each run is `image_seq_len` placeholders, one per
connector feature; the tiles' features fill them in that order, as transformers' Idefics3 does.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

from posttrain.models.vision import (
    IMAGE_TOKEN,
    ImageInputs,
    VisionFamily,
    attach_image_inputs,
    decode_images,
    image_inputs,
    random_vlm,
    tiny_text_config,
)
from posttrain.types import ImagePart

FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
MAX_GRID = 6  # the processor's <row_i_col_j> tokens go to 6 x 6
_GRID_CACHE = 256


def _grid_tokens() -> list[str]:
    return [f"<row_{i + 1}_col_{j + 1}>" for i in range(MAX_GRID) for j in range(MAX_GRID)]


def image_seq_len(config: Any) -> int:
    """Placeholders per tile: the vision patches after the connector's pixel shuffle."""
    v = config.vision_config
    return ((v.image_size // v.patch_size) ** 2) // (config.scale_factor**2)


def idefics3_config(
    text_config: Any,
    image_token_id: int,
    *,
    image_size: int,
    patch_size: int,
    vision_hidden: int,
    vision_layers: int,
    vision_heads: int,
    scale_factor: int = 2,
) -> Any:
    """An Idefics3 config: a SigLIP-style vision transformer on `image_size` px tiles and the pixel-shuffle
    connector (`scale_factor`) onto `text_config`'s hidden size."""
    from transformers import Idefics3Config, Idefics3VisionConfig

    side = image_size // patch_size
    if image_size % patch_size or side % scale_factor:
        raise ValueError(
            f"image_size {image_size} must be a multiple of patch_size {patch_size}, and the patch grid "
            f"({side}) of scale_factor {scale_factor}"
        )
    vision = Idefics3VisionConfig(
        hidden_size=vision_hidden,
        intermediate_size=4 * vision_hidden,
        num_hidden_layers=vision_layers,
        num_attention_heads=vision_heads,
        image_size=image_size,
        patch_size=patch_size,
    )
    return Idefics3Config(
        vision_config=vision,
        text_config=text_config,
        image_token_id=image_token_id,
        scale_factor=scale_factor,
        tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)),
    )


def idefics3_image_processor(tile: int, longest_edge: int, split: bool) -> Any:
    """Idefics3's image processor: images resized to `longest_edge`, then one `tile` px square (unsplit)
    or tiles of `tile` px plus the global one (`split`)."""
    from transformers import Idefics3ImageProcessorPil

    return Idefics3ImageProcessorPil(
        size={"longest_edge": longest_edge},
        max_image_size={"longest_edge": tile},
        do_image_splitting=split,
    )


def _with_tokens(tokenizer: Any) -> Any:
    vocab = tokenizer.get_vocab()
    new = [
        t
        for t in (FAKE_TOKEN, IMAGE_TOKEN, GLOBAL_TOKEN, END_OF_UTTERANCE, *_grid_tokens())
        if t not in vocab
    ]
    if new:
        tokenizer.add_special_tokens({"additional_special_tokens": new})
    return tokenizer


def _tiny_idefics3_parts() -> tuple[Any, Any]:
    """tiny:idefics3's config and tokenizer (the SmolLM2 tokenizer plus the processor's tokens, image
    inputs attached): 32 px tiles in 4 px patches, pixel shuffle 2 -> 16 placeholders per tile."""
    from posttrain.models.text import embedded_tokenizer

    tok = _with_tokens(copy.deepcopy(embedded_tokenizer()))
    config = idefics3_config(
        tiny_text_config(tok),
        tok.convert_tokens_to_ids(IMAGE_TOKEN),
        image_size=32,
        patch_size=4,
        vision_hidden=32,
        vision_layers=2,
        vision_heads=2,
    )
    inputs = ImageInputs(
        FAMILY,
        idefics3_image_processor(32, 64, split=False),
        IMAGE_TOKEN,
        config.image_token_id,
        image_seq_len(config),
    )
    return config, attach_image_inputs(tok, inputs)


def tiny_idefics3(seed: int = 0) -> tuple[Any, Any]:
    """A tiny random Idefics3 (32 px tiles -> 16 image tokens, unsplit; a 2-layer Llama) with the SmolLM2
    tokenizer plus the processor's tokens; (model, tokenizer) with the image inputs attached."""
    from transformers import Idefics3ForConditionalGeneration

    config, tok = _tiny_idefics3_parts()
    return random_vlm(Idefics3ForConditionalGeneration, config, seed), tok


class Idefics3Family(VisionFamily):
    """`Idefics3ForConditionalGeneration` (SmolVLM): `vision_model` + `connector` on `text_model`."""

    name = "idefics3"
    model_types = ("idefics3",)
    tower_modules = ("vision_model",)
    projector_modules = ("connector",)
    text_renames = (("model.text_model.", "model."),)

    def __init__(self) -> None:
        self._grids: OrderedDict[tuple[int, str], tuple[int, int]] = OrderedDict()

    def folder_inputs(self, config: Any, processor: Any) -> ImageInputs:
        want = image_seq_len(config)
        if int(processor.image_seq_len) != want:
            raise ValueError(
                f"the processor's image_seq_len {processor.image_seq_len} is not the model's {want} "
                "(vision patches after the pixel shuffle)"
            )
        token_id = int(config.image_token_id)
        token = processor.tokenizer.convert_ids_to_tokens(token_id)
        if token != IMAGE_TOKEN:
            raise ValueError(f"the config's image_token_id {token_id} is {token!r}, not {IMAGE_TOKEN!r}")
        return ImageInputs(self, processor.image_processor, token, token_id, want)

    def hf_inputs(self, inputs: ImageInputs, pil: list[Any]) -> dict[str, Any]:
        # one sample holding every image: their tiles in order, [1, tiles, 3, S, S] (all tiles S x S)
        out = inputs.image_processor(images=[pil], return_tensors="pt")
        return {
            "pixel_values": out["pixel_values"].float(),
            "pixel_attention_mask": out["pixel_attention_mask"],
        }

    def grid(self, inputs: ImageInputs, image: ImagePart) -> tuple[int, int]:
        """(rows, cols) of the image's tiles through the processor; (0, 0) for the unsplit layout."""
        proc = inputs.image_processor
        if not proc.do_image_splitting:
            return 0, 0
        key = (id(proc), image.sha256)
        if key not in self._grids:
            out = proc(images=[decode_images([image])], return_row_col_info=True)
            self._grids[key] = (int(out["rows"][0][0]), int(out["cols"][0][0]))
            while len(self._grids) > _GRID_CACHE:
                self._grids.popitem(last=False)
        return self._grids[key]

    def layout(self, inputs: ImageInputs, image: ImagePart) -> str:
        run = inputs.image_token * inputs.run_length
        glob = f"{FAKE_TOKEN}{GLOBAL_TOKEN}{run}{FAKE_TOKEN}"
        rows, cols = self.grid(inputs, image)
        if rows == 0 and cols == 0:
            return glob
        text = "".join(
            "".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n"
            for r in range(rows)
        )
        return f"{text}\n{glob}"

    def features(self, modules: Any, config: Any, pixels: dict[str, Any], tower_grad: bool) -> Any:
        import torch

        tower = modules.vision_model
        dtype = next(tower.parameters()).dtype
        pv = pixels["pixel_values"]
        pv = pv.reshape(-1, *pv.shape[-3:]).to(dtype)
        mask = pixels["pixel_attention_mask"].reshape(-1, *pv.shape[-2:])
        p = config.vision_config.patch_size
        patches = mask.unfold(1, p, p).unfold(2, p, p)
        patch_mask = (patches.sum(dim=(-1, -2)) > 0).bool()
        with torch.set_grad_enabled(torch.is_grad_enabled() and tower_grad):
            hidden = tower(
                pixel_values=pv, patch_attention_mask=patch_mask, return_dict=True
            ).last_hidden_state
        feats = modules.connector(hidden)  # trains when its parameters require grad
        return feats.reshape(-1, feats.shape[-1])

    def tiny(self, seed: int) -> tuple[Any, Any]:
        return tiny_idefics3(seed)

    def tiny_tokenizer(self) -> Any:
        return _tiny_idefics3_parts()[1]

    def processor(self, model: Any, tokenizer: Any) -> Any:
        from transformers import Idefics3Processor

        vis = image_inputs(tokenizer)
        assert vis is not None
        return Idefics3Processor(
            image_processor=vis.image_processor,
            tokenizer=tokenizer,
            image_seq_len=vis.run_length,
            chat_template=tokenizer.chat_template,
        )


FAMILY = Idefics3Family()
