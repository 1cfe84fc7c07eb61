"""Vision policies end to end on each tiny VLM family: a multi-turn episode with images in turns 1 and 3
through the paged engine, replayed into the Learner by image hash with logprobs equal to the engine's;
the vision tower frozen by default, LoRA on the language side only."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from posttrain.config import AlgorithmConfig, ModelConfig, TrainerConfig, VisionConfig
from posttrain.engine import PagedEngine, SamplingParams
from posttrain.models.vision import ImageStore, image_inputs
from posttrain.rollout import EpisodeLimits, run_episode
from posttrain.train import Learner, Sample
from posttrain.types import TrajectoryStatus

from .helpers import DrawingDomain, noise_image

LLAVA = ModelConfig(spec="tiny:llava")


def _spec(tok) -> str:
    return f"tiny:{image_inputs(tok).family.name}"


def test_images_in_turns_1_and_3_replay_into_the_learner_with_the_engines_logprobs(vlm):
    model, tok = vlm
    engine = PagedEngine(model, tok, num_blocks=128, max_model_len=1024)
    domain = DrawingDomain(noise_image(1, 30, 30, "a drawing"), noise_image(7, 20, 30, "render: 3 faces"))
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=3, stop_token_ids=[tok.eos_token_id])
    traj = asyncio.run(
        run_episode(engine, tok, domain, domain.task("train", 0, 0), None, params, EpisodeLimits(3, 512, 6))
    )
    assert traj.status == TrajectoryStatus.OK and traj.turns == 3 and traj.reward == 0.5
    assert [img.description for img in traj.images] == ["a drawing", "render: 3 faces"]
    vis = image_inputs(tok)
    placeholders = [
        i
        for i, (t, m) in enumerate(zip(traj.token_ids, traj.loss_mask, strict=True))
        if t == vis.image_token_id and m == 0
    ]
    assert len(placeholders) == 2 * vis.run_length
    assert placeholders[0] < traj.prompt_len < placeholders[-1]  # the second image is in turn 3's observation

    store = ImageStore()
    sample = Sample(
        traj.token_ids,
        traj.loss_mask,
        traj.behavior_logprobs,
        traj.reward,
        0,
        images=[store.put(i) for i in traj.images],
    )
    learner = Learner(
        ModelConfig(spec=_spec(tok)), TrainerConfig(), AlgorithmConfig(), model=copy.deepcopy(model)
    )
    learner.vision.store = store
    lp = learner.compute_logprobs([sample])[0]
    mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
    got = lp[: len(traj.token_ids)][mask]
    want = torch.tensor(traj.behavior_logprobs)[mask]
    assert got.numel() == sum(traj.loss_mask) > 6
    assert float((got - want).abs().max()) < 1e-4
    # without its images the same tokens score differently: the features really enter
    blind = learner.compute_logprobs(
        [Sample(traj.token_ids, traj.loss_mask, traj.behavior_logprobs, 0.0, 0)]
    )[0]
    assert float((blind[: len(traj.token_ids)][mask] - want).abs().max()) > 1e-2


def _step(learner: Learner, model_tok) -> None:
    _, tok = model_tok
    vis = image_inputs(tok)
    store = learner.vision.store
    img = noise_image(2)
    prompt = [1, 2] + tok.encode(vis.placeholder(img), add_special_tokens=False) + [5]
    # two different responses: the same tokens with rewards 0 and 1 would have opposite advantages and
    # gradients that cancel to rounding noise (exactly 0 on some CPUs)
    samples = [
        Sample(
            prompt + resp,
            [0] * len(prompt) + [1, 1, 1],
            [-1.0] * (len(prompt) + 3),
            r,
            0,
            images=[store.put(img)],
        )
        for resp, r in (([6, 7, 8], 0.0), ([9, 10, 11], 1.0))
    ]
    learner.step(samples)


def test_vision_tower_frozen_by_default_and_lora_only_on_the_language_side(vlm):
    model, tok = vlm
    fam = image_inputs(tok).family
    tower, proj = fam.tower_modules[0], fam.projector_modules[0]
    text = fam.text_renames[0][0]  # the language model's HF prefix, e.g. model.language_model.
    learner = Learner(
        ModelConfig(spec=_spec(tok), lora_rank=4),
        TrainerConfig(lr=1e-2),
        AlgorithmConfig(),
        model=copy.deepcopy(model),
    )
    names = [n for n, p in learner.model.named_parameters() if p.requires_grad]
    assert any(text in n and "lora_A" in n for n in names)
    assert not any(f".{tower}." in n for n in names)
    assert any(f".{proj}." in n for n in names)
    assert all(f".{tower}." in n or f".{proj}." in n or "lora_" in n for n in names)
    tower0 = {k: v.clone() for k, v in model.model.get_submodule(tower).state_dict().items()}
    proj0 = {k: v.clone() for k, v in model.model.get_submodule(proj).state_dict().items()}
    _step(learner, vlm)
    lm = learner.model.get_base_model()
    assert all(torch.equal(v, lm.model.get_submodule(tower).state_dict()[k]) for k, v in tower0.items())
    assert any(not torch.equal(v, lm.model.get_submodule(proj).state_dict()[k]) for k, v in proj0.items())

    full = Learner(
        ModelConfig(spec=_spec(tok), vision=VisionConfig(train_tower=True, train_projector=False)),
        TrainerConfig(lr=1e-2),
        AlgorithmConfig(),
        model=copy.deepcopy(model),
    )
    _step(full, vlm)
    trained = full.model.model
    assert any(not torch.equal(v, trained.get_submodule(tower).state_dict()[k]) for k, v in tower0.items())
    assert all(torch.equal(v, trained.get_submodule(proj).state_dict()[k]) for k, v in proj0.items())


def test_parallel_learners_refuse_vision_policies(llava):
    from posttrain.train.distributed import shard_learner

    model, _ = llava
    with pytest.raises(ValueError, match="context_parallel > 1 does not run vision-language policies"):
        Learner(LLAVA, TrainerConfig(context_parallel=2), AlgorithmConfig(), model=copy.deepcopy(model))
    learner = Learner(LLAVA, TrainerConfig(), AlgorithmConfig(), model=copy.deepcopy(model))
    with pytest.raises(ValueError, match="does not train data-parallel"):
        shard_learner(learner)


@pytest.mark.parametrize("spec", ["tiny:llava", "tiny:idefics3", "tiny:qwen2_vl"])
def test_configs_vision_yaml_trains_with_rl_on_tiny_vlms(tmp_path, spec):
    import json

    from posttrain.config import load_config, save_config
    from posttrain.orchestrator.rl.run import RLRun
    from posttrain.telemetry import RunDir

    cfg = load_config(
        "configs/vision.yaml",
        [
            f"model.spec={spec}",
            "model.lora_rank=4",
            "orchestrator.steps=1",
            "batch.prompts_per_step=2",
            "batch.samples_per_prompt=2",
            "engine.max_new_tokens=4",
            f"telemetry.run_dir={tmp_path}",
        ],
    )
    run_dir = RunDir.create(tmp_path, "vision")
    save_config(cfg, run_dir.config)
    run = RLRun(cfg, run_dir)
    run.train()
    rows = [json.loads(line) for line in run_dir.metrics.read_text().splitlines()]
    step = next(r for r in rows if "train/mismatch_max_abs_log_ratio" in r)
    assert step["train/mismatch_max_abs_log_ratio"] < 1e-4  # fp32: the Learner replays the engine's images
    stored = {p.stem for p in (run_dir.path / "images").glob("*.png")}
    assert 1 <= len(stored) <= 2  # the prompts' images, once each however many samples saw them
    store = ImageStore(run_dir.path / "images")
    assert all(store.get(k).size == (96, 96) for k in stored)  # each file hashes to its name
