"""The Learner: logprob alignment, packed == padded, micro-batching exactness, LoRA vs full, reference,
merged weights, state round trip (bit-identical continuation), KL paths, importance metrics, errors."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from posttrain.config import AlgorithmConfig, BatchConfig, ModelConfig, TrainerConfig
from posttrain.models import load_policy, merged_state_dict
from posttrain.train import Batch, Learner, Sample, build_batch, lr_factor
from posttrain.train.batch import make_inputs, plan_micro_batches

TINY = ModelConfig(spec="tiny:llama")


def make_samples(n: int = 8, seed: int = 0, vocab: int = 1000, group: int = 4) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(5, 14)
        prompt = rng.randint(2, 4)
        ids = [rng.randrange(vocab) for _ in range(length)]
        mask = [0] * prompt + [1] * (length - prompt)
        if length > 8:
            mask[prompt + 2] = 0  # an observation token in the middle (multi-turn)
        blp = [-rng.uniform(5, 12) if m else 0.0 for m in mask]
        out.append(
            Sample(ids, mask, blp, reward=float(rng.random() < 0.5), group_id=i // group, policy_version=0)
        )
    return out


def learner(
    trainer: TrainerConfig | None = None,
    algo: AlgorithmConfig | None = None,
    model_cfg=TINY,
    model=None,
    batch=None,
):
    return Learner(
        model_cfg,
        trainer or TrainerConfig(lr=1e-3),
        algo or AlgorithmConfig(),
        seed=0,
        model=model,
        batch_cfg=batch,
    )


@pytest.fixture(scope="module")
def base_model():
    return load_policy("tiny:llama")


def test_lora_wrapping_raises_no_library_deprecation_warning(base_model):
    import warnings

    from posttrain.models.lora import wrap_lora

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = wrap_lora(
            copy.deepcopy(base_model), rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj"]
        )
        warnings.warn(
            "`is_gradient_checkpointing` is deprecated (outside wrap_lora)", FutureWarning, stacklevel=1
        )
    assert [str(w.message) for w in caught] == [
        "`is_gradient_checkpointing` is deprecated (outside wrap_lora)"
    ]
    assert any("lora_A" in name for name, _ in model.named_parameters())


def test_logprobs_align_with_hf_logits_and_temperature(base_model):
    samples = make_samples(4)
    for temperature in (1.0, 2.0):
        lrn = learner(algo=AlgorithmConfig(temperature=temperature), model=copy.deepcopy(base_model))
        batch = build_batch(samples)
        lp = lrn.compute_logprobs(batch)
        for i, s in enumerate(samples):
            with torch.no_grad():
                logits = base_model(torch.tensor([s.token_ids])).logits[0] / temperature
            ref = torch.log_softmax(logits, -1)
            for t, m in enumerate(s.loss_mask):
                expected = ref[t - 1, s.token_ids[t]].item() if m else 0.0
                assert lp[i, t].item() == pytest.approx(expected, abs=1e-4)


def test_packed_equals_padded_and_packs_fewer_cells(base_model):
    samples = make_samples(8)
    batch = build_batch(samples)
    packed = learner(TrainerConfig(packing=True), model=copy.deepcopy(base_model)).compute_logprobs(batch)
    padded = learner(TrainerConfig(packing=False), model=copy.deepcopy(base_model)).compute_logprobs(batch)
    assert torch.allclose(packed, padded, atol=1e-5)
    lengths = torch.tensor([14, 4, 5, 9, 10])
    ids = torch.arange(70).reshape(5, 14)
    pi, di = make_inputs(ids, lengths, True), make_inputs(ids, lengths, False)
    assert pi.tokens == di.tokens == 42
    assert (pi.cells, di.cells) == (3 * 14, 5 * 14)  # rows: [14], [10, 4], [9, 5]
    assert pi.position_ids[1].tolist() == list(range(10)) + list(range(4))


def test_chunked_logprobs_equal_unchunked(base_model):
    batch = build_batch(make_samples(6))
    a = learner(TrainerConfig(logprob_chunk_tokens=3), model=copy.deepcopy(base_model)).compute_logprobs(
        batch
    )
    b = learner(TrainerConfig(logprob_chunk_tokens=4096), model=copy.deepcopy(base_model)).compute_logprobs(
        batch
    )
    assert torch.allclose(a, b, atol=1e-6)


def test_micro_batch_plan_respects_token_budget():
    lengths = [10, 3, 7, 12, 5, 5]
    for packed in (True, False):
        plan = plan_micro_batches(lengths, 15, packed)
        assert sorted(i for mb in plan for i in mb) == list(range(6))
        for mb in plan:
            cost = sum(lengths[i] for i in mb) if packed else len(mb) * max(lengths[i] for i in mb)
            assert cost <= 15 or len(mb) == 1
    assert plan_micro_batches([20], 5, True) == [[0]]


def test_gradient_accumulation_over_micro_batches_matches_one_batch(base_model):
    """Loss weights are computed per mini-batch, so the split into micro-batches does not change the update."""
    samples = make_samples(8)
    algo = AlgorithmConfig(loss_agg="seq_mean_token_mean")
    outs = []
    for budget in (16, 4096):
        lrn = learner(
            TrainerConfig(lr=1e-2),
            algo,
            model=copy.deepcopy(base_model),
            batch=BatchConfig(micro_batch_tokens=budget),
        )
        m = lrn.step(samples)
        outs.append((m, {n: p.grad.clone() for n, p in lrn.model.named_parameters()}))
    (m1, g1), (m2, g2) = outs
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-4)
    for k in g1:  # (compared on gradients: Adam's first step amplifies float noise in tiny gradients)
        assert (g1[k] - g2[k]).abs().max() <= 1e-4 * g2[k].abs().max() + 1e-10, k


def test_step_changes_weights_and_reports_metrics(base_model):
    lrn = learner(
        TrainerConfig(lr=1e-2),
        model=copy.deepcopy(base_model),
        batch=BatchConfig(mini_batches=2, ppo_epochs=2),
    )
    before = {k: v.clone() for k, v in lrn.weights().items()}
    m = lrn.step(make_samples(8), current_version=3)
    after = lrn.weights()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert (
        lrn.version == 1 and m["version"] == 1.0 and m["optimizer_steps"] == 4.0
    )  # 2 epochs x 2 mini-batches
    for key in (
        "loss",
        "entropy",
        "clipfrac",
        "grad_norm",
        "lr",
        "reward_mean",
        "zero_signal_group_frac",
        "tokens",
    ):
        assert math.isfinite(m[key]), key
    assert m["staleness_mean"] == 3.0 and m["lr"] == pytest.approx(1e-2)
    # behaviour logprobs are far from the learner's: the mismatch shows and TIS caps clip most tokens
    assert m["mismatch_abs_log_ratio"] > 0.5 and m["tis_clip_frac"] > 0.0


def test_lora_and_full_give_the_same_step0_loss_and_lora_reference_is_the_base(base_model):
    samples = make_samples(8)
    full = learner(TrainerConfig(lr=1e-2), model=copy.deepcopy(base_model))
    lora_cfg = ModelConfig(spec="tiny:llama", lora_rank=4, lora_alpha=8)
    lora = learner(
        TrainerConfig(lr=1e-2),
        AlgorithmConfig(kl_coef=0.1),
        model_cfg=lora_cfg,
        model=copy.deepcopy(base_model),
    )
    batch = build_batch(samples)
    assert torch.equal(full.compute_logprobs(batch), lora.compute_logprobs(batch))
    m_full, m_lora = full.step(samples), lora.step(samples)
    assert m_full["loss"] == pytest.approx(m_lora["loss"], abs=1e-6)
    # after a step the LoRA policy moved, its reference (adapters disabled) is still exactly the base model
    base_lp = learner(model=copy.deepcopy(base_model)).compute_logprobs(batch)
    assert torch.equal(lora.compute_ref_logprobs(batch), base_lp)
    assert not torch.allclose(lora.compute_logprobs(batch), base_lp, atol=1e-4)
    # merged weights equal peft's merge_and_unload and reproduce the policy's logprobs in a plain model
    w = lora.weights()
    ref = merged_state_dict(lora.model)
    assert set(w) == set(ref) and all(torch.allclose(w[k], ref[k], atol=1e-6) for k in w)
    plain = copy.deepcopy(base_model)
    plain.load_state_dict(w)
    assert torch.allclose(
        learner(model=plain).compute_logprobs(batch), lora.compute_logprobs(batch), atol=1e-5
    )


def test_full_finetune_keeps_a_reference_copy_only_with_kl(base_model):
    assert learner(model=copy.deepcopy(base_model)).reference is None
    lrn = learner(TrainerConfig(lr=1e-2), AlgorithmConfig(kl_coef=0.05), model=copy.deepcopy(base_model))
    samples = make_samples(8)
    batch = build_batch(samples)
    start = lrn.compute_logprobs(batch)
    m0 = lrn.step(samples)
    m1 = lrn.step(samples)
    assert m0["kl"] == pytest.approx(0.0, abs=1e-7)  # policy == reference before the first update
    assert m1["kl"] > 0 and "kl_loss" in m1
    assert torch.equal(lrn.compute_ref_logprobs(batch), start)


def test_kl_in_reward_and_adaptive_coefficient(base_model):
    algo = AlgorithmConfig(
        kl_coef=0.1, kl_in_reward=True, kl_target=1e-6, kl_horizon=10, advantage="reinforce_pp"
    )
    lrn = learner(TrainerConfig(lr=1e-2), algo, model=copy.deepcopy(base_model))
    samples = make_samples(8)
    lrn.step(samples)
    m = lrn.step(samples)
    assert "kl_loss" not in m  # folded into the reward, not a loss term
    # step 1: kl = 0 (policy == reference), error clipped to -0.2 -> x (1 - 0.2 * 8 / 10);
    # step 2: kl far above the target, error clipped to +0.2 -> x (1 + 0.2 * 8 / 10)
    assert m["kl"] > 1e-3
    assert m["kl_coef"] == pytest.approx(0.1 * 0.84 * 1.16, rel=1e-6)


def _weights_equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("variant", ["full", "lora_critic"])
def test_state_round_trip_continues_bit_identically(tmp_path, variant):
    if variant == "full":
        mcfg, tcfg = TINY, TrainerConfig(lr=1e-2, warmup_steps=2, lr_schedule="cosine", lr_decay_steps=8)
        acfg = AlgorithmConfig(kl_coef=0.05, kl_target=0.01)
    else:
        mcfg = ModelConfig(spec="tiny:llama", lora_rank=4, lora_dropout=0.1)
        tcfg, acfg = TrainerConfig(lr=1e-2, critic="copy"), AlgorithmConfig(advantage="gae")
    bcfg = BatchConfig(mini_batches=2)  # Learner.load takes it from the checkpoint
    s1, s2, s3 = make_samples(8, 1), make_samples(8, 2), make_samples(8, 3)
    a = Learner(mcfg, tcfg, acfg, seed=0, batch_cfg=bcfg)
    a.step(s1)
    a.save(tmp_path / "ckpt")
    mem = a.state_dict()
    a.step(s2)
    a.step(s3)
    b = Learner.load(tmp_path / "ckpt")
    assert b.version == 1
    b.step(s2)
    b.step(s3)
    assert _weights_equal(a.weights(), b.weights())
    if variant != "full":
        assert _weights_equal(a.critic.state_dict(), b.critic.state_dict())
    c = Learner(mcfg, tcfg, acfg, seed=0, batch_cfg=bcfg)
    c.load_state_dict(mem)
    c.step(s2)
    c.step(s3)
    assert _weights_equal(a.weights(), c.weights())
    assert a.kl_ctl.value == b.kl_ctl.value == c.kl_ctl.value


def test_lr_schedule():
    assert [lr_factor(s, 2, "constant", 0) for s in range(3)] == [0.5, 1.0, 1.0]
    assert lr_factor(2, 2, "cosine", 6) == pytest.approx(1.0)
    assert lr_factor(4, 2, "cosine", 6) == pytest.approx(0.5)
    assert lr_factor(6, 2, "linear", 6) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="lr_decay_steps"):
        Learner(TINY, TrainerConfig(lr_schedule="cosine"), AlgorithmConfig(), model=load_policy("tiny:llama"))


def test_bad_input_errors_name_the_problem(base_model):
    lrn = learner(model=copy.deepcopy(base_model))
    with pytest.raises(ValueError, match="first token has no logprob"):
        lrn.step([Sample([1, 2, 3], [1, 1, 1], [0.0, -1.0, -1.0], 1.0, 0)])
    with pytest.raises(ValueError, match="same length"):
        lrn.step([Sample([1, 2, 3], [0, 1], [0.0, -1.0], 1.0, 0)])
    with pytest.raises(ValueError, match="no generated token"):
        lrn.step([Sample([1, 2, 3], [0, 0, 0], [0.0] * 3, 1.0, 0)])
    with pytest.raises(ValueError, match="empty batch"):
        lrn.step([])
    with pytest.raises(ValueError, match="needs batch.old_logprobs"):
        lrn.update(build_batch(make_samples(2)))
    with pytest.raises(ValueError, match="gae needs a value function"):
        Learner(TINY, TrainerConfig(), AlgorithmConfig(advantage="gae"), model=base_model)
    with pytest.raises(
        ValueError, match="unknown policy loss 'ppo'.*registered: gspo, ppo_clip"
    ):  # at config load
        AlgorithmConfig(policy_loss="ppo")
    with pytest.raises(KeyError, match="unknown policy loss"):  # a config built past validation
        Learner(TINY, TrainerConfig(), AlgorithmConfig.model_construct(policy_loss="ppo"), model=base_model)
    with pytest.raises(ValueError, match="needs algorithm.loss_norm_tokens"):
        Learner(TINY, TrainerConfig(), AlgorithmConfig(loss_agg="seq_mean_token_sum_norm"), model=base_model)


def test_offload_optimizer_is_recorded_and_update_reloads(base_model):
    lrn = learner(model=copy.deepcopy(base_model))
    lrn.step(make_samples(4))
    lrn.offload_optimizer()
    assert lrn.optimizer_offloaded
    assert all(v.device.type == "cpu" for st in lrn.optimizer.state.values() for v in st.values())
    lrn.step(make_samples(4))
    assert not lrn.optimizer_offloaded


def test_batch_select_trims_to_longest_row():
    batch = build_batch(make_samples(6))
    sub = batch.select([0, 1])
    assert isinstance(sub, Batch) and sub.token_ids.shape == (2, int(batch.lengths[:2].max()))


def test_gradient_checkpointing_and_bf16_autocast_options(base_model):
    samples = make_samples(6)
    grads = {}
    for name, tcfg in {
        "plain": TrainerConfig(lr=1e-2),
        "ckpt": TrainerConfig(lr=1e-2, gradient_checkpointing=True),
        "bf16": TrainerConfig(lr=1e-2, bf16_autocast=True),
    }.items():
        lrn = learner(tcfg, model=copy.deepcopy(base_model))
        m = lrn.step(samples)
        grads[name] = (m, torch.cat([p.grad.flatten() for p in lrn.model.parameters() if p.grad is not None]))
    (mp, gp), (mc, gc), (mb, gb) = grads["plain"], grads["ckpt"], grads["bf16"]
    assert mc["loss"] == pytest.approx(mp["loss"], abs=1e-6)
    assert (gc - gp).abs().max() <= 1e-4 * gp.abs().max()  # recomputation gives the same gradients
    cos = torch.nn.functional.cosine_similarity(gb, gp, dim=0).item()
    assert cos > 0.95 and mb["entropy"] == pytest.approx(mp["entropy"], rel=1e-2)


def test_separate_critic_from_its_own_spec():
    tcfg = TrainerConfig(lr=1e-2, critic="separate", critic_spec="tiny:qwen2", critic_lr=1e-2)
    lrn = Learner(TINY, tcfg, AlgorithmConfig(advantage="gae"), seed=0)
    assert type(lrn.critic.decoder).__name__ == "Qwen2Model"
    head_before = lrn.critic.head.bias.detach().clone()
    m = lrn.step(make_samples(8))
    assert m["value_loss"] > 0 and m["value_mean"] == 0.0  # zero-initialised head
    assert not torch.equal(lrn.critic.head.bias, head_before)
    with pytest.raises(ValueError, match="critic_spec"):
        Learner(TINY, TrainerConfig(critic="separate"), AlgorithmConfig(advantage="gae"), seed=0)


def test_ratio_masking_and_tis_through_step(base_model):
    samples = make_samples(6)
    lrn = learner(
        TrainerConfig(lr=1e-2),
        AlgorithmConfig(mask_ratio_high=1.5, tis_cap=2.0),
        model=copy.deepcopy(base_model),
    )
    learner_lp = lrn.compute_logprobs(samples)
    # behaviour logprobs 5 nats below the learner's: ratio e^5 > 1.5 on every token -> all masked out
    stale = []
    for i, s in enumerate(samples):
        row = learner_lp[i, : len(s.token_ids)].tolist()
        blp = [(lp - 5.0) if m else 0.0 for lp, m in zip(row, s.loss_mask, strict=True)]
        stale.append(Sample(s.token_ids, s.loss_mask, blp, s.reward, s.group_id, policy_version=0))
    m = lrn.step(stale, current_version=2)
    assert m["ratio_masked_frac"] == 1.0 and m["tis_clip_frac"] == 1.0
    assert m["mismatch_abs_log_ratio"] == pytest.approx(5.0, abs=1e-4)
    assert m["loss"] == 0.0 and m["grad_norm"] == 0.0 and m["staleness_max"] == 2.0


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_single_pass_takes_old_logprobs_from_the_training_forward(base_model, kl_coef):
    """One pass over the batch: the separate no-grad forward is skipped, and the step's gradient, loss,
    TIS weights, mismatch and KL metrics equal those of the two-forward path."""
    samples = make_samples(8)
    algo = AlgorithmConfig(kl_coef=kl_coef, tis_cap=2.0)
    runs = []
    for single in (True, False):
        lrn = learner(
            TrainerConfig(lr=1e-2, single_pass_old_logprobs=single),
            algo,
            model=copy.deepcopy(base_model),
            batch=BatchConfig(micro_batch_tokens=24),
        )
        assert lrn.single_pass() is single
        calls = []
        forward = lrn._policy_forward

        def counting(model, batch, mask, inputs=None, _f=forward, _c=calls):
            _c.append(torch.is_grad_enabled())
            return _f(model, batch, mask, inputs)

        lrn._policy_forward = counting
        m = lrn.step(samples)
        runs.append(
            (m, calls, {n: p.grad.clone() for n, p in lrn.model.named_parameters() if p.grad is not None})
        )
    (m1, c1, g1), (m2, c2, g2) = runs
    n_micro = len(plan_micro_batches([len(s.token_ids) for s in samples], 24, True))
    assert n_micro > 1
    no_grad_per_pass = n_micro * (1 if kl_coef else 0)  # the reference forward, when there is a KL term
    assert c1.count(True) == n_micro and c1.count(False) == no_grad_per_pass
    assert (
        c2.count(True) == n_micro and c2.count(False) == no_grad_per_pass + n_micro
    )  # + the old-logprob forward
    for key in (
        "loss",
        "mismatch_abs_log_ratio",
        "mismatch_kl_k3",
        "tis_clip_frac",
        "entropy",
        *(["kl"] if kl_coef else []),
    ):
        assert m1[key] == pytest.approx(m2[key], abs=1e-5), key
    assert m1["clipfrac"] == 0.0 and m1["approx_kl"] == 0.0
    for k in g1:
        assert (g1[k] - g2[k]).abs().max() <= 1e-4 * g2[k].abs().max() + 1e-10, k


def test_single_pass_is_off_when_anything_needs_old_logprobs_first(base_model):
    cases = [
        (TrainerConfig(), AlgorithmConfig(), BatchConfig(ppo_epochs=2)),
        (TrainerConfig(), AlgorithmConfig(), BatchConfig(mini_batches=2)),
        (TrainerConfig(), AlgorithmConfig(kl_coef=0.1, kl_in_reward=True), None),
        (TrainerConfig(), AlgorithmConfig(mask_ratio_high=2.0), None),
        (TrainerConfig(single_pass_old_logprobs=False), AlgorithmConfig(), None),
    ]
    for tc, algo, bc in cases:
        assert not learner(tc, algo, model=copy.deepcopy(base_model), batch=bc).single_pass(), (tc, algo, bc)
    assert learner(
        TrainerConfig(), AlgorithmConfig(kl_coef=0.1), model=copy.deepcopy(base_model)
    ).single_pass()


def test_prepare_hands_over_the_old_logprobs_or_the_mark_that_the_forward_gives_them(base_model):
    """Single pass: `prepare` leaves no old logprobs to fill in, it says FROM_FORWARD; otherwise it holds
    them. A PreparedBatch whose `old` disagrees with its batch is refused."""
    from posttrain.train.update import FROM_FORWARD, PreparedBatch

    samples = make_samples(8)
    for single in (True, False):
        lrn = learner(
            TrainerConfig(lr=1e-2, single_pass_old_logprobs=single), model=copy.deepcopy(base_model)
        )
        prepared = lrn.prepare(samples)
        if single:
            assert prepared.old is FROM_FORWARD and prepared.old_from_forward
            assert prepared.batch.old_logprobs is None and prepared.batch.is_weights is None
        else:
            assert prepared.old is prepared.batch.old_logprobs and not prepared.old_from_forward
            assert torch.equal(prepared.old, lrn.compute_logprobs(samples))
    with pytest.raises(ValueError, match="PreparedBatch.old must be batch.old_logprobs, or FROM_FORWARD"):
        PreparedBatch(prepared.batch, prepared.advantage, FROM_FORWARD, False)


def group_samples(seed: int = 0, vocab: int = 1000) -> list[Sample]:
    """GRPO-shaped: groups of 4 rows sharing their prompt (lengths differ, one multi-turn row with an
    observation inside its generated span), a group whose rows share only 2 tokens, and a lone row."""
    rng = random.Random(seed)
    out: list[Sample] = []
    for g, prompt_len in enumerate((7, 11)):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        for j in range(4):
            gen = [rng.randrange(vocab) for _ in range(rng.randint(2, 9))]
            mask = [0] * prompt_len + [1] * len(gen)
            if j == 1 and len(gen) > 4:
                mask[prompt_len + 2] = 0  # a tool observation between two turns
            blp = [-rng.uniform(1, 5) if m else 0.0 for m in mask]
            out.append(Sample(prompt + gen, mask, blp, reward=float(j % 2), group_id=g))
    head = [rng.randrange(vocab) for _ in range(2)]
    for j in range(2):  # same first 2 tokens, then different prompts
        ids = head + [rng.randrange(vocab) for _ in range(6)]
        out.append(Sample(ids, [0] * 5 + [1] * 3, [0.0] * 5 + [-2.0] * 3, reward=float(j), group_id=2))
    out.append(Sample([5, 6, 7, 8], [0, 0, 1, 1], [0, 0, -1.0, -1.0], reward=1.0, group_id=3))
    return out


def test_shared_prefix_plan_and_length():
    from posttrain.train.batch import plan_shared_micro_batches, shared_prefix_length

    batch = build_batch(group_samples())
    assert shared_prefix_length(batch.token_ids[:4], batch.loss_mask[:4], batch.lengths[:4]) == 7
    assert shared_prefix_length(batch.token_ids[8:10], batch.loss_mask[8:10], batch.lengths[8:10]) == 2
    assert (
        shared_prefix_length(batch.token_ids[10:], batch.loss_mask[10:], batch.lengths[10:]) == 0
    )  # one row
    plan = plan_shared_micro_batches(
        batch.token_ids, batch.loss_mask, batch.lengths, batch.group_ids, 4096, False, min_prefix=3
    )
    by_prefix: dict[int, list[int]] = {}
    for rows, p in plan:
        assert p == 0 or len(rows) > 1  # a lone row needs no sharing
        by_prefix.setdefault(p, []).extend(rows)
    # groups 0 and 1 share their prompts (7 and 11 tokens; a group may split by completion length,
    # see test_group_split_minimises_positions_computed); group 2 shares only 2 < min_prefix; row 10 is alone
    assert sorted(by_prefix.get(7, []) + [r for r in by_prefix.get(0, []) if r < 4]) == [0, 1, 2, 3]
    assert sorted(by_prefix.get(11, []) + [r for r in by_prefix.get(0, []) if 4 <= r < 8]) == [4, 5, 6, 7]
    assert {8, 9, 10} <= set(by_prefix[0]) and by_prefix.get(7) and by_prefix.get(11)
    # over budget, a group splits into chunks that each still share the prompt: cost = prefix + its suffixes
    lens = batch.lengths.tolist()
    small = plan_shared_micro_batches(
        batch.token_ids, batch.loss_mask, batch.lengths, batch.group_ids, 7 + 2 * 9, False, 3
    )
    for rows, p in small:
        if p:
            assert p + sum(lens[i] - p for i in rows) <= 7 + 2 * 9 or len(rows) == 1
    assert sorted(i for rows, _ in small for i in rows) == list(range(11))


@pytest.mark.parametrize("lora", [False, True])
def test_shared_prefix_forward_equals_the_full_forward(base_model, lora):
    """Logprobs, loss and gradients of a step with the shared-prompt forward equal those without it."""
    samples = group_samples()
    model_cfg = ModelConfig(spec="tiny:llama", lora_rank=4 if lora else 0)
    runs = []
    for share in (True, False):
        lrn = learner(
            TrainerConfig(lr=1e-2, share_prompt_prefix=share),
            model_cfg=model_cfg,
            model=copy.deepcopy(base_model),
            batch=BatchConfig(micro_batch_tokens=40),
        )
        lp = lrn.compute_logprobs(samples)
        m = lrn.step(samples)
        runs.append(
            (lp, m, {n: p.grad.clone() for n, p in lrn.model.named_parameters() if p.grad is not None})
        )
    (lp1, m1, g1), (lp2, m2, g2) = runs
    assert torch.allclose(lp1, lp2, atol=1e-5)
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6) and m1["entropy"] == pytest.approx(
        m2["entropy"], abs=1e-5
    )
    assert m1["shared_prefix_frac"] > 0.2 and m2["shared_prefix_frac"] == 0.0
    assert m1["update_tokens"] == m2["update_tokens"] == sum(len(s.token_ids) for s in samples)
    assert g1.keys() == g2.keys() and g1
    for k in g1:
        assert (g1[k] - g2[k]).abs().max() <= 1e-4 * g2[k].abs().max() + 1e-9, k


def test_group_split_fills_chunks_up_to_the_budget():
    from posttrain.train.batch import _split_group

    # prefix 100, suffixes 300, 20, 20, 20: 100 + 360 positions fit one chunk
    assert _split_group([0, 1, 2, 3], [400, 120, 120, 120], 100, 10_000) == [[0, 1, 2, 3]]
    # budget 200: 100 + 50 + 50 fits, a third suffix does not
    assert _split_group([0, 1, 2, 3], [150] * 4, 100, 200) == [[0, 1], [2, 3]]
    # a row over the budget on its own still gets a chunk
    assert _split_group([0, 1], [5000, 150], 100, 200) == [[0], [1]]


def test_dr_grpo_gradient_does_not_move_with_the_prompt_length(base_model):
    # Dr. GRPO's divisor is a constant (engine.max_new_tokens, resolved when the config loads), so a
    # longer prompt elsewhere in the batch (a wider padded batch) leaves the gradient as it was
    from posttrain.config import load_config

    algo = load_config(
        None, ["algorithm.advantage=dr_grpo", "algorithm.loss_agg=seq_mean_token_sum_norm"]
    ).algorithm
    assert algo.loss_norm_tokens == 64  # engine.max_new_tokens
    a = Sample(
        [5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 1, 1, 1, 1], [-6.0] * 7, reward=1.0, group_id=0, policy_version=0
    )
    b = Sample(
        [5, 6, 7, 12, 13, 14], [0, 0, 0, 1, 1, 1], [-6.0] * 6, reward=0.0, group_id=0, policy_version=0
    )
    norms = []
    for prompt_len in (3, 40):  # a zero-advantage row whose prompt sets the padded width
        c = Sample(
            list(range(20, 20 + prompt_len)) + [1, 2],
            [0] * prompt_len + [1, 1],
            [-6.0] * (prompt_len + 2),
            reward=0.0,
            group_id=1,
            policy_version=0,
        )
        lrn = learner(TrainerConfig(lr=1e-3, max_grad_norm=1e9), algo, model=copy.deepcopy(base_model))
        norms.append(lrn.step([a, b, c])["grad_norm"])
    assert norms[0] > 0
    assert norms[1] == pytest.approx(norms[0], rel=1e-4)


def test_gspo_clips_with_its_own_range_not_ppo_clip_s(base_model, monkeypatch):
    from posttrain.algos import registry

    seen = []
    real = registry.POLICY_LOSSES["gspo"]

    def spy(*args, **kwargs):
        seen.append((kwargs["clip_low"], kwargs["clip_high"]))
        return real(*args, **kwargs)

    monkeypatch.setitem(registry.POLICY_LOSSES, "gspo", spy)
    algo = AlgorithmConfig(policy_loss="gspo", loss_agg="seq_mean_token_mean")
    assert (algo.clip_low, algo.clip_high) == (0.2, 0.28)  # ppo_clip's, left at their defaults
    learner(algo=algo, model=copy.deepcopy(base_model)).step(make_samples(4))
    assert seen and set(seen) == {(3e-4, 4e-4)}


def test_a_checkpoint_saved_before_the_batch_section_loads_its_batch_sizes(tmp_path, base_model):
    """learner.json of old kept mini_batches/ppo_epochs/micro_batch_tokens under trainer and group_size under
    algorithm: Learner.load reads them as the batch section's."""
    import json

    lrn = learner(
        TrainerConfig(lr=1e-2),
        model=copy.deepcopy(base_model),
        batch=BatchConfig(mini_batches=2, ppo_epochs=3, micro_batch_tokens=64),
    )
    lrn.save(tmp_path / "ckpt")
    meta_path = tmp_path / "ckpt" / "learner.json"
    meta = json.loads(meta_path.read_text())
    batch = meta.pop("batch")
    meta["trainer"].update(
        mini_batches=batch["mini_batches"],
        ppo_epochs=batch["ppo_epochs"],
        micro_batch_tokens=batch["micro_batch_tokens"],
    )
    meta["algorithm"]["group_size"] = batch["samples_per_prompt"]
    meta_path.write_text(json.dumps(meta))
    loaded = Learner.load(tmp_path / "ckpt", model=copy.deepcopy(base_model))
    assert loaded.batch_cfg == lrn.batch_cfg and loaded.trainer_cfg == lrn.trainer_cfg


@pytest.mark.parametrize("floor", [20.0, 1.0], ids=["below-floor", "above-floor"])
def test_entropy_floor_moves_the_bonus_weight_and_survives_a_state_round_trip(base_model, floor, tmp_path):
    algo = AlgorithmConfig(entropy_coef=0.05, entropy_floor=floor, entropy_floor_lr=0.01)
    lrn = learner(algo=algo, model=copy.deepcopy(base_model))
    m = lrn.step(make_samples(8))
    # the tiny model's entropy is ~6.9 nats: a floor of 20 pushes the weight up, one of 1 lets it fall to 0
    assert m["entropy_coef"] == pytest.approx(max(0.0, 0.05 + 0.01 * (floor - m["entropy"])))
    assert (m["entropy_coef"] > 0.05) == (floor > m["entropy"])
    twin = learner(algo=algo, model=copy.deepcopy(base_model))
    twin.load_state_dict(lrn.state_dict())
    assert twin.entropy_coef == lrn.entropy_coef
    lrn.save(str(tmp_path / "learner"))
    assert (
        Learner.load(str(tmp_path / "learner"), model=copy.deepcopy(base_model)).entropy_coef
        == lrn.entropy_coef
    )
