"""Vision-language models: the per-family adapters (`VisionFamily`: preprocessing, the placeholder layout
of one image, the vision forward, which modules and weight names are the vision side), VLM folders
loaded and saved with their processors, the tiny random `tiny:<family>` models, the vision chat
rendering (each image part becomes the model's placeholder text), and the LLaVA family itself with the
graft of a from-scratch SigLIP-style encoder onto the embedded default. Other families live in their
own modules (`_FAMILY_MODULES`).

A loaded VLM's tokenizer carries its `ImageInputs` (`image_inputs(tokenizer)`), so every layer that
already passes the tokenizer can preprocess images the one way the model was built with. Also owns the
content-addressed `ImageStore` trajectories reference their images by. Does not generate or train.
"""

from __future__ import annotations

import abc
import copy
import hashlib
import importlib
import io
import json
import os
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from posttrain.models.text import (
    embedded_tokenizer,
    ensure_embedded,
    quiet_transformers,
    save_hf_folder_atomically,
    tiny_config,
)
from posttrain.types import ContentError, ImagePart, Message, TextPart, ToolSpec

IMAGE_TOKEN = "<image>"
# tiny family name -> the module whose `FAMILY` is its adapter
_FAMILY_MODULES = {
    "llava": "posttrain.models.vision",
    "qwen2_vl": "posttrain.models.qwen2_vl",
    "qwen2_5_vl": "posttrain.models.qwen2_5_vl",
    "idefics3": "posttrain.models.vision_idefics3",
}
VISION_TINY_FAMILIES = tuple(_FAMILY_MODULES)
_IMAGE_INPUTS_ATTR = "posttrain_image_inputs"


def decode_images(images: list[ImagePart]) -> list[Any]:
    """The images as RGB PIL images; ContentError naming the first that does not decode."""
    from PIL import Image, UnidentifiedImageError

    pil = []
    for i, img in enumerate(images):
        try:
            with Image.open(io.BytesIO(img.png)) as im:
                pil.append(im.convert("RGB"))
        except (UnidentifiedImageError, OSError, SyntaxError) as err:
            raise ContentError(f"image {i} does not decode as a PNG ({err})") from None
    return pil


class VisionFamily(abc.ABC):
    """What differs between VLM families, for the loaders here, the paged engine (engine/vision.py) and
    the Learner (train/vision.py): the image preprocessing, the placeholder text of one image, the vision
    forward onto the text model's hidden size, and which modules and weight names are the vision side.

    `tower_modules` and `projector_modules` are attributes of the HF model's core (`model.model`); the
    engine copies them and the Learner freezes the tower by default; `text_renames` map the language
    model's HF names onto the Llama names the paged forward reads."""

    name: str
    model_types: tuple[str, ...]
    tower_modules: tuple[str, ...]
    projector_modules: tuple[str, ...]
    text_renames: tuple[tuple[str, str], ...]

    @property
    def vision_modules(self) -> tuple[str, ...]:
        return self.tower_modules + self.projector_modules

    @property
    def peft_exclude(self) -> str:
        """The regex of the vision modules peft must leave alone (their attention projections share the
        language side's names)."""
        return rf".*({'|'.join(self.vision_modules)}).*"

    def text_name(self, name: str) -> str | None:
        """The language model's parameter under the Llama names the paged forward maps, or None for a
        vision parameter (`base_model.model.` stripped first)."""
        name = name.removeprefix("base_model.model.")
        if name.removeprefix("model.").split(".", 1)[0] in self.vision_modules:
            return None
        for old, new in self.text_renames:
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    @abc.abstractmethod
    def folder_inputs(self, config: Any, processor: Any) -> ImageInputs:
        """The image inputs of a model folder from its config and loaded processor."""

    @abc.abstractmethod
    def hf_inputs(self, inputs: ImageInputs, pil: list[Any]) -> dict[str, Any]:
        """The tensors the HF model's forward takes for these images (`pixel_values`, ...), float32."""

    @abc.abstractmethod
    def layout(self, inputs: ImageInputs, image: ImagePart) -> str:
        """The prompt text one image part becomes: its placeholder tokens and any marker tokens around."""

    @abc.abstractmethod
    def features(self, modules: Any, config: Any, pixels: dict[str, Any], tower_grad: bool) -> Any:
        """`[image tokens of all the images, text hidden]` features in placeholder order. `modules` has the
        vision modules as attributes (the HF core model, or the engine's copies); `pixels` is `hf_inputs`
        on their device; the tower records gradients only with `tower_grad`."""

    @abc.abstractmethod
    def tiny(self, seed: int) -> tuple[Any, Any]:
        """`tiny:<name>`: (random model, tokenizer with image inputs attached)."""

    @abc.abstractmethod
    def tiny_tokenizer(self) -> Any:
        """`tiny:<name>`'s tokenizer with image inputs attached (no weights built)."""

    def rope_positions(
        self, inputs: ImageInputs, length: int, placeholders: list[int], images: list[ImagePart]
    ) -> tuple[Any, int] | None:
        """3-D (M-RoPE) positions `[3, length]` of a sequence whose placeholders (indices, in order)
        hold `images`, and the rope delta a token after it adds to its index; None: the positions are
        the token indices."""
        return None

    def load_processor(self, path: Any) -> Any:
        """The processor of a model folder (its `tokenizer` and `image_processor`)."""
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(path)

    @abc.abstractmethod
    def processor(self, model: Any, tokenizer: Any) -> Any:
        """The HF processor to save with `model` (its tokenizer and image processor)."""


