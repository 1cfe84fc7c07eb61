"""Replay of general data and retention in the curriculum: the replay count is exact, the learner's
replay term is replay_coef x the token-mean NLL (its gradient against a plain autograd reference),
a falling retention suite raises its domain's weight and the replay fraction (hand-checked numbers)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from posttrain.config import AlgorithmConfig, CurriculumConfig, ModelConfig, TrainerConfig
from posttrain.curriculum import Arm, make_sampler
from posttrain.orchestrator.rl.drift import GENERAL_PROMPTS
from posttrain.orchestrator.rl.replay import REPLAY_PROMPTS, ReplayPool, replay_count
from posttrain.orchestrator.rl.retention import RetentionSuites
from posttrain.telemetry import read_metrics
from posttrain.train import Learner, Sample

from .test_loop import _cfg, _run


def test_replay_count_is_the_fraction_rounded_half_up():
    assert [replay_count(32, 0.25), replay_count(10, 0.25), replay_count(6, 0.5), replay_count(4, 0.01)] == [
        8,
        3,
        3,
        1,
    ]
    assert replay_count(32, 0.0) == 0 and replay_count(3, 1.0) == 3


def test_the_pool_hands_samples_out_in_turn_from_a_step_cursor():
    pool = ReplayPool(list("abcde"))
    assert pool.pick(2, 0) == ["a", "b"] and pool.pick(2, 1) == ["c", "d"] and pool.pick(2, 2) == ["e", "a"]
    assert pool.pick(3, 1) == ["d", "e", "a"]
    assert not set(REPLAY_PROMPTS) & set(GENERAL_PROMPTS) and len(set(REPLAY_PROMPTS)) == 32
    with pytest.raises(ValueError, match="replay pool's reference completions are all empty"):
        ReplayPool([])


def _sample(ids: list[int], n_prompt: int, reward: float, group: int) -> Sample:
    n = len(ids)
    return Sample(ids, [0] * n_prompt + [1] * (n - n_prompt), [0.0] * n, reward=reward, group_id=group)


def _nll_by_hand(model, samples: list[Sample]) -> torch.Tensor:
    """Token-mean NLL of the samples' loss-masked tokens from plain full forwards (temperature 1)."""
    total, count = 0.0, 0
    for s in samples:
        ids = torch.tensor([s.token_ids])
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)[0]
        mask = torch.tensor(s.loss_mask[1:], dtype=torch.float32)
        tok = logp[:-1].gather(1, ids[0, 1:, None])[:, 0]
        total = total + -(tok * mask).sum()
        count += int(mask.sum())
    return total / count


def test_the_replay_term_is_coef_times_the_token_mean_nll_and_its_gradient():
    algo = AlgorithmConfig(replay_fraction=0.5, replay_coef=0.3)
    learner = Learner(ModelConfig(spec="tiny:llama"), TrainerConfig(max_grad_norm=1e9), algo, seed=0)
    reference = copy.deepcopy(learner.model)
    # one group of equal rewards: zero advantages, so the RL term has no gradient at all
    rl = [_sample([1, 5, 6, 7], 2, 1.0, 0), _sample([1, 5, 8, 9, 4], 2, 1.0, 0)]
    replay = [_sample([1, 2, 3, 10, 11, 12], 3, 0.0, 0), _sample([1, 4, 13, 14], 2, 0.0, 1)]
    metrics = learner.step(rl, replay=replay)
    nll = _nll_by_hand(reference, replay)
    (0.3 * nll).backward()
    assert metrics["replay_nll"] == pytest.approx(float(nll.detach()), rel=1e-5)
    assert metrics["replay_sequences"] == 2.0 and metrics["replay_tokens"] == 5.0  # 3 + 2 completion tokens
    got = dict(learner.model.named_parameters())
    for name, p in reference.named_parameters():
        assert torch.allclose(got[name].grad, p.grad, atol=1e-6), name
    # without replay the same zero-advantage batch leaves no gradient
    plain = Learner(ModelConfig(spec="tiny:llama"), TrainerConfig(max_grad_norm=1e9), algo, seed=0)
    out = plain.step(rl)
    assert "replay_nll" not in out
    assert all(float(p.grad.abs().max()) == 0.0 for p in plain.model.parameters() if p.grad is not None)


