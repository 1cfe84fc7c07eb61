"""The Idefics3 / SmolVLM family: tiny:idefics3, its prompt layout equal to transformers'
Idefics3Processor (unsplit, and split into tiles when the processor's config asks for it), folders saved
and loaded, the paged engine against HF `generate` on the split layout, the weight-name split, and bad
folders."""

from __future__ import annotations

import json
import types

import pytest
import torch

from posttrain.engine import GenerationRequest, PagedEngine, SamplingParams
from posttrain.engine.vision import split_weights
from posttrain.models import load_policy, load_tokenizer, resolve
from posttrain.models.chat import render_messages
from posttrain.models.vision import (
    encode_with_images,
    family_of,
    image_inputs,
    is_vision_spec,
    load_vision_folder,
    save_vision_folder,
)
from posttrain.models.vision_idefics3 import FAMILY
from posttrain.types import Message, TextPart

from .helpers import noise_image

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _split_folder(model, tok, path):
    """tiny:idefics3 saved, with `do_image_splitting` switched on in its processor config."""
    folder = save_vision_folder(model, tok, path)
    cfg_path = folder / "processor_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["image_processor"]["do_image_splitting"] = True
    cfg_path.write_text(json.dumps(cfg))
    return folder


def _hf_processor_ids(folder, tok, text: str, images) -> dict:
    """What transformers' own Idefics3Processor makes of the rendered prompt with one `<image>` per image."""
    from transformers import AutoProcessor

    from posttrain.models.vision import decode_images

    proc = AutoProcessor.from_pretrained(folder)
    content = "\n".join([text, *["<image>"] * len(images)])
    rendered = render_messages(tok, [Message("user", content)], None, add_generation_prompt=True)
    return proc(text=[rendered], images=[decode_images(images)], return_tensors="pt")