def family(name: str) -> VisionFamily:
    """The adapter of tiny family `name`."""
    if name not in _FAMILY_MODULES:
        raise ValueError(f"unknown vision family '{name}'; choose one of {', '.join(_FAMILY_MODULES)}")
    return importlib.import_module(_FAMILY_MODULES[name]).FAMILY


def family_of(config: Any) -> VisionFamily:
    """The adapter of a VLM config (by `model_type`); ValueError for a family not built here."""
    model_type = getattr(config, "model_type", None)
    for name in _FAMILY_MODULES:
        fam = family(name)
        if model_type in fam.model_types:
            return fam
    known = [t for n in _FAMILY_MODULES for t in family(n).model_types]
    raise ValueError(
        f"vision model type '{model_type}' is not supported; the families built here load {', '.join(known)}"
    )


@dataclass
class ImageInputs:
    """How a VLM takes images: its family's adapter, its HF image processor, the placeholder token whose
    positions take the vision features, and `run_length`, the placeholders of one fixed-size run (LLaVA:
    one image; families whose runs vary with the image say in their layout)."""

    family: VisionFamily = field(repr=False)
    image_processor: Any = field(repr=False)
    image_token: str
    image_token_id: int
    run_length: int

    def hf_inputs(self, images: list[ImagePart]) -> dict[str, Any]:
        """The HF model's image tensors (`pixel_values`, ...) for the images, through its processor."""
        return self.family.hf_inputs(self, decode_images(images))

    def placeholder(self, image: ImagePart) -> str:
        """The prompt text of one image part."""
        return self.family.layout(self, image)

    def image_tokens(self, image: ImagePart) -> int:
        """How many placeholder tokens (vision features) the image fills."""
        return self.placeholder(image).count(self.image_token)


def image_inputs(tokenizer: Any) -> ImageInputs | None:
    """The image inputs a VLM's tokenizer carries, or None for a text-only model."""
    return getattr(tokenizer, _IMAGE_INPUTS_ATTR, None)


def attach_image_inputs(tokenizer: Any, inputs: ImageInputs) -> Any:
    setattr(tokenizer, _IMAGE_INPUTS_ATTR, inputs)
    return tokenizer


