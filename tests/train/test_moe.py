"""MoE in the Learner (train/moe.py): the engine records each token's expert choices; replaying them
makes the Learner's logprobs equal the engine's where free routing differs (a planted near-tie); the
load-balancing and z-losses against hand-computed values and transformers' own; the frozen router; metrics;
clear errors. Mixtral, Qwen2-MoE and OLMoE routers."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from posttrain.config import AlgorithmConfig, BatchConfig, ModelConfig, TrainerConfig
from posttrain.config import MoeTrainConfig as Moe
from posttrain.engine import GenerationRequest, PagedEngine, SamplingParams
from posttrain.models import load_policy, load_tokenizer
from posttrain.train import Learner, Sample
from posttrain.train.batch import make_inputs
from posttrain.train.moe import load_balancing_loss, routers, z_loss

TINY_MOE = ModelConfig(spec="tiny:mixtral")
DELTA = 1e-6


def _near_tie_pair(family: str = "mixtral"):
    """(learner model, engine model): a tiny MoE whose routers score experts 1 and 2 within 1e-6 of
    each other, in opposite order in the two copies; so wherever that pair straddles the top-2
    boundary the two route differently, while every other weight (and so every probability to ~1e-6)
    is the same."""
    model = load_policy(f"tiny:{family}", seed=3)
    engine_model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for r_l, r_e in zip(routers(model), routers(engine_model), strict=True):
            n = torch.randn(r_l.weight.shape[1], generator=g)
            r_l.weight[2] = r_l.weight[1] + DELTA * n
            r_e.weight[2] = r_l.weight[1] - DELTA * n
    return model, engine_model


def _engine_samples(engine_model, n: int = 4) -> list[Sample]:
    tok = load_tokenizer("tiny:llama")
    engine = PagedEngine(engine_model, tok, block_size=4, num_blocks=128)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 40000, (9,), generator=g).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=14, seed=1, n=n, ignore_eos=True)
    out = engine.generate([GenerationRequest(prompt, params)])[0]
    samples = []
    for c in out.completions:
        assert c.routing is not None
        ids = prompt + c.token_ids
        assert len(c.routing) == len(ids) - 1
        assert all(len(layer) == 2 for pos in c.routing for layer in pos)  # top 2 at each sparse layer
        mask = [0] * len(prompt) + [1] * len(c.token_ids)
        samples.append(Sample(ids, mask, [0.0] * len(prompt) + c.logprobs, 1.0, 0, routing=c.routing))
    return samples


def _learner(model, moe: Moe, **trainer) -> Learner:
    return Learner(
        TINY_MOE,
        TrainerConfig(lr=1e-3, moe=moe, **trainer),
        AlgorithmConfig(),
        seed=0,
        model=model,
        batch_cfg=BatchConfig(micro_batch_tokens=4096),
    )


@pytest.fixture(scope="module")
def near_tie():
    model, engine_model = _near_tie_pair()
    return model, _engine_samples(engine_model)


@pytest.fixture(scope="module")
def olmoe_near_tie():
    """OLMoE (8 experts, top 2, not renormalised, clip_qkv): the tie of experts 1 and 2 straddles the
    top-2 boundary less often than among Mixtral's 4 (12-18% of the pairs, logprobs moved by 0.009)."""
    model, engine_model = _near_tie_pair("olmoe")
    return model, _engine_samples(engine_model)


# the least a free Learner's logprobs move under each planted tie (100x, 50x the 1e-4 replay bound)
FREE_GAP = {"near_tie": 1e-2, "olmoe_near_tie": 5e-3}


def _truncated(s: Sample, n: int) -> Sample:
    assert s.routing is not None
    return Sample(
        s.token_ids[:n],
        s.loss_mask[:n],
        s.behavior_logprobs[:n],
        s.reward,
        s.group_id,
        routing=s.routing[: n - 1],
    )


def _max_gap(learner: Learner, samples: list[Sample]) -> float:
    lp = learner.compute_logprobs(samples)
    gaps = []
    for i, s in enumerate(samples):
        for t, m in enumerate(s.loss_mask):
            if m:
                gaps.append(abs(float(lp[i, t]) - s.behavior_logprobs[t]))
    return max(gaps)


