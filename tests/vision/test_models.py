"""tiny:llava, the vision chat rendering, the image store, and LLaVA folders saved and loaded."""

from __future__ import annotations

import pytest
import torch

from posttrain.models import load_policy, load_tokenizer, resolve
from posttrain.models.vision import (
    ImageStore,
    encode_with_images,
    image_inputs,
    is_vision_spec,
    load_vision_folder,
    placeholder_positions,
    save_vision_folder,
)
from posttrain.types import ContentError, ImagePart, Message, TextPart

from .helpers import noise_image


def test_tiny_llava_spec_loads_a_llava_with_image_inputs():
    assert resolve("tiny:llava").kind == "tiny"
    assert is_vision_spec("tiny:llava") and not is_vision_spec("tiny:llama")
    model = load_policy("tiny:llava")
    tok = load_tokenizer("tiny:llava")
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    vis = image_inputs(tok)
    assert vis is not None and vis.image_token == "<image>"
    assert vis.image_token_id == len(tok) - 1 == model.config.image_token_id
    assert vis.run_length == (32 // 8) ** 2 == 16
    assert image_inputs(load_tokenizer("tiny:llama")) is None


def test_vision_rendering_puts_one_placeholder_run_per_image_in_order(llava):
    _, tok = llava
    a, b = noise_image(0), noise_image(1)
    msgs = [
        Message("user", [TextPart("first"), a]),
        Message("assistant", "ok"),
        Message("user", [b, TextPart("second")]),
    ]
    ids, images = encode_with_images(tok, msgs)
    vis = image_inputs(tok)
    pos = placeholder_positions(ids, None, vis.image_token_id)
    assert images == [a, b]
    assert len(pos) == 32
    # two contiguous runs of 16
    assert pos[15] - pos[0] == 15 and pos[31] - pos[16] == 15 and pos[16] > pos[15] + 1
    # a text-only tokenizer reads the descriptions and gets no images
    text_ids, none = encode_with_images(load_tokenizer("tiny:llama"), msgs)
    assert none == [] and vis.image_token_id not in text_ids


def test_pixel_values_shape_and_undecodable_png(llava):
    _, tok = llava
    vis = image_inputs(tok)
    pixels = vis.hf_inputs([noise_image(0), noise_image(1, 10, 90)])["pixel_values"]
    assert tuple(pixels.shape) == (2, 3, 32, 32)
    good = noise_image(0).png
    broken = ImagePart(good[:40] + b"\x00" * 30)  # a valid header, garbage after it
    with pytest.raises(ContentError, match="image 0 does not decode"):
        vis.hf_inputs([broken])["pixel_values"]


def test_placeholder_positions_skip_sampled_image_tokens():
    assert placeholder_positions([5, 9, 9, 7, 9], [0, 0, 0, 1, 1], 9) == [1, 2]


def test_image_store_by_content_hash(tmp_path):
    store = ImageStore(tmp_path)
    img = noise_image(3)
    key = store.put(img)
    assert key == img.sha256 and (tmp_path / f"{key}.png").read_bytes() == img.png
    assert ImageStore(tmp_path).get(key).png == img.png  # a fresh store reads the file
    with pytest.raises(KeyError, match="not in the store"):
        ImageStore(tmp_path).get("0" * 64)
    (tmp_path / f"{key}.png").write_bytes(noise_image(4).png)
    with pytest.raises(ValueError, match="does not hash to its name"):
        ImageStore(tmp_path).get(key)


def test_llava_folder_round_trip_gives_the_same_logits(llava, tmp_path):
    model, tok = llava
    folder = save_vision_folder(model, tok, tmp_path / "vlm")
    model2, tok2 = load_vision_folder(folder)
    assert is_vision_spec(str(folder))
    assert (image_inputs(tok2).image_token_id, image_inputs(tok2).run_length) == (49152, 16)
    ids, images = encode_with_images(tok, [Message("user", [TextPart("hi"), noise_image(5)])])
    ids2, _ = encode_with_images(tok2, [Message("user", [TextPart("hi"), noise_image(5)])])
    assert ids == ids2
    with torch.inference_mode():
        want = model(
            input_ids=torch.tensor([ids]), pixel_values=image_inputs(tok).hf_inputs(images)["pixel_values"]
        ).logits
        got = model2(
            input_ids=torch.tensor([ids]), pixel_values=image_inputs(tok2).hf_inputs(images)["pixel_values"]
        ).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