def is_vision_config(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


def is_vision_spec(spec: str) -> bool:
    """`tiny:llava`, or a local HF folder whose config has a vision_config."""
    if spec.startswith("tiny:"):
        return spec.split(":", 1)[1] in _FAMILY_MODULES
    cfg = Path(spec).expanduser() / "config.json"
    if not cfg.is_file():
        return False
    try:
        return "vision_config" in json.loads(cfg.read_text())
    except (OSError, json.JSONDecodeError):
        return False


# ---- rendering -----------------------------------------------------------------------------------


def with_placeholders(tokenizer: Any, messages: list[Message | dict]) -> list[Message | dict]:
    """The messages with each image part replaced by the model's placeholder text (a VLM's tokenizer),
    or unchanged (a text-only one: the chat rendering reads descriptions)."""
    vis = image_inputs(tokenizer)
    if vis is None:
        return list(messages)
    out: list[Message | dict] = []
    for m in messages:
        if isinstance(m, Message) and not isinstance(m.content, str):
            text = "\n".join(p.text if isinstance(p, TextPart) else vis.placeholder(p) for p in m.content)
            out.append(replace(m, content=text))
        else:
            out.append(m)
    return out


def encode_with_images(
    tokenizer: Any,
    messages: list[Message | dict],
    tools: list[ToolSpec] | None = None,
    add_generation_prompt: bool = True,
) -> tuple[list[int], list[ImagePart]]:
    """Prompt ids and the images behind their placeholders, in order. A VLM's tokenizer renders each image
    part as its run of placeholder tokens; a text-only one reads descriptions (`encode_messages`) and
    gets no images."""
    from posttrain.models.chat import encode_messages

    ids = encode_messages(tokenizer, with_placeholders(tokenizer, messages), tools, add_generation_prompt)
    if image_inputs(tokenizer) is None:
        return ids, []
    return ids, [img for m in messages if isinstance(m, Message) for img in m.images]


def placeholder_positions(
    token_ids: list[int], loss_mask: list[int] | None, image_token_id: int
) -> list[int]:
    """Positions of image placeholders: the image token where the model did not sample it."""
    return [
        i for i, t in enumerate(token_ids) if t == image_token_id and (loss_mask is None or loss_mask[i] == 0)
    ]


# ---- the image store -----------------------------------------------------------------------------


class ImageStore:
    """Images by content hash (sha256 of the PNG bytes), in memory and, given a directory, as
    `<dir>/<sha256>.png` files (written atomically), so trajectories hold hashes, not bytes."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else None
        self._mem: dict[str, ImagePart] = {}

    def put(self, image: ImagePart) -> str:
        key = image.sha256
        self._mem[key] = image
        if self.directory is not None:
            path = self.directory / f"{key}.png"
            if not path.exists():
                self.directory.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.directory)
                with os.fdopen(fd, "wb") as fh:
                    fh.write(image.png)
                os.replace(tmp, path)
        return key

    def get(self, key: str) -> ImagePart:
        if key in self._mem:
            return self._mem[key]
        path = self.directory / f"{key}.png" if self.directory is not None else None
        if path is None or not path.is_file():
            raise KeyError(
                f"image {key} is not in the store{f' ({self.directory})' if self.directory else ''}"
            )
        png = path.read_bytes()
        if hashlib.sha256(png).hexdigest() != key:
            raise ValueError(f"image file {path} does not hash to its name: the store is corrupt")
        image = ImagePart(png)
        self._mem[key] = image
        return image

    def __contains__(self, key: str) -> bool:
        try:
            self.get(key)
        except KeyError:
            return False
        return True


# ---- loading -------------------------------------------------------------------------------------


def load_vision_tokenizer(spec: str) -> Any:
    """The tokenizer of a vision spec with its image inputs attached (no weights loaded)."""
    if spec.startswith("tiny:"):
        return family(spec.split(":", 1)[1]).tiny_tokenizer()
    from transformers import AutoConfig

    with quiet_transformers():
        config = AutoConfig.from_pretrained(spec)
        processor = _load_processor(spec, config)
    return _folder_tokenizer(spec, config, processor)


def _load_processor(path: Any, config: Any) -> Any:
    try:
        fam = family_of(config)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return fam.load_processor(path)


def _folder_tokenizer(path: Any, config: Any, processor: Any) -> Any:
    try:
        inputs = family_of(config).folder_inputs(config, processor)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    tok = processor.tokenizer
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return attach_image_inputs(tok, inputs)


def load_vision_folder(path: str | Path, dtype: str = "float32") -> tuple[Any, Any]:
    """(model, tokenizer with image inputs) from a local HF VLM folder saved with its processor."""
    import torch
    from transformers import AutoModelForImageTextToText

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    with quiet_transformers():
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch_dtype)
        processor = _load_processor(path, model.config)
    model.eval()
    return model, _folder_tokenizer(path, model.config, processor)


def load_vision(spec: str, dtype: str = "float32", seed: int = 0) -> tuple[Any, Any]:
    """(model, tokenizer) of a vision spec: `tiny:<family>` or a local HF VLM folder."""
    if spec.startswith("tiny:"):
        model, tok = family(spec.split(":", 1)[1]).tiny(seed)
        if dtype != "float32":
            model = model.to({"bfloat16": __import__("torch").bfloat16}[dtype])
        return model, tok
    return load_vision_folder(spec, dtype)


def save_vision_folder(model: Any, tokenizer: Any, out: str | Path) -> Path:
    """Save a VLM with its processor (tokenizer + image processor) as an HF folder, atomically."""
    vis = image_inputs(tokenizer)
    if vis is None:
        raise ValueError("the tokenizer carries no image inputs: not a vision model's tokenizer")
    return save_hf_folder_atomically(model, vis.family.processor(model, tokenizer), Path(out))


def tiny_text_config(tokenizer: Any) -> Any:
    """The language side of a tiny VLM: tiny:llama's config over `tokenizer`'s vocabulary, its weights
    drawn with std 0.2 (far from uniform: greedy paths and logprobs depend on the image)."""
    tok = tokenizer
    text = tiny_config("llama", len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    text.initializer_range = 0.2
    return text


def random_vlm(model_class: Any, config: Any, seed: int) -> Any:
    """`model_class(config)` with its weights drawn from `seed` (the global RNG left as it was), float32,
    in eval mode."""
    import torch

    with quiet_transformers(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).float()
    return model.eval()


# ---- the LLaVA family ----------------------------------------------------------------------------


def _siglip_processor(image_size: int) -> Any:
    from transformers import SiglipImageProcessorPil

    return SiglipImageProcessorPil(size={"height": image_size, "width": image_size})


def _with_image_token(tokenizer: Any) -> Any:
    if IMAGE_TOKEN not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    return tokenizer


def llava_config(
    text_config: Any,
    image_token_id: int,
    *,
    image_size: int,
    patch_size: int,
    vision_hidden: int,
    vision_layers: int,
    vision_heads: int,
) -> Any:
    """A LLaVA config: a SigLIP-style ViT (no pooling head; every patch a feature) and a 2-layer GELU
    projector onto `text_config`'s hidden size, one placeholder token per patch."""
    from transformers import LlavaConfig, SiglipVisionConfig

    if image_size % patch_size:
        raise ValueError(f"image_size {image_size} is not a multiple of patch_size {patch_size}")
    vision = SiglipVisionConfig(
        hidden_size=vision_hidden,
        intermediate_size=4 * vision_hidden,
        num_hidden_layers=vision_layers,
        num_attention_heads=vision_heads,
        image_size=image_size,
        patch_size=patch_size,
        vision_use_head=False,
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=text_config,
        image_token_id=image_token_id,
        image_seq_length=(image_size // patch_size) ** 2,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        projector_hidden_act="gelu",
        tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)),
    )