@pytest.mark.parametrize("pair", ["near_tie", "olmoe_near_tie"])
@pytest.mark.parametrize(
    "layout", [dict(share_prompt_prefix=True), dict(share_prompt_prefix=False), dict(packing=True)]
)
def test_replayed_routing_gives_the_engine_logprobs_where_free_routing_differs(pair, layout, request):
    model, samples = request.getfixturevalue(pair)
    if layout.get("packing"):  # rows of 23, 12, 11, 10 tokens: 12 and 11 share a packed row
        samples = [_truncated(s, n) for s, n in zip(samples, (23, 12, 11, 10), strict=True)]
        lens = torch.tensor([len(s.token_ids) for s in samples])
        assert make_inputs(torch.zeros(4, 23, dtype=torch.long), lens, True).input_ids.shape[0] == 3
    free = _learner(copy.deepcopy(model), Moe(), **layout)
    free_gap = _max_gap(free, samples)
    mismatch = free.moe.pop_metrics()["moe/routing_mismatch"]
    assert mismatch > 0.05, mismatch  # the planted tie flips a share of the (token, layer) choices
    assert free_gap > FREE_GAP[pair], free_gap  # ... and free routing moves logprobs far beyond 1e-4
    replay = _learner(copy.deepcopy(model), Moe(routing_replay=True), **layout)
    assert _max_gap(replay, samples) < 1e-4


def test_rollouts_without_routing_are_refused_under_replay_and_free_metrics_still_come(near_tie):
    model, samples = near_tie
    bare = [Sample(s.token_ids, s.loss_mask, s.behavior_logprobs, s.reward, s.group_id) for s in samples]
    replaying = _learner(copy.deepcopy(model), Moe(routing_replay=True))
    with pytest.raises(ValueError, match="routing_replay needs each rollout's expert choices"):
        replaying.step(bare)
    # supervised rows (no rollouts, no routing) route freely under replay: the free logprobs
    free_lp = _learner(copy.deepcopy(model), Moe()).compute_logprobs(bare)
    assert torch.equal(replaying.compute_logprobs(bare), free_lp)
    free = _learner(copy.deepcopy(model), Moe())
    free.compute_logprobs(bare)
    m = free.moe.pop_metrics()
    assert "moe/routing_mismatch" not in m  # nothing to compare with
    assert 0 < m["moe/routing_entropy"] <= math.log(4)
    assert sum(m[f"moe/load/expert{e}"] for e in range(4)) == pytest.approx(1.0)
    assert 1.0 <= m["moe/load/layer0"] <= 4.0


def test_load_balancing_and_z_loss_hand_computed():
    logits = torch.tensor([[0.0, math.log(3.0)], [math.log(3.0), 0.0], [0.0, 0.0]])
    ids = torch.tensor([[1], [0], [0]])  # top-1 assignments: expert 0 twice, expert 1 once
    # P = mean softmax = ((1/4 + 3/4 + 1/2) / 3, (3/4 + 1/4 + 1/2) / 3) = (1/2, 1/2); f = (2/3, 1/3)
    assert float(load_balancing_loss(logits, ids, 2)) == pytest.approx(2 * (2 / 3 * 0.5 + 1 / 3 * 0.5))
    # uniform routing over 4 experts, top 2, each expert chosen equally: exactly 1
    uniform = torch.zeros(4, 4)
    assert float(load_balancing_loss(uniform, torch.tensor([[0, 1], [2, 3], [0, 2], [1, 3]]), 4)) == 1.0
    # all to one expert with all the probability: E
    peaked = torch.tensor([[50.0, 0.0, 0.0, 0.0]] * 3)
    assert float(load_balancing_loss(peaked, torch.tensor([[0]] * 3), 4)) == pytest.approx(4.0)
    # z: logsumexp of (0, log 3) = log 4; of (0, 0) = log 2
    want = (2 * math.log(4) ** 2 + math.log(2) ** 2) / 3
    assert float(z_loss(logits)) == pytest.approx(want)


