"""The RL step's two phases over a Learner's parts: `prepare_batch` (everything the update reads, computed
together before it: old/reference logprobs, values, token rewards, advantages, importance corrections)
and `run_update` (mini-batches x PPO epochs of token-budgeted micro-batches, summing the loss terms the
Learner holds, with gradient accumulation, clipping and the LR schedule). Single pass is one way of
preparing: in place of the old logprobs `prepare_batch` hands over `FROM_FORWARD`, and the update returns
the training forward's logprobs (`UpdateResult.old_logprobs`); nothing prepared is filled in during the
update. The Learner owns the state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from posttrain.algos import (
    AdvantageOutput,
    aggregation_weights,
    get_advantage,
    kl_estimate,
    masked_mean,
    ratio_mask,
    tis_weights,
)
from posttrain.train.batch import Batch, Sample, build_batch, last_token_index
from posttrain.train.distributed import full_value
from posttrain.train.terms import LossInputs, add_terms


@dataclass(frozen=True)
class FromForward:
    """Where the old logprobs would be: single pass, each micro-batch's old logprobs are its training
    forward's, detached (one optimizer step over the whole batch differentiates the pre-update policy),
    and its truncated importance weights are computed from them there. `FROM_FORWARD` is the one value."""


FROM_FORWARD = FromForward()


@dataclass(frozen=True)
class PreparedBatch:
    """What `prepare_batch` computed for a batch, all of it before the update: `batch` with ref_logprobs
    (when a KL is taken), old_values (with a critic), advantages, returns and the importance corrections
    set, and `old`: the old logprobs (also `batch.old_logprobs`), or `FROM_FORWARD` in single pass (then
    `batch.old_logprobs` is None). Nothing in it is filled in later."""

    batch: Batch
    advantage: AdvantageOutput
    old: Tensor | FromForward
    use_kl: bool
    replay: Batch | None = None
    kl: float | None = None  # the batch's KL from the reference, when known before the update
    prepare_s: float = 0.0

    def __post_init__(self) -> None:
        if self.old is not (FROM_FORWARD if self.batch.old_logprobs is None else self.batch.old_logprobs):
            raise ValueError(
                "PreparedBatch.old must be batch.old_logprobs, or FROM_FORWARD when that is None"
            )

    @property
    def old_from_forward(self) -> bool:
        return isinstance(self.old, FromForward)


@dataclass(frozen=True)
class UpdateResult:
    """What `run_update` gives back: its metrics and the old logprobs `[B, L]` the update used (the
    prepared ones, or in single pass the training forward's, detached)."""

    metrics: dict[str, float]
    old_logprobs: Tensor


def prepare_batch(learner: Any, samples: list[Sample], replay: list[Sample] | None = None) -> PreparedBatch:
    """Everything the update reads, computed together before it: old logprobs (or, in single pass,
    the mark that the training forward gives them), reference logprobs under a KL, the critic's
    values, token rewards (the outcome on the last generated token, minus the KL when folded in),
    advantages and returns, the ratio mask and truncated importance weights."""
    t0 = time.perf_counter()
    a = learner.algo_cfg
    if replay and learner.dp is not None:
        raise ValueError(
            "algorithm.replay_fraction > 0 is not available with a data-parallel learner: the replay "
            "term is computed on one process"
        )
    if replay and learner.replay_term.one_process and (learner.cp is not None or learner.tp is not None):
        raise ValueError(
            f"algorithm.replay_loss={a.replay_loss} is computed on one process's whole vocabulary and "
            "sequence: not with trainer.context_parallel or tensor_parallel > 1; use replay_loss=nll"
        )
    batch = build_batch(samples, learner.device)
    if learner.moe is not None:
        learner.moe.check_rollouts(batch)
    replay_batch = build_batch(replay, learner.device) if replay else None
    mask = batch.loss_mask
    use_kl = learner.kl_ctl.value > 0
    single_pass = learner.single_pass(use_kl)
    old = None if single_pass else learner.compute_logprobs(batch)
    ref = learner.compute_ref_logprobs(batch) if use_kl else None
    old_values = learner.compute_values(batch) if learner.critic is not None else None

    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(batch.size, device=learner.device), last_token_index(mask)] = batch.rewards
    kl = None
    if use_kl and not single_pass:
        assert old is not None and ref is not None
        kl_tok = kl_estimate(old, ref, a.kl_estimator) * mask
        kl = float(masked_mean(kl_tok, mask).item())
        if a.kl_in_reward:
            token_rewards = token_rewards - learner.kl_ctl.value * kl_tok
    adv = get_advantage(a.advantage)(
        token_rewards,
        mask,
        batch.group_ids,
        values=old_values,
        gamma=a.gamma,
        lam=a.lam,
        normalize_std=a.normalize_std,
    )
    policy_mask = is_weights = None
    if old is not None:  # importance correction: behaviour (engine, maybe stale) -> learner
        policy_mask = ratio_mask(
            old, batch.behavior_logprobs, mask, a.mask_ratio_low, a.mask_ratio_high, a.tis_level
        )
        if a.tis_cap is not None:
            is_weights = tis_weights(old, batch.behavior_logprobs, mask, a.tis_cap, a.tis_level)
    batch = replace(
        batch,
        old_logprobs=old,
        ref_logprobs=ref,
        old_values=old_values,
        advantages=adv.advantages,
        returns=adv.returns,
        policy_mask=policy_mask,
        is_weights=is_weights,
    )
    return PreparedBatch(
        batch,
        adv,
        FROM_FORWARD if old is None else old,
        use_kl,
        replay_batch,
        kl,
        time.perf_counter() - t0,
    )