def _inputs_for(config: Any, tokenizer: Any, image_processor: Any) -> ImageInputs:
    token_id = int(config.image_token_id)
    token = tokenizer.convert_ids_to_tokens(token_id)
    return ImageInputs(FAMILY, image_processor, token, token_id, int(config.image_seq_length))


def _tiny_llava_parts() -> tuple[Any, Any]:
    """tiny:llava's config and tokenizer (the SmolLM2 tokenizer plus `<image>`, image inputs attached)."""
    tok = _with_image_token(copy.deepcopy(embedded_tokenizer()))
    config = llava_config(
        tiny_text_config(tok),
        tok.convert_tokens_to_ids(IMAGE_TOKEN),
        image_size=32,
        patch_size=8,
        vision_hidden=32,
        vision_layers=2,
        vision_heads=2,
    )
    return config, attach_image_inputs(tok, _inputs_for(config, tok, _siglip_processor(32)))


def tiny_llava(seed: int = 0) -> tuple[Any, Any]:
    """A tiny random LLaVA (SigLIP 32x32 px in 8 px patches -> 16 image tokens; a 2-layer Llama) with the
    SmolLM2 tokenizer plus `<image>`; (model, tokenizer) with the image inputs attached."""
    from transformers import LlavaForConditionalGeneration

    config, tok = _tiny_llava_parts()
    return random_vlm(LlavaForConditionalGeneration, config, seed), tok