@pytest.mark.parametrize("pair", ["near_tie", "olmoe_near_tie"])
def test_aux_losses_enter_the_update_and_the_frozen_router_stays(pair, request):
    model, samples = request.getfixturevalue(pair)
    frozen = _learner(copy.deepcopy(model), Moe(freeze_router=True, aux_loss_coef=0.5, z_loss_coef=0.1))
    before = [r.weight.detach().clone() for r in routers(frozen.model)]
    metrics = frozen.step(samples)
    assert all(torch.equal(b, r.weight) for b, r in zip(before, routers(frozen.model), strict=True))
    assert metrics["moe/aux_loss"] >= 1.0 - 1e-6  # the balanced minimum is 1
    assert metrics["moe/z_loss"] > 0
    # the aux terms' gradient reaches an unfrozen router: with only them (advantages are 0: one group
    # of equal rewards), the router moves and the experts' weights do not
    live = _learner(copy.deepcopy(model), Moe(aux_loss_coef=1.0, z_loss_coef=1.0))
    r0 = routers(live.model)[0].weight.detach().clone()
    experts = live.model.model.layers[-1].mlp.experts.down_proj.detach().clone()  # after the last router
    live.step(samples)
    assert not torch.equal(r0, routers(live.model)[0].weight)
    assert torch.equal(experts, live.model.model.layers[-1].mlp.experts.down_proj)


def test_load_balancing_loss_equals_transformers_on_olmoe_router_logits():
    """Per layer, on the router logits of an OLMoE forward: ours x top_k == transformers'
    load_balancing_loss_func (its f_e counts the T x k assignments over T, so sums to k)."""
    from transformers.models.olmoe.modeling_olmoe import load_balancing_loss_func

    model = load_policy("tiny:olmoe", seed=3)
    ids = torch.randint(3, 40000, (1, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        layers = model(ids, output_router_logits=True).router_logits
    assert len(layers) == 2 and layers[0].shape == (21, 8)
    for logits in layers:
        top = torch.topk(torch.softmax(logits, -1), 2, dim=-1).indices
        ours = float(load_balancing_loss(logits, top, 8))
        assert ours > 1.0  # random routing over 21 tokens is not balanced
        assert 2 * ours == pytest.approx(float(load_balancing_loss_func((logits,), 8, 2)), rel=1e-6)


def test_moe_options_on_a_dense_model_or_with_checkpointing_are_refused():
    with pytest.raises(ValueError, match="need a Mixture-of-Experts policy"):
        Learner(
            ModelConfig(spec="tiny:llama"),
            TrainerConfig(moe=Moe(aux_loss_coef=0.01)),
            AlgorithmConfig(),
            model=load_policy("tiny:llama"),
        )
    with pytest.raises(ValueError, match="gradient_checkpointing=false"):
        _learner(load_policy("tiny:mixtral"), Moe(routing_replay=True), gradient_checkpointing=True)


def test_sample_routing_must_cover_every_fed_position():
    s = Sample([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], 1.0, 0, routing=[[[0, 1]]])
    with pytest.raises(ValueError, match="routing must cover the 2 positions"):
        s.validate()


def test_replay_on_qwen2_moe_shared_expert_and_unnormalised_weights():
    """Qwen2-MoE: a dense layer 0, a gated shared expert, top-k weights not renormalised, cast back."""
    model, engine_model = _near_tie_pair("qwen2_moe")
    samples = _engine_samples(engine_model)
    assert all(len(s.routing[0]) == 1 for s in samples)  # one sparse layer
    free = _learner(copy.deepcopy(model), Moe(), share_prompt_prefix=False)
    assert _max_gap(free, samples) > 1e-2 and free.moe.pop_metrics()["moe/routing_mismatch"] > 0.05
    replay = _learner(copy.deepcopy(model), Moe(routing_replay=True), share_prompt_prefix=False)
    assert _max_gap(replay, samples) < 1e-4
