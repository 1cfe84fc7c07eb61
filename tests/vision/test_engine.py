"""The paged engine with images, on each tiny VLM family: HF `generate` equality and the logprob contract,
the prefix cache keyed by image content, weight reloads of the vision side, and bad requests."""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.engine import BadRequestError, GenerationRequest, PagedEngine, SamplingParams
from posttrain.models import load_policy, load_tokenizer
from posttrain.models.vision import encode_with_images, image_inputs
from posttrain.types import ImagePart, Message, TextPart

from .helpers import noise_image

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _prompt(tok, *images: ImagePart, text: str = "what is this?"):
    parts = [TextPart(text), *images]
    return encode_with_images(tok, [Message("user", parts)])


@torch.inference_mode()
def _hf(model, tok, ids, images, new: int):
    pixels = image_inputs(tok).hf_inputs(images)
    out = model.generate(input_ids=torch.tensor([ids]), **pixels, max_new_tokens=new, do_sample=False)
    return out[0, len(ids) :].tolist()


@torch.inference_mode()
def _hf_logprobs(model, tok, ids, images, completion):
    pixels = image_inputs(tok).hf_inputs(images)
    logits = model(input_ids=torch.tensor([ids + completion]), **pixels).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[len(ids) - 1 + i, t]) for i, t in enumerate(completion)]


def test_greedy_equals_hf_generate_and_logprobs_match(vlm):
    model, tok = vlm
    engine = PagedEngine(model, tok, num_blocks=128, max_model_len=512)
    cases = [_prompt(tok, noise_image(0)), _prompt(tok, noise_image(1), noise_image(2), text="two")]
    outs = engine.generate([GenerationRequest(ids, GREEDY, images=imgs) for ids, imgs in cases])
    for (ids, imgs), out in zip(cases, outs, strict=True):
        got = out.completions[0]
        assert got.token_ids == _hf(model, tok, ids, imgs, 10)
        ref = _hf_logprobs(model, tok, ids, imgs, got.token_ids)
        assert max(abs(a - b) for a, b in zip(ref, got.logprobs, strict=True)) < 1e-4
    # the image matters: another image behind the same ids gives another completion
    assert (
        outs[0].completions[0].token_ids
        != engine.generate([GenerationRequest(cases[0][0], GREEDY, images=[noise_image(9)])])[0]
        .completions[0]
        .token_ids
    )


def test_prefix_cache_never_shares_blocks_across_different_images(vlm):
    model, tok = vlm
    bs = 16
    a, b = noise_image(0), noise_image(1)
    ids_a, _ = _prompt(tok, a)
    ids_b, _ = _prompt(tok, b)
    assert ids_a == ids_b  # identical placeholder ids
    pos = [i for i, t in enumerate(ids_a) if t == image_inputs(tok).image_token_id]
    text_blocks = pos[0] // bs  # full blocks before the first placeholder
    engine = PagedEngine(model, tok, num_blocks=128, max_model_len=512, block_size=bs)
    first = engine.generate([GenerationRequest(ids_a, GREEDY, images=[a])])[0].completions[0]
    engine.reset_stats()
    with_b = engine.generate([GenerationRequest(ids_b, GREEDY, images=[b])])[0].completions[0]
    assert engine.kv_stats()["prefix_hit_tokens"] == text_blocks * bs  # only the text before the image
    fresh = PagedEngine(model, tok, num_blocks=128, max_model_len=512, block_size=bs)
    assert (
        with_b.token_ids
        == fresh.generate([GenerationRequest(ids_b, GREEDY, images=[b])])[0].completions[0].token_ids
    )
    engine.reset_stats()
    again = engine.generate([GenerationRequest(ids_a, GREEDY, images=[a])])[0].completions[0]
    assert (
        engine.kv_stats()["prefix_hit_tokens"] == (len(ids_a) - 1) // bs * bs
    )  # the same image: all full blocks
    assert again.token_ids == first.token_ids


def test_load_weights_updates_the_vision_side(vlm):
    model, tok = vlm
    engine = PagedEngine(model, tok, num_blocks=128, max_model_len=512)
    ids, imgs = _prompt(tok, noise_image(3))
    before = engine.generate([GenerationRequest(ids, GREEDY, images=imgs)])[0].completions[0].token_ids
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.model.get_submodule(image_inputs(tok).family.projector_modules[0]).parameters():
            p.mul_(-3.0)
    engine.load_weights(other.state_dict())
    got = engine.generate([GenerationRequest(ids, GREEDY, images=imgs)])[0].completions[0].token_ids
    assert got == _hf(other, tok, ids, imgs, 10) and got != before


def test_bad_image_requests_are_refused(vlm):
    model, tok = vlm
    engine = PagedEngine(model, tok, num_blocks=128, max_model_len=512)
    ids, imgs = _prompt(tok, noise_image(0))
    with pytest.raises(BadRequestError, match="holds 16 image placeholder tokens; 2 image"):
        engine.generate([GenerationRequest(ids, GREEDY, images=imgs * 2)])
    with pytest.raises(BadRequestError, match="holds 16 image placeholder tokens; 0 image"):
        engine.generate([GenerationRequest(ids, GREEDY)])
    broken = ImagePart(noise_image(0).png[:40] + b"\x00" * 30)
    with pytest.raises(BadRequestError, match="image 0 does not decode"):
        engine.generate([GenerationRequest(ids, GREEDY, images=[broken])])
    text_engine = PagedEngine(load_policy("tiny:llama"), load_tokenizer("tiny:llama"), num_blocks=64)
    with pytest.raises(BadRequestError, match="serves a text-only model"):
        text_engine.generate([GenerationRequest([1, 2, 3], GREEDY, images=imgs)])
    with pytest.raises(ValueError, match="needs the tokenizer its loader returns"):
        PagedEngine(model, load_tokenizer("tiny:llama"))