class LlavaFamily(VisionFamily):
    """`LlavaForConditionalGeneration`: a vision tower, a projector, one fixed run of `image_seq_length`
    placeholders per image (one per selected vision feature)."""

    name = "llava"
    model_types = ("llava",)
    tower_modules = ("vision_tower",)
    projector_modules = ("multi_modal_projector",)
    text_renames = (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.", ""),
    )

    def folder_inputs(self, config: Any, processor: Any) -> ImageInputs:
        if getattr(config, "image_token_id", None) is None or not getattr(config, "image_seq_length", 0):
            raise ValueError("the LLaVA config has no image_token_id/image_seq_length")
        return _inputs_for(config, processor.tokenizer, processor.image_processor)

    def hf_inputs(self, inputs: ImageInputs, pil: list[Any]) -> dict[str, Any]:
        out = inputs.image_processor(images=pil, return_tensors="pt")
        return {"pixel_values": out["pixel_values"].float()}

    def layout(self, inputs: ImageInputs, image: ImagePart) -> str:
        return inputs.image_token * inputs.run_length

    def features(self, modules: Any, config: Any, pixels: dict[str, Any], tower_grad: bool) -> Any:
        import torch

        tower = modules.vision_tower
        dtype = next(tower.parameters()).dtype
        with torch.set_grad_enabled(torch.is_grad_enabled() and tower_grad):
            out = tower(pixels["pixel_values"].to(dtype), output_hidden_states=True, return_dict=True)
            layer, strategy = config.vision_feature_layer, config.vision_feature_select_strategy
            if isinstance(layer, int):
                feat = out.hidden_states[layer]
                feat = feat[:, 1:] if strategy == "default" else feat
            else:
                pool = [out.hidden_states[i] for i in layer]
                feat = torch.cat([h[:, 1:] for h in pool] if strategy == "default" else pool, dim=-1)
        feats = modules.multi_modal_projector(feat)  # trains when its parameters require grad
        return feats.reshape(-1, feats.shape[-1])

    def tiny(self, seed: int) -> tuple[Any, Any]:
        return tiny_llava(seed)

    def tiny_tokenizer(self) -> Any:
        return _tiny_llava_parts()[1]

    def processor(self, model: Any, tokenizer: Any) -> Any:
        from transformers import LlavaProcessor

        vis = image_inputs(tokenizer)
        assert vis is not None
        return LlavaProcessor(
            image_processor=vis.image_processor,
            tokenizer=tokenizer,
            patch_size=model.config.vision_config.patch_size,
            vision_feature_select_strategy=model.config.vision_feature_select_strategy,
            image_token=vis.image_token,
            chat_template=tokenizer.chat_template,
        )


FAMILY = LlavaFamily()


def random_llava(
    text_config: Any,
    tokenizer: Any,
    seed: int = 0,
    *,
    image_size: int = 96,
    patch_size: int = 16,
    vision_hidden: int = 192,
    vision_layers: int = 4,
    vision_heads: int = 3,
) -> tuple[Any, Any]:
    """A randomly initialised LLaVA over `text_config` (its vocabulary grown to hold `<image>`), and a copy
    of `tokenizer` with `<image>` and the image inputs attached."""
    from transformers import LlavaForConditionalGeneration

    tok = _with_image_token(copy.deepcopy(tokenizer))
    text_config = copy.deepcopy(text_config)
    text_config.vocab_size = max(int(text_config.vocab_size), len(tok))
    config = llava_config(
        text_config,
        tok.convert_tokens_to_ids(IMAGE_TOKEN),
        image_size=image_size,
        patch_size=patch_size,
        vision_hidden=vision_hidden,
        vision_layers=vision_layers,
        vision_heads=vision_heads,
    )
    model = random_vlm(LlavaForConditionalGeneration, config, seed)
    return model, attach_image_inputs(tok, _inputs_for(config, tok, _siglip_processor(image_size)))


def graft_vision(seed: int = 0, **vision: int) -> tuple[Any, Any]:
    """The embedded default (SmolLM2-135M) with a SigLIP-style encoder and a projector, both initialised
    from scratch (no vision weights ship with this project): (LLaVA model, tokenizer with image inputs).
    The language weights are SmolLM2's; the embedding gains one row for `<image>` (never read: image
    features replace it). `vision`: random_llava's encoder sizes."""
    import torch
    from transformers import AutoModelForCausalLM

    with quiet_transformers():
        lm = AutoModelForCausalLM.from_pretrained(ensure_embedded(), dtype=torch.float32)
    model, tok = random_llava(lm.config, embedded_tokenizer(), seed, **vision)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lm.resize_token_embeddings(model.config.text_config.vocab_size, mean_resizing=False)
    loaded = model.model.language_model.load_state_dict(lm.model.state_dict(), strict=True)
    assert not loaded.missing_keys and not loaded.unexpected_keys
    if not model.config.tie_word_embeddings:
        model.lm_head.weight.data.copy_(lm.lm_head.weight.data)
    return model, tok