def run_update(learner: Any, prepared: PreparedBatch) -> UpdateResult:
    """Optimise on `prepared` (see the module doc); the result holds the old logprobs the update used."""
    batch, replay = prepared.batch, prepared.replay
    if learner.critic is not None and (batch.returns is None or batch.old_values is None):
        raise ValueError("update() with a critic needs batch.returns and batch.old_values")
    if learner.optimizer_offloaded:
        learner.reload_optimizer()
    tc, a = learner.trainer_cfg, learner.algo_cfg
    forward_logprobs = torch.zeros_like(batch.loss_mask) if prepared.old_from_forward else None
    sum_keys = [k for term in (*learner.terms, *learner.critic_terms) for k in term.sums]
    t0 = time.perf_counter()
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    local_sums: dict[str, float] = {}  # per micro-batch: this rank's share (reduced over ranks at the end)
    local_counts: dict[str, float] = {}

    def add(key: str, value: float, weight: float = 1.0) -> None:
        sums[key] = sums.get(key, 0.0) + value * weight
        counts[key] = counts.get(key, 0.0) + weight

    cells = tokens = computed = 0  # positions run (padding included), sequence tokens, real positions run
    ratio_max = 1.0
    learner.model.train()
    if learner.critic is not None:
        learner.critic.train()
    try:
        for _ in range(learner.batch_cfg.ppo_epochs):
            perm = torch.randperm(batch.size, generator=learner.generator).tolist()
            n_mini = min(learner.batch_cfg.mini_batches, batch.size)
            bounds = [round(i * batch.size / n_mini) for i in range(n_mini + 1)]
            for k in range(n_mini):
                mb_rows = perm[bounds[k] : bounds[k + 1]]
                mb = batch.select(mb_rows)
                w_pol = aggregation_weights(mb.train_mask, a.loss_agg, a.loss_norm_tokens)
                w_tok = aggregation_weights(mb.loss_mask, "token_mean")
                lr = learner.set_lr()
                for opt in learner.optimizers.all():
                    opt.zero_grad(set_to_none=True)
                mb_sums = dict.fromkeys(sum_keys, 0.0)
                micro = learner.micro_batches(mb)
                shares = [(m, 1.0) for m in micro] if learner.dp is None else learner.dp.share(micro)
                for (rows, prefix), scale in shares:
                    counted = scale > 0  # a weight-0 repeat only keeps the ranks' collectives in step
                    mi = learner.select_rows(mb, rows, prefix)
                    width = mi.token_ids.shape[1]
                    ridx = torch.as_tensor(rows, device=learner.device)
                    inputs = learner.model_inputs(mi) if (prefix == 0 or learner.critic is not None) else None
                    seq_tokens = int(mi.lengths.sum().item()) if counted else 0
                    tokens += seq_tokens
                    if counted and prefix > 0:  # the prefix once, then every row's suffix, unpadded
                        run = seq_tokens - (mi.size - 1) * prefix
                        computed, cells = computed + run, cells + run
                    elif counted:
                        assert inputs is not None
                        computed += inputs.tokens
                        cells += inputs.cells
                    lp, ent = learner._policy_forward(learner.model, mi, mi.loss_mask, inputs)
                    old, is_weights = mi.old_logprobs, mi.is_weights
                    if forward_logprobs is not None:  # single pass: the old policy is this forward's
                        old = lp.detach().to(batch.loss_mask.dtype)
                        brows = torch.as_tensor([mb_rows[r] for r in rows], device=learner.device)
                        forward_logprobs[brows, :width] = old
                        if a.tis_cap is not None:
                            is_weights = tis_weights(
                                old, mi.behavior_logprobs, mi.loss_mask, a.tis_cap, a.tis_level
                            )
                    x = LossInputs(
                        logprobs=lp,
                        weights=w_pol[ridx, :width],
                        loss_mask=mi.loss_mask,
                        entropy=ent,
                        mask=mi.train_mask,
                        old_logprobs=old,
                        ref_logprobs=mi.ref_logprobs,
                        behavior_logprobs=mi.behavior_logprobs,
                        advantages=mi.advantages,
                        is_weights=is_weights,
                        token_weights=w_tok[ridx, :width],
                        old_values=mi.old_values,
                        returns=mi.returns,
                        token_share=float(mi.lengths.sum()) / float(mb.lengths.sum()),
                        grad_scale=scale,
                    )
                    loss, results = add_terms(learner.terms, x)
                    assert loss is not None
                    (loss if scale == 1.0 else loss * scale).backward()
                    if learner.critic_terms:  # a weight-0 repeat too: a sharded critic's collectives
                        values = learner.value_forward(mi, mi.loss_mask, inputs)
                        critic_loss, critic_results = add_terms(
                            learner.critic_terms, replace(x, values=values)
                        )
                        assert critic_loss is not None
                        critic_loss.backward()
                        results += critic_results
                    if not counted:
                        continue
                    for r in results:
                        for key, v in r.sums.items():
                            mb_sums[key] += v
                        for key, (v, w) in r.means.items():
                            local_sums[key] = local_sums.get(key, 0.0) + v * w
                            local_counts[key] = local_counts.get(key, 0.0) + w
                        ratio_max = max(ratio_max, r.maxima.get("ratio_max", ratio_max))
                if replay is not None:
                    r_rows = list(
                        range(round(k * replay.size / n_mini), round((k + 1) * replay.size / n_mini))
                    )
                    if r_rows:
                        sub = replay.select(r_rows)
                        term = learner.replay_term.backward(learner, sub, a.replay_coef)
                        add(learner.replay_term.metric, term, float(sub.loss_mask.sum().item()))
                if learner.dp is not None:
                    mb_sums = dict(zip(mb_sums, learner.dp.sum_(list(mb_sums.values())), strict=True))
                grad_norm = learner.clip_grad_norm(tc.max_grad_norm)
                learner.optimizer.step()
                if learner.critic is not None and learner.critic_optimizer is not None:
                    critic_params = list(learner.critic.parameters())
                    add(
                        "critic_grad_norm",
                        full_value(learner.clip_grad_norm(tc.max_grad_norm, critic_params)),
                    )
                    learner.critic_optimizer.step()
                learner.count_optimizer_step()
                for key, v in mb_sums.items():
                    add(key, v)
                add("grad_norm", full_value(grad_norm))
                add("lr", lr)
    finally:
        learner.model.eval()
        if learner.critic is not None:
            learner.critic.eval()
    if learner.dp is not None:
        local_sums, local_counts = learner.dp.reduce_weighted(local_sums, local_counts)
        tokens, computed, cells = (int(x) for x in learner.dp.sum_([tokens, computed, cells]))
        ratio_max = learner.dp.max_(ratio_max)
    for k, v in local_sums.items():
        sums[k] = sums.get(k, 0.0) + v
        counts[k] = counts.get(k, 0.0) + local_counts[k]
    wall = time.perf_counter() - t0
    out_metrics = {k: (sums[k] / counts[k] if counts.get(k) else sums[k]) for k in sums}
    if "policy_loss" in out_metrics:
        out_metrics["loss"] = out_metrics.pop("policy_loss")
    if replay is not None:
        out_metrics["replay_tokens"] = float(replay.loss_mask.sum().item())
        out_metrics["replay_sequences"] = float(replay.size)
    out_metrics.update(
        ratio_max=ratio_max,
        update_s=wall,
        update_tokens=float(tokens),
        update_tokens_per_s=tokens / wall if wall > 0 else 0.0,
        padding_frac=1.0 - computed / cells if cells else 0.0,
        shared_prefix_frac=1.0 - computed / tokens if tokens else 0.0,
        optimizer_steps=float(learner.optimizer_steps),
    )
    if forward_logprobs is not None:
        return UpdateResult(out_metrics, forward_logprobs)
    assert batch.old_logprobs is not None
    return UpdateResult(out_metrics, batch.old_logprobs)
