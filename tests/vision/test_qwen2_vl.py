"""Qwen2-VL (tiny:qwen2_vl): M-RoPE positions against transformers' get_rope_index and by hand, the
rotary columns, dynamic-resolution layouts, the paged engine against HF `generate` (one image, two of
different sizes, chunked prefill, prompt-lookup and early-exit drafts), the prefix cache, weight
reloads, a saved folder; a multi-turn episode with images in turns 1 and 3 replayed into the Learner
(padded and packed) with the engine's logprobs; the tower frozen by default, the merger trained, LoRA
on the language side; the SFT loss with an image equal to transformers' cross-entropy; Qwen2.5-VL's
windowed tower through engine and Learner."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from posttrain.config import AlgorithmConfig, ModelConfig, TrainerConfig, VisionConfig
from posttrain.engine import BadRequestError, GenerationRequest, PagedEngine, SamplingParams
from posttrain.engine.mrope import mrope_columns, mrope_rows
from posttrain.models import load_tokenizer
from posttrain.models.qwen2_5_vl import tiny_qwen2_5_vl
from posttrain.models.qwen2_vl import (
    FAMILY,
    IMAGE_PAD,
    image_runs,
    mrope_positions,
    tiny_qwen2_vl,
)
from posttrain.models.vision import (
    ImageStore,
    encode_with_images,
    image_inputs,
    load_vision_folder,
    save_vision_folder,
)
from posttrain.rollout import EpisodeLimits, run_episode
from posttrain.train import Learner, Sample
from posttrain.types import ImagePart, Message, TextPart, TrajectoryStatus

from .helpers import DrawingDomain, noise_image

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen2_vl():
    """(model, tokenizer) of tiny:qwen2_vl, seed 0."""
    return tiny_qwen2_vl(0)


def _prompt(tok, *parts):
    return encode_with_images(
        tok, [Message("user", [p if isinstance(p, ImagePart) else TextPart(p) for p in parts])]
    )


def _hf_inputs(tok, ids, images):
    vis = image_inputs(tok)
    t = torch.tensor([ids])
    extra = vis.hf_inputs(images) if images else {}
    return dict(
        input_ids=t,
        attention_mask=torch.ones_like(t),
        mm_token_type_ids=(t == vis.image_token_id).int(),
        **extra,
    )


@torch.inference_mode()
def _hf_generate(model, tok, ids, images, new):
    return model.generate(**_hf_inputs(tok, ids, images), max_new_tokens=new, do_sample=False)[
        0, len(ids) :
    ].tolist()


@torch.inference_mode()
def _hf_logprobs(model, tok, ids, images, completion, **kw):
    logits = model(**_hf_inputs(tok, ids + completion, images), **kw).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[len(ids) - 1 + i, t]) for i, t in enumerate(completion)]


def test_mrope_positions_by_hand():
    # text 0-1, a 1x4x6 grid merged 2x2 (2 rows x 3 columns of tokens) at 2-7, text 8-9
    pos, delta = mrope_positions(10, [(2, (1, 4, 6))], merge=2)
    assert pos.tolist() == [
        [0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
        [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
        [0, 1, 2, 3, 4, 2, 3, 4, 5, 6],
    ]
    assert delta == 6 + 1 - 10
    pos, delta = mrope_positions(3, [], merge=2)
    assert pos.tolist() == [[0, 1, 2]] * 3 and delta == 0


def test_image_runs_refuse_layouts_that_do_not_fit():
    assert image_runs([4, 5, 6, 7, 9, 10, 11, 12], [(1, 4, 4), (1, 4, 4)], 2) == [
        (4, (1, 4, 4)),
        (9, (1, 4, 4)),
    ]
    with pytest.raises(ValueError, match="7 image placeholders for 2 image"):
        image_runs([4, 5, 6, 7, 9, 10, 11], [(1, 4, 4), (1, 4, 4)], 2)
    with pytest.raises(ValueError, match="image 0 are not one contiguous run"):
        image_runs([4, 5, 7, 8], [(1, 4, 4)], 2)


def test_positions_equal_transformers_get_rope_index(qwen2_vl):
    model, tok = qwen2_vl
    vis = image_inputs(tok)
    a, b = noise_image(0), noise_image(1, h=24, w=64)  # 40x48 -> 5x6 tokens; 24x64 -> 3x8
    assert FAMILY.grid(vis, a) == (1, 10, 12) and FAMILY.grid(vis, b) == (1, 6, 16)
    for parts in (["one", a], ["two", a, "then", b, "end"], [b, a, "x"], ["no image"]):
        ids, images = _prompt(tok, *parts)
        placeholders = [i for i, t in enumerate(ids) if t == vis.image_token_id]
        pos, delta = FAMILY.rope_positions(vis, len(ids), placeholders, images)
        hf = _hf_inputs(tok, ids, images)
        if not images:
            assert torch.equal(pos, torch.arange(len(ids)).expand(3, -1)) and delta == 0
            continue
        ref, ref_delta = model.model.get_rope_index(
            hf["input_ids"], hf["mm_token_type_ids"], image_grid_thw=hf["image_grid_thw"]
        )
        assert torch.equal(pos, ref[:, 0]) and delta == int(ref_delta)
        assert delta < 0  # text after an image sits at a smaller position than its index


def test_layout_is_a_run_per_image_between_vision_markers(qwen2_vl):
    _, tok = qwen2_vl
    vis = image_inputs(tok)
    text = vis.placeholder(noise_image(1, h=24, w=64))
    assert text == "<|vision_start|>" + IMAGE_PAD * 24 + "<|vision_end|>"
    assert vis.image_tokens(noise_image(0)) == 30
    assert load_tokenizer("tiny:qwen2_vl").convert_tokens_to_ids(IMAGE_PAD) == vis.image_token_id


def test_mrope_columns_and_rows():
    class Cfg:
        model_type = "qwen2_vl_text"
        rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}

    cols = mrope_columns(Cfg(), 16)
    assert cols.tolist() == [0, 0, 1, 1, 1, 2, 2, 2] * 2
    table = torch.arange(10 * 16).view(10, 16).float()  # row p holds 16p .. 16p + 15
    rows = mrope_rows(table, torch.tensor([[1], [2], [3]]), cols)
    assert rows[0].tolist() == [
        16 * [1, 1, 2, 2, 2, 3, 3, 3, 1, 1, 2, 2, 2, 3, 3, 3][c] + c for c in range(16)
    ]
    Cfg.rope_parameters = {**Cfg.rope_parameters, "mrope_section": [2, 3, 2]}
    with pytest.raises(ValueError, match="covers 7 rotary frequencies; the head dimension 16 has 8"):
        mrope_columns(Cfg(), 16)


def test_greedy_equals_hf_generate_and_logprobs_match(qwen2_vl):
    model, tok = qwen2_vl
    cases = [
        _prompt(tok, "what is this?", noise_image(0)),
        _prompt(tok, "two:", noise_image(1), "and", noise_image(2, h=24, w=64), "compare"),
    ]
    engines = {
        "one chunk": PagedEngine(model, tok, num_blocks=128, max_model_len=512),
        "chunked prefill": PagedEngine(
            model, tok, num_blocks=128, max_model_len=512, max_num_batched_tokens=16
        ),
        "ngram drafts": PagedEngine(model, tok, num_blocks=128, max_model_len=512, speculative="ngram"),
        "early-exit drafts": PagedEngine(
            model, tok, num_blocks=128, max_model_len=512, speculative="early_exit", early_exit_layers=1
        ),
    }
    refs = [_hf_generate(model, tok, ids, imgs, 10) for ids, imgs in cases]
    for name, engine in engines.items():
        outs = engine.generate([GenerationRequest(ids, GREEDY, images=imgs) for ids, imgs in cases])
        for (ids, imgs), out, ref in zip(cases, outs, refs, strict=True):
            got = out.completions[0]
            assert got.token_ids == ref, name
            want = _hf_logprobs(model, tok, ids, imgs, got.token_ids)
            assert max(abs(a - b) for a, b in zip(want, got.logprobs, strict=True)) < 1e-4, name
    # M-RoPE matters: the same forward with 1-D positions (the token index) gives other logprobs
    ids, imgs = cases[1]
    got = outs[1].completions[0]
    flat = torch.arange(len(ids) + len(got.token_ids))[None]
    index_lp = _hf_logprobs(model, tok, ids, imgs, got.token_ids, position_ids=flat)
    assert max(abs(a - b) for a, b in zip(index_lp, got.logprobs, strict=True)) > 1e-2


def test_qwen2_5_vl_windowed_tower_through_engine_and_learner():
    model, tok = tiny_qwen2_5_vl(0)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert (
        image_inputs(tok).family.name == "qwen2_5_vl"
        and image_inputs(load_tokenizer("tiny:qwen2_5_vl")).family.name == "qwen2_5_vl"
    )
    cases = [_prompt(tok, "two:", noise_image(0, h=64, w=40), "and", noise_image(2, h=24, w=64))]
    engine = PagedEngine(model, tok, num_blocks=128, max_model_len=512, max_num_batched_tokens=32)
    outs = engine.generate([GenerationRequest(ids, GREEDY, images=imgs) for ids, imgs in cases])
    store = ImageStore()
    learner = Learner(
        ModelConfig(spec="tiny:qwen2_5_vl"), TrainerConfig(), AlgorithmConfig(), model=copy.deepcopy(model)
    )
    learner.vision.store = store
    for (ids, imgs), out in zip(cases, outs, strict=True):
        got = out.completions[0]
        assert got.token_ids == _hf_generate(model, tok, ids, imgs, 10)
        want = torch.tensor(_hf_logprobs(model, tok, ids, imgs, got.token_ids))
        assert float((torch.tensor(got.logprobs) - want).abs().max()) < 1e-4
        n = len(ids) + len(got.token_ids)
        sample = Sample(
            ids + got.token_ids,
            [0] * len(ids) + [1] * len(got.token_ids),
            [0.0] * n,
            0.0,
            0,
            images=[store.put(i) for i in imgs],
        )
        lp = learner.compute_logprobs([sample])[0]
        assert float((lp[len(ids) : n] - want).abs().max()) < 1e-4


def test_prefix_cache_keys_images_and_their_positions(qwen2_vl):
    model, tok = qwen2_vl
    bs = 16
    a, b = noise_image(0), noise_image(3)  # same size: identical placeholder ids
    ids, _ = _prompt(tok, "look", a, "now")
    assert _prompt(tok, "look", b, "now")[0] == ids
    first_pad = ids.index(image_inputs(tok).image_token_id)
    engine = PagedEngine(model, tok, num_blocks=128, max_model_len=512, block_size=bs)
    first = engine.generate([GenerationRequest(ids, GREEDY, images=[a])])[0].completions[0]
    engine.reset_stats()
    with_b = engine.generate([GenerationRequest(ids, GREEDY, images=[b])])[0].completions[0]
    assert engine.kv_stats()["prefix_hit_tokens"] == first_pad // bs * bs  # only the text before the image
    assert with_b.token_ids == _hf_generate(model, tok, ids, [b], 10)
    engine.reset_stats()
    again = engine.generate([GenerationRequest(ids, GREEDY, images=[a])])[0].completions[0]
    assert engine.kv_stats()["prefix_hit_tokens"] == (len(ids) - 1) // bs * bs
    assert again.token_ids == first.token_ids
    # two samples forked after one prefill keep the rope delta: both equal a fresh greedy run
    two = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2)
    forked = engine.generate([GenerationRequest(ids, two, images=[a])])[0].completions
    assert [c.token_ids for c in forked] == [first.token_ids] * 2


def test_bad_image_requests_are_refused(qwen2_vl):
    model, tok = qwen2_vl
    engine = PagedEngine(model, tok, num_blocks=128, max_model_len=512)
    ids, imgs = _prompt(tok, "x", noise_image(0))
    with pytest.raises(BadRequestError, match="holds 30 image placeholder tokens; 1 image"):
        engine.generate([GenerationRequest(ids, GREEDY, images=[noise_image(1, h=24, w=64)])])
    pad = image_inputs(tok).image_token_id
    split = ids[: ids.index(pad) + 3] + [ids[0]] + ids[ids.index(pad) + 3 :]  # a text token inside the run
    with pytest.raises(BadRequestError, match="image 0 are not one contiguous run"):
        engine.generate([GenerationRequest(split, GREEDY, images=imgs)])


def test_saved_folder_loads_and_generates_the_same(qwen2_vl, tmp_path):
    model, tok = qwen2_vl
    save_vision_folder(model, tok, tmp_path / "q")
    loaded, ltok = load_vision_folder(tmp_path / "q")
    assert type(loaded).__name__ == "Qwen2VLForConditionalGeneration"
    ids, imgs = _prompt(tok, "what?", noise_image(4, h=30, w=30))
    assert _prompt(ltok, "what?", noise_image(4, h=30, w=30))[0] == ids
    engine = PagedEngine(loaded, ltok, num_blocks=64, max_model_len=256)
    got = engine.generate([GenerationRequest(ids, GREEDY, images=imgs)])[0].completions[0].token_ids
    assert got == _hf_generate(model, tok, ids, imgs, 10)


def test_episode_with_images_in_turns_1_and_3_replays_into_the_learner(qwen2_vl):
    model, tok = qwen2_vl
    vis = image_inputs(tok)
    engine = PagedEngine(model, tok, num_blocks=128, max_model_len=1024)
    domain = DrawingDomain(noise_image(1, 36, 28, "drawing"), noise_image(7, 20, 44, "render"))
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=3, stop_token_ids=[tok.eos_token_id])
    traj = asyncio.run(
        run_episode(engine, tok, domain, domain.task("train", 0, 0), None, params, EpisodeLimits(3, 512, 6))
    )
    assert traj.status == TrajectoryStatus.OK and traj.turns == 3
    assert [img.description for img in traj.images] == ["drawing", "render"]
    counts = [vis.image_tokens(img) for img in traj.images]
    assert counts == [4 * 4, 2 * 6]  # 36x28 -> 32x32 px -> 4x4 tokens; 20x44 -> 16x48 -> 2x6
    placeholders = [
        i
        for i, (t, m) in enumerate(zip(traj.token_ids, traj.loss_mask, strict=True))
        if t == vis.image_token_id and m == 0
    ]
    assert len(placeholders) == sum(counts) and placeholders[0] < traj.prompt_len < placeholders[-1]

    store = ImageStore()
    sample = Sample(
        traj.token_ids,
        traj.loss_mask,
        traj.behavior_logprobs,
        0.5,
        0,
        images=[store.put(i) for i in traj.images],
    )
    shorts = [_prompt(tok, "short", noise_image(5, 16, 16)), _prompt(tok, noise_image(6, 24, 16), "b")]
    others = [
        Sample(
            ids + [7, 8], [0] * len(ids) + [1, 1], [0.0] * (len(ids) + 2), 0.0, 1, images=[store.put(imgs[0])]
        )
        for ids, imgs in shorts
    ]
    assert len(others[0].token_ids) + len(others[1].token_ids) <= len(
        traj.token_ids
    )  # they pack into one row
    mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
    want = torch.tensor(traj.behavior_logprobs)[mask]
    assert int(mask.sum()) > 6
    for packing in (
        False,
        True,
    ):  # padded rows; the two short samples packed into one row (M-RoPE per segment)
        learner = Learner(
            ModelConfig(spec="tiny:qwen2_vl"),
            TrainerConfig(packing=packing),
            AlgorithmConfig(),
            model=copy.deepcopy(model),
        )
        learner.vision.store = store
        lp = learner.compute_logprobs([sample, *others])
        got = lp[0][: len(traj.token_ids)][mask]
        assert float((got - want).abs().max()) < 1e-4, packing
        for (ids, imgs), row in zip(shorts, lp[1:], strict=True):  # each as transformers scores it alone
            ref = torch.tensor(_hf_logprobs(model, tok, ids, imgs, [7, 8]))
            assert float((row[len(ids) : len(ids) + 2] - ref).abs().max()) < 1e-4, packing
    # without its images (and so with 1-D positions) the same tokens score differently
    blind = learner.compute_logprobs(
        [Sample(traj.token_ids, traj.loss_mask, traj.behavior_logprobs, 0.0, 0)]
    )[0]
    assert float((blind[: len(traj.token_ids)][mask] - want).abs().max()) > 1e-2


def _step(learner: Learner, tok) -> None:
    vis = image_inputs(tok)
    img = noise_image(2)
    prompt = [1, 2] + tok.encode(vis.placeholder(img), add_special_tokens=False) + [5]
    # two different completions: identical ones with opposite advantages cancel to a zero gradient
    seqs = [(prompt + [6, 7, 8], 0.0), (prompt + [9, 10, 11], 1.0)]
    key = learner.vision.store.put(img)
    learner.step(
        [Sample(ids, [0] * len(prompt) + [1, 1, 1], [-1.0] * len(ids), r, 0, images=[key]) for ids, r in seqs]
    )


def test_tower_frozen_merger_trained_lora_on_the_language_side(qwen2_vl):
    model, tok = qwen2_vl
    learner = Learner(
        ModelConfig(spec="tiny:qwen2_vl", lora_rank=4),
        TrainerConfig(lr=1e-2),
        AlgorithmConfig(),
        model=copy.deepcopy(model),
    )
    names = [n for n, p in learner.model.named_parameters() if p.requires_grad]
    assert any("language_model" in n and "lora_A" in n for n in names)
    assert not any("lora_" in n and ".visual." in n for n in names)
    assert {n for n in names if ".visual." in n} == {n for n in names if ".visual.merger." in n} != set()
    blocks0 = {k: v.clone() for k, v in model.model.visual.blocks.state_dict().items()}
    merger0 = {k: v.clone() for k, v in model.model.visual.merger.state_dict().items()}
    _step(learner, tok)
    visual = learner.model.get_base_model().model.visual
    assert all(torch.equal(v, visual.blocks.state_dict()[k]) for k, v in blocks0.items())
    assert any(not torch.equal(v, visual.merger.state_dict()[k]) for k, v in merger0.items())

    full = Learner(
        ModelConfig(spec="tiny:qwen2_vl", vision=VisionConfig(train_tower=True, train_projector=False)),
        TrainerConfig(lr=1e-2),
        AlgorithmConfig(),
        model=copy.deepcopy(model),
    )
    _step(full, tok)
    visual = full.model.model.visual
    assert any(not torch.equal(v, visual.blocks.state_dict()[k]) for k, v in blocks0.items())
    assert all(torch.equal(v, visual.merger.state_dict()[k]) for k, v in merger0.items())


def test_sft_loss_with_an_image_equals_transformers(qwen2_vl):
    from posttrain.train import sft_sample

    model, tok = qwen2_vl
    img = noise_image(6, h=24, w=64)
    messages = [
        Message("user", [TextPart("How many shapes?"), img]),
        Message("assistant", "<answer>3</answer>"),
    ]
    store = ImageStore()
    sample = sft_sample(tok, messages, images=store)
    assert sample.images == [img.sha256] and sample.token_ids.count(image_inputs(tok).image_token_id) == 24
    learner = Learner(
        ModelConfig(spec="tiny:qwen2_vl"), TrainerConfig(), AlgorithmConfig(), model=copy.deepcopy(model)
    )
    learner.vision.store = store
    got = learner.sft_loss([sample])
    with torch.inference_mode():  # transformers computes the M-RoPE positions itself here
        logits = model(**_hf_inputs(tok, sample.token_ids, [img])).logits[0].float()
    ids = torch.tensor(sample.token_ids)
    mask = torch.tensor(sample.loss_mask[1:], dtype=torch.bool)
    nll = torch.nn.functional.cross_entropy(logits[:-1][mask], ids[1:][mask])
    assert got["tokens"] == float(mask.sum()) and got["loss"] == pytest.approx(float(nll), abs=1e-5)


def test_dynamic_ntk_with_mrope_is_refused(qwen2_vl):
    model, tok = qwen2_vl
    other = copy.deepcopy(model)
    rope = other.config.text_config.rope_parameters
    other.config.text_config.rope_parameters = {**rope, "rope_type": "dynamic", "factor": 2.0}
    with pytest.raises(ValueError, match="dynamic NTK RoPE scaling is not supported with M-RoPE"):
        PagedEngine(other, tok, num_blocks=16, max_model_len=256)


def test_load_weights_updates_the_tower_and_the_language_model(qwen2_vl):
    model, tok = qwen2_vl
    engine = PagedEngine(model, tok, num_blocks=128, max_model_len=512)
    ids, imgs = _prompt(tok, "what?", noise_image(3))
    before = engine.generate([GenerationRequest(ids, GREEDY, images=imgs)])[0].completions[0].token_ids
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.model.visual.merger.parameters():
            p.mul_(-3.0)
        other.model.language_model.layers[0].self_attn.q_proj.bias.add_(1.0)
    engine.load_weights(other.state_dict())
    got = engine.generate([GenerationRequest(ids, GREEDY, images=imgs)])[0].completions[0].token_ids
    assert got == _hf_generate(other, tok, ids, imgs, 10) and got != before