def _two_domains(**kw) -> tuple:
    cfg = CurriculumConfig(eps=0.2, eps_end=None, domain_mix=0.0, max_share=1.0, lam=10.0, forget_z=1.0, **kw)
    return make_sampler(cfg, [Arm("math", 0), Arm("code", 0)], seed=0)


def test_a_falling_suite_of_a_trained_domain_raises_that_domains_weight():
    sampler = _two_domains()
    assert sampler.weights() == {Arm("math", 0): 0.5, Arm("code", 0): 0.5}  # no evidence: all scores 0
    # math:3 fell by 0.3 with SE 0.05: forgetting 0.3 - 1 x 0.05 = 0.25 for math's arms
    sampler.record_retention("math:3", -0.3, 0.05)
    assert sampler.retention_forgetting() == {"math:3": pytest.approx(0.25)}
    assert sampler.forgetting().tolist() == pytest.approx([0.25, 0.0])
    # s = [10 x 0.25, 0] -> min-max [1, 0]; softmax([1, 0] / 0.5) = [e^2, 1] / (e^2 + 1); 0.8 x q + 0.1
    q = math.exp(2) / (math.exp(2) + 1)
    w = sampler.weights()
    assert w[Arm("math", 0)] == pytest.approx(0.8 * q + 0.1) and w[Arm("math", 0)] == pytest.approx(
        0.80464, abs=1e-5
    )
    assert sampler.signals()["curriculum/retention_F/math:3"] == pytest.approx(0.25)
    # a drop within its noise is no forgetting; a suite that holds undoes the pull
    sampler.record_retention("math:3", -0.04, 0.05)
    assert sampler.weights()[Arm("math", 0)] == 0.5
    restored = _two_domains()
    sampler.record_retention("math:3", -0.3, 0.05)
    restored.load_state_dict(sampler.state_dict())
    assert restored.weights() == sampler.weights()
    old = sampler.state_dict()
    del old["stats"]["retention"]  # a checkpoint from before retention fed the sampler
    restored.load_state_dict(old)
    assert restored.retention_forgetting() == {}


def test_a_falling_suite_raises_the_replay_fraction_and_bad_records_are_refused():
    sampler = _two_domains()
    assert sampler.replay_fraction(0.05, 0.5) == 0.05
    sampler.record_retention("rg.word:0", -0.2, 0.05)  # a domain the run does not train
    assert sampler.weights()[Arm("math", 0)] == 0.5  # no arm protects it
    assert sampler.replay_fraction(0.05, 0.5) == pytest.approx(0.05 + 0.5 * 0.15)
    sampler.record_retention("rg.word:0", -0.9, 0.0)
    assert sampler.replay_fraction(0.5, 1.0) == 1.0  # capped
    with pytest.raises(ValueError, match="math:0 is an arm of this curriculum"):
        sampler.record_retention("math:0", -0.1, 0.01)
    with pytest.raises(ValueError, match="must be finite with se >= 0"):
        sampler.record_retention("math:2", float("nan"), 0.01)
    with pytest.raises(ValueError, match="not of the form 'domain:difficulty'"):
        sampler.record_retention("math", -0.1, 0.01)


RETAIN = ["curriculum.retention=[{name: math, difficulties: [1]}]", "curriculum.retention_size=3"]


