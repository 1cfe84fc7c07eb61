"""The Learner's steps as term sets: the SFT step reads nothing of the RL `algorithm` section, and the RL
step's loss is the sum of the terms it holds, in order."""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.config import AlgorithmConfig, ModelConfig, TrainerConfig
from posttrain.models import load_policy
from posttrain.train import Learner, Sample
from posttrain.train.terms import EntropyTerm, KlTerm, LossInputs, PolicyLossTerm, add_terms

TINY = ModelConfig(spec="tiny:llama")


def sft_samples() -> list[Sample]:
    return [
        Sample([5 + i, 9, 11 + i, 13, 17, 19 + i], [0, 0, 1, 1, 1, 1], [0.0] * 6, 0.0, i) for i in range(3)
    ]


@pytest.fixture(scope="module")
def base_model():
    return load_policy("tiny:llama")


def test_the_sft_step_needs_no_algorithm_section_and_reads_none_of_it(base_model):
    plain = Learner(TINY, TrainerConfig(lr=1e-2), seed=0, model=copy.deepcopy(base_model))
    rl = AlgorithmConfig(policy_loss="gspo", temperature=0.5, entropy_coef=0.3, loss_agg="seq_mean_token_sum")
    other = Learner(TINY, TrainerConfig(lr=1e-2), rl, seed=0, model=copy.deepcopy(base_model))
    a, b = plain.sft_step(sft_samples()), other.sft_step(sft_samples())
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    assert all(
        torch.equal(p, q) for p, q in zip(plain.model.parameters(), other.model.parameters(), strict=True)
    )


def test_the_rl_terms_are_the_policy_loss_then_entropy_then_kl_and_their_sum_is_the_loss(base_model):
    algo = AlgorithmConfig(entropy_coef=0.25, kl_coef=0.5)
    lrn = Learner(TINY, TrainerConfig(), algo, seed=0, model=copy.deepcopy(base_model))
    assert [type(t) for t in lrn.terms] == [PolicyLossTerm, EntropyTerm, KlTerm]
    lp = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    ent = torch.tensor([[0.0, 2.0, 4.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    x = LossInputs(
        logprobs=lp,
        weights=mask / 2,
        loss_mask=mask,
        entropy=ent,
        mask=mask,
        old_logprobs=lp.detach(),
        ref_logprobs=torch.tensor([[0.0, -1.0, -3.0]]),
        advantages=torch.tensor([[0.0, 1.0, -1.0]]),
    )
    total, results = add_terms(lrn.terms, x)
    # ratio 1: policy loss = mean(-A) = 0; entropy = -0.25 x mean(2, 4) = -0.75;
    # KL k3 of log-ratios (0, 1): (e^-1 - 1 + 1) / 2 = 0.18394, x 0.5
    kl = (torch.exp(torch.tensor(-1.0)) - 1 + 1).item() / 2
    assert total.item() == pytest.approx(0.0 - 0.75 + 0.5 * kl, abs=1e-6)
    assert results[0].sums == {"policy_loss": 0.0}
    assert results[1].means["entropy"] == (3.0, 2.0)
    assert results[2].means["kl_loss"][0] == pytest.approx(kl, abs=1e-6)
