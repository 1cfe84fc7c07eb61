"""Policy-loss configs: a user's term loaded by import path with kwargs trains a step, the registered
losses keep their plain-name form, GSPO's clip range lives in its own config, old flat keys name their
new home."""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.config import (
    AlgorithmConfig,
    ConfigError,
    GspoLossConfig,
    ModelConfig,
    TrainerConfig,
    load_config,
)
from posttrain.models import load_policy
from posttrain.train import Learner, Sample, build_batch
from posttrain.train.terms import PolicyLossTerm, policy_loss_term

TINY = ModelConfig(spec="tiny:llama")
CUSTOM = {"type": "custom", "path": "custom_loss_terms:ScaledLogprob", "kwargs": {"coef": 0.5}}


def samples() -> list[Sample]:
    out = []
    for i in range(4):
        ids = [(7 * i + 3 * t) % 1000 for t in range(9)]
        mask = [0, 0, 0] + [1] * 6
        out.append(Sample(ids, mask, [0.0] * 3 + [-6.0] * 6, reward=float(i % 2), group_id=i // 2))
    return out


@pytest.fixture(scope="module")
def base_model():
    return load_policy("tiny:llama")


def token_mean_logprob(lrn: Learner, batch_samples: list[Sample]) -> float:
    batch = build_batch(batch_samples)
    lp = lrn.compute_logprobs(batch)
    return float((lp * batch.loss_mask).sum() / batch.loss_mask.sum())


def test_custom_loss_loads_by_import_path_with_kwargs_and_trains_one_step(base_model):
    algo = AlgorithmConfig(policy_loss=CUSTOM, tis_cap=None)
    assert algo.policy_loss.kwargs == {"coef": 0.5}
    lrn = Learner(TINY, TrainerConfig(lr=1e-2), algo, seed=0, model=copy.deepcopy(base_model))
    term = lrn.terms[0]
    assert type(term).__name__ == "ScaledLogprob" and term.coef == 0.5
    before = token_mean_logprob(lrn, samples())
    m = lrn.step(samples())
    # the term's loss is 0.5 x the token-mean logprob of the policy before the step (loss_agg token_mean)
    assert m["loss"] == pytest.approx(0.5 * before, rel=1e-5)
    # descending 0.5 x logprob lowers the trained tokens' logprobs
    assert token_mean_logprob(lrn, samples()) < before - 1e-3


def test_custom_loss_kwargs_reach_the_term_a_zero_coef_leaves_the_weights(base_model):
    algo = AlgorithmConfig(policy_loss={**CUSTOM, "kwargs": {"coef": 0.0}}, tis_cap=None)
    lrn = Learner(TINY, TrainerConfig(lr=1e-2), algo, seed=0, model=copy.deepcopy(base_model))
    start = {n: p.detach().clone() for n, p in lrn.model.named_parameters()}
    assert lrn.step(samples())["loss"] == 0.0
    assert all(torch.equal(p, start[n]) for n, p in lrn.model.named_parameters())


def test_custom_loss_path_errors_name_the_key():
    with pytest.raises(ValueError, match="must be 'package.module:Class'"):
        AlgorithmConfig(policy_loss={"type": "custom", "path": "custom_loss_terms.ScaledLogprob"})
    algo = AlgorithmConfig(policy_loss={"type": "custom", "path": "no_such_module_x:Term"})
    with pytest.raises(ValueError, match="algorithm.policy_loss.path 'no_such_module_x:Term': cannot load"):
        policy_loss_term(algo)


def test_a_plain_policy_loss_name_is_that_loss_s_default_config():
    assert AlgorithmConfig(policy_loss="gspo").policy_loss == GspoLossConfig()
    assert AlgorithmConfig(policy_loss="gspo").policy_loss.clip_low == 3e-4
    assert AlgorithmConfig().policy_loss.type == "ppo_clip"
    cfg = load_config(None, ["algorithm.policy_loss={type: gspo, clip_low: 1e-3, clip_high: 2e-3}"])
    assert (cfg.algorithm.policy_loss.clip_low, cfg.algorithm.policy_loss.clip_high) == (1e-3, 2e-3)


def test_gspo_takes_its_clip_range_from_its_own_config_and_the_dual_clip_from_algorithm():
    algo = AlgorithmConfig(
        policy_loss={"type": "gspo", "clip_low": 1e-3, "clip_high": 2e-3}, clip_low=0.3, dual_clip=3.0
    )
    term = policy_loss_term(algo)
    assert isinstance(term, PolicyLossTerm)
    assert term.params == {"clip_low": 1e-3, "clip_high": 2e-3, "dual_clip": 3.0}
    ppo = policy_loss_term(AlgorithmConfig(clip_low=0.1, clip_high=0.3))
    assert ppo.params == {"clip_low": 0.1, "clip_high": 0.3, "dual_clip": None}


@pytest.mark.parametrize("key", ["clip_low", "clip_high"])
def test_gspo_s_old_flat_clip_keys_say_where_they_moved(key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"algorithm.gspo_{key}=1e-3"])
    assert f"unknown key 'algorithm.gspo_{key}'; moved to 'algorithm.policy_loss.{key}'" in str(err.value)
    assert "with algorithm.policy_loss.type=gspo" in str(err.value)
    assert err.value.moved == {f"algorithm.gspo_{key}": f"algorithm.policy_loss.{key}"}


def test_estimators_declare_whether_they_need_values():
    from posttrain.algos import list_advantages, needs_values

    assert [name for name in list_advantages() if needs_values(name)] == ["gae"]
    with pytest.raises(ValueError, match="algorithm.advantage=gae needs a value function"):
        load_config(None, ["algorithm.advantage=gae"])


def test_a_config_saved_before_policy_loss_configs_loads_as_it_ran(tmp_path):
    """An old run's config.yaml dumped gspo_clip_low/high at their defaults: it loads (and resumes) as is."""
    import yaml

    path = tmp_path / "config.yaml"
    path.write_text(
        yaml.safe_dump({"algorithm": {"policy_loss": "gspo", "gspo_clip_low": 3e-4, "gspo_clip_high": 4e-4}})
    )
    assert load_config(path).algorithm.policy_loss == GspoLossConfig()