def test_a_falling_suite_in_a_run_feeds_the_curriculum_and_raises_the_replay(tmp_path, monkeypatch):
    # base, then steps 1, 2: the suite math:1 goes from 3/3 to 0/3 after step 1
    planted = iter([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    monkeypatch.setattr(RetentionSuites, "score", lambda self, *a: ({"math:1": next(planted)}, 0.0))
    cfg = _cfg(
        tmp_path,
        "orchestrator.steps=2",
        "curriculum.retention_every=1",
        "curriculum.retention_replay_gain=0.5",
        "algorithm.replay_fraction=0.1",
        *RETAIN,
    )
    run = _run(cfg, "fall")
    rows = read_metrics(run.run_dir.metrics)
    # every task fell by 1: delta -1, SE 0 (no spread), forgetting 1 for math:1, hence for the arm math:0
    assert rows[0]["retention_delta/math:1"] == -1.0 and rows[0]["retention_delta/math:1_se"] == 0.0
    assert rows[0]["curriculum/retention_F/math:1"] == 1.0 and rows[0]["curriculum/F/math:0"] == 1.0
    assert len(run.replay.samples) == 32 and all(r["train/replay_nll"] > 0 for r in rows)
    # step 1 trained before the suite was scored: 0.1 x 6 RL sequences (3 prompts x 2) = 0.6, so 1
    assert rows[0]["train/replay_fraction"] == 0.1 and rows[0]["train/sequences"] == 6
    assert rows[0]["train/replay_sequences"] == 1
    assert rows[1]["train/replay_fraction"] == pytest.approx(0.6)  # 0.1 + 0.5 x 1
    assert rows[1]["train/sequences"] == 6 and rows[1]["train/replay_sequences"] == 4
    run.close()
    # posttrain eval of the run directory carries the last retention figures into eval.json
    from typer.testing import CliRunner

    from posttrain.cli import app

    args = ["eval", str(run.run_dir.path), "--suite", "math", "--n", "1", "--set", "engine.max_new_tokens=4"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    saved = json.loads((run.run_dir.path / "eval.json").read_text())
    assert saved["retention"] == {
        "step": 2,
        "suites": {"math:1": {"accuracy": 0.0, "delta": -1.0, "ci_low": -1.0, "ci_high": -1.0}},
    }
    assert "drift" not in saved  # the run had no drift probe
    with pytest.raises(ValueError, match="retention_replay_gain is set but curriculum.retention is empty"):
        from posttrain.orchestrator.rl import RLRun

        RLRun.check(_cfg(tmp_path, "curriculum.retention_replay_gain=0.5"))


def _kl_by_hand(policy, reference, samples: list[Sample]) -> torch.Tensor:
    """Token-mean over the samples' loss-masked tokens of KL(reference || policy) over the whole
    vocabulary at the position predicting each token, from plain full forwards (temperature 1);
    `policy` and `reference` map input ids to logits."""
    total, count = 0.0, 0
    for s in samples:
        ids = torch.tensor([s.token_ids])
        logp = torch.log_softmax(policy(ids).float(), dim=-1)[0, :-1]
        with torch.no_grad():
            ref = torch.log_softmax(reference(ids).float(), dim=-1)[0, :-1]
        mask = torch.tensor(s.loss_mask[1:], dtype=torch.float32)
        kl = (ref.exp() * (ref - logp)).sum(-1)
        total = total + (kl * mask).sum()
        count += int(mask.sum())
    return total / count


def _logits(model):
    return lambda ids: model(input_ids=ids).logits


def _base_logits(peft_model):
    def run(ids: torch.Tensor) -> torch.Tensor:
        with peft_model.disable_adapter():
            return peft_model(input_ids=ids).logits

    return run


RL = [_sample([1, 5, 6, 7], 2, 1.0, 0), _sample([1, 5, 8, 9, 4], 2, 1.0, 0)]  # equal rewards: no RL gradient
REPLAY = [_sample([1, 2, 3, 10, 11, 12], 3, 0.0, 0), _sample([1, 4, 13, 14], 2, 0.0, 1)]


def test_the_kl_replay_term_is_the_full_vocabulary_kl_from_the_initial_policy_and_its_gradient():
    algo = AlgorithmConfig(replay_fraction=0.5, replay_coef=0.3, replay_loss="kl")
    trainer = TrainerConfig(max_grad_norm=1e9, logprob_chunk_tokens=2)  # 5 positions in 3 chunks
    learner = Learner(ModelConfig(spec="tiny:llama"), trainer, algo, seed=0)
    assert learner.reference is not None  # kept for the KL although algorithm.kl_coef is 0
    # at the initial policy the KL and its gradient are 0 (the NLL's gradient would not be)
    at_start = learner.step(RL, replay=REPLAY)
    assert at_start["replay_kl"] == pytest.approx(0.0, abs=1e-6) and "replay_nll" not in at_start
    assert all(float(p.grad.abs().max()) < 1e-6 for p in learner.model.parameters() if p.grad is not None)
    # move the policy away from the reference, then compare with plain autograd over full logits
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in learner.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    policy = copy.deepcopy(learner.model)
    metrics = learner.step(RL, replay=REPLAY)
    kl = _kl_by_hand(_logits(policy), _logits(learner.reference), REPLAY)
    (0.3 * kl).backward()
    assert float(kl.detach()) > 1e-3
    assert metrics["replay_kl"] == pytest.approx(float(kl.detach()), rel=1e-5)
    assert metrics["replay_sequences"] == 2.0 and metrics["replay_tokens"] == 5.0
    got = dict(learner.model.named_parameters())
    for name, p in policy.named_parameters():
        assert torch.allclose(got[name].grad, p.grad, atol=1e-6), name


def test_the_kl_replay_term_under_lora_reads_the_base_model_and_refuses_an_adapted_head():
    algo = AlgorithmConfig(replay_fraction=0.5, replay_coef=1.0, replay_loss="kl")
    model_cfg = ModelConfig(spec="tiny:llama", lora_rank=4)
    learner = Learner(model_cfg, TrainerConfig(max_grad_norm=1e9), algo, seed=0)
    assert learner.reference is None  # LoRA's reference is the base: adapters off
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # LoRA B starts at 0 (policy = base): give the adapters a value
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    with torch.no_grad():
        kl = _kl_by_hand(_logits(learner.model), _base_logits(learner.model), REPLAY)
    metrics = learner.step(RL, replay=REPLAY)
    assert float(kl) > 1e-3 and metrics["replay_kl"] == pytest.approx(float(kl), rel=1e-5)
    head = ModelConfig(spec="tiny:llama", lora_rank=4, lora_target_modules=["q_proj", "lm_head"])
    adapted = Learner(head, TrainerConfig(), algo, seed=0)
    with pytest.raises(ValueError, match="replay_loss=kl under LoRA needs a frozen output layer"):
        adapted.step(RL, replay=REPLAY)


def test_replay_settings_a_learner_cannot_run_are_config_errors():
    from posttrain.config import ConfigError, load_config

    kl = ["algorithm.replay_fraction=0.1", "algorithm.replay_loss=kl"]
    with pytest.raises(ConfigError, match="replay_loss=kl needs whole rows.*context_parallel=2"):
        load_config(None, [*kl, "trainer.context_parallel=2"])
    with pytest.raises(ConfigError, match="replay_loss=kl needs whole rows.*tensor_parallel=2"):
        load_config(None, [*kl, "trainer.tensor_parallel=2"])
    with pytest.raises(ConfigError, match="retention_replay_gain\\) with trainer.data_parallel=2"):
        load_config(None, ["curriculum.retention_replay_gain=0.5", "trainer.data_parallel=2"])
    with pytest.raises(ConfigError, match="algorithm.replay_loss"):
        load_config(None, ["algorithm.replay_loss=distill"])
    assert load_config(None, [*kl, "trainer.context_parallel=1"]).algorithm.replay_loss == "kl"
    # nll replay runs under context parallelism (the ring computes its logprobs)
    assert load_config(None, ["algorithm.replay_fraction=0.1", "trainer.context_parallel=2"])