def test_tiny_idefics3_spec_loads_with_its_processor_tokens(idefics3):
    assert resolve("tiny:idefics3").kind == "tiny" and is_vision_spec("tiny:idefics3")
    model = load_policy("tiny:idefics3")
    tok = load_tokenizer("tiny:idefics3")
    assert type(model).__name__ == "Idefics3ForConditionalGeneration"
    vis = image_inputs(tok)
    assert vis.family is FAMILY and vis.image_token == "<image>"
    assert vis.image_token_id == model.config.image_token_id == tok.convert_tokens_to_ids("<image>")
    assert vis.run_length == (32 // 4) ** 2 // 2**2 == 16
    for t in ("<fake_token_around_image>", "<global-img>", "<row_6_col_6>", "<end_of_utterance>"):
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    img = noise_image(0)
    assert vis.placeholder(img) == "<fake_token_around_image><global-img>" + "<image>" * 16 + (
        "<fake_token_around_image>"
    )
    assert vis.image_tokens(img) == 16


def test_unsplit_layout_equals_the_hf_processor(idefics3, tmp_path):
    model, tok = idefics3
    folder = save_vision_folder(model, tok, tmp_path / "vlm")
    imgs = [noise_image(0), noise_image(1, 90, 20)]
    ids, images = encode_with_images(tok, [Message("user", [TextPart("two?"), *imgs])])
    ref = _hf_processor_ids(folder, tok, "two?", images)
    assert ids == ref["input_ids"][0].tolist()
    ours = image_inputs(tok).hf_inputs(images)
    assert torch.equal(ours["pixel_values"], ref["pixel_values"])
    assert tuple(ours["pixel_values"].shape) == (1, 2, 3, 32, 32)


def test_split_layout_equals_the_hf_processor_and_the_engine_equals_hf_generate(idefics3, tmp_path):
    model, tok = idefics3
    folder = _split_folder(model, tok, tmp_path / "split")
    model2, tok2 = load_policy(str(folder)), load_tokenizer(str(folder))
    vis = image_inputs(tok2)
    wide, small = noise_image(2, 40, 64), noise_image(3, 20, 20)
    # a 40x64 image resized to 64 px on its longest edge: 2 x 2 tiles of 32 px and the global one
    assert FAMILY.grid(vis, wide) == (2, 2) and vis.image_tokens(wide) == 5 * 16
    lay = vis.placeholder(wide)
    assert lay.startswith("<fake_token_around_image><row_1_col_1>" + "<image>" * 16 + "<fake_token")
    assert "<row_2_col_2>" in lay and "\n\n<fake_token_around_image><global-img>" in lay
    ids, images = encode_with_images(tok2, [Message("user", [TextPart("look"), wide, small])])
    ref = _hf_processor_ids(folder, tok2, "look", images)
    assert ids == ref["input_ids"][0].tolist()
    pixels = vis.hf_inputs(images)
    assert torch.equal(pixels["pixel_values"], ref["pixel_values"])
    assert ids.count(vis.image_token_id) == sum(vis.image_tokens(i) for i in images)

    engine = PagedEngine(model2, tok2, num_blocks=128, max_model_len=1024)
    got = engine.generate([GenerationRequest(ids, GREEDY, images=images)])[0].completions[0]
    with torch.inference_mode():
        want = model2.generate(input_ids=torch.tensor([ids]), **pixels, max_new_tokens=10, do_sample=False)
        logits = model2(input_ids=torch.tensor([ids + got.token_ids]), **pixels).logits[0].float()
    assert got.token_ids == want[0, len(ids) :].tolist()
    lp = torch.log_softmax(logits, -1)
    ref_lp = [float(lp[len(ids) - 1 + i, t]) for i, t in enumerate(got.token_ids)]
    assert max(abs(a - b) for a, b in zip(ref_lp, got.logprobs, strict=True)) < 1e-4


def test_folder_round_trip_gives_the_same_logits(idefics3, tmp_path):
    model, tok = idefics3
    folder = save_vision_folder(model, tok, tmp_path / "vlm")
    model2, tok2 = load_vision_folder(folder)
    assert is_vision_spec(str(folder)) and image_inputs(tok2).family is FAMILY
    msgs = [Message("user", [TextPart("hi"), noise_image(5)])]
    ids, images = encode_with_images(tok, msgs)
    assert encode_with_images(tok2, msgs)[0] == ids
    with torch.inference_mode():
        want = model(input_ids=torch.tensor([ids]), **image_inputs(tok).hf_inputs(images)).logits
        got = model2(input_ids=torch.tensor([ids]), **image_inputs(tok2).hf_inputs(images)).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_weight_names_split_into_the_llama_language_model_and_the_vision_side(idefics3):
    model, _ = idefics3
    state = model.state_dict()
    text, vision = split_weights(state.items(), FAMILY)
    assert {n for n, _ in vision} == {
        n for n in state if n.startswith(("model.vision_model.", "model.connector."))
    }
    names = {n for n, _ in text}
    assert "model.embed_tokens.weight" in names and "model.layers.1.mlp.down_proj.weight" in names
    assert "model.norm.weight" in names and all(n.startswith(("model.", "lm_head.")) for n in names)
    assert not any("text_model" in n for n in names)
    assert FAMILY.text_name("base_model.model.model.text_model.layers.0.self_attn.q_proj.weight") == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    assert FAMILY.text_name("model.connector.modality_projection.proj.weight") is None


def test_bad_folders_and_unknown_families_are_named(idefics3, tmp_path):
    model, tok = idefics3
    folder = save_vision_folder(model, tok, tmp_path / "vlm")
    cfg_path = folder / "processor_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["image_seq_len"] = 64
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"vlm: the processor's image_seq_len 64 is not the model's 16"):
        load_tokenizer(str(folder))
    with pytest.raises(ValueError, match="vision model type 'paligemma' is not supported"):
        family_of(types.SimpleNamespace(model_type="paligemma"))
