"""The Learner's supervised and preference steps as term sets over its forward: SFT is `NllTerm` on the
loss-masked tokens, DPO/IPO/SimPO a `PreferenceTerm` on per-sequence logprob sums of (chosen, rejected)
pairs. Each step micro-batches, accumulates, clips and steps the Learner's optimizer; none reads the RL
`algorithm` section. The RL step is in train/learner.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from posttrain.algos import aggregation_weights, preference_needs_reference
from posttrain.train.batch import Batch, Sample, build_batch, plan_micro_batches
from posttrain.train.terms import LossInputs, NllTerm, PairInputs, PreferenceTerm, add_terms

T = TypeVar("T")

SFT_TERMS = (NllTerm(),)


def sft_micro_batches(learner: Any, batch: Batch) -> list[tuple[Batch, list[int]]]:
    """(rows as a batch, their indices) per token-budgeted micro-batch (no prompt sharing)."""
    plan = plan_micro_batches(
        batch.lengths.tolist(), learner.batch_cfg.micro_batch_tokens, learner.trainer_cfg.packing
    )
    return [(batch.select(rows), rows) for rows in plan]


def nll_backward(learner: Any, batch: Batch, coef: float | None = None) -> float:
    """Backward of the token-mean NLL (temperature 1) of `batch`'s loss-masked tokens (times `coef` when
    given), over its micro-batches; returns the NLL."""
    weights = aggregation_weights(batch.loss_mask, "token_mean")
    total = 0.0
    for mi, rows in sft_micro_batches(learner, batch):
        w = weights[torch.as_tensor(rows, device=learner.device), : mi.token_ids.shape[1]]
        lp, _ = learner._policy_forward(learner.model, mi, mi.loss_mask, temperature=1.0)
        loss, results = add_terms(SFT_TERMS, LossInputs(logprobs=lp, weights=w, loss_mask=mi.loss_mask))
        assert loss is not None
        (loss if coef is None else coef * loss).backward()
        total += results[0].sums["nll"]
    return total


def _optimizer_step(learner: Any, backward: Callable[[], T]) -> tuple[T, float, torch.Tensor]:
    """One optimizer step of the Learner around `backward` (which accumulates the gradients and returns
    its sums): optimizer state back on the device, the LR set, gradients zeroed, the model in train mode
    for the pass, clipped, stepped, counted as a new version. Returns (backward's result, lr, grad norm)."""
    if learner.optimizer_offloaded:
        learner.reload_optimizer()
    lr = learner.set_lr()
    learner.optimizer.zero_grad(set_to_none=True)
    learner.model.train()
    try:
        result = backward()
        grad_norm = learner.clip_grad_norm(learner.trainer_cfg.max_grad_norm)
        learner.optimizer.step()
    finally:
        learner.model.eval()
    learner.count_optimizer_step(new_version=True)
    return result, lr, grad_norm


def sft_step(learner: Any, samples: list[Sample]) -> dict[str, float]:
    """One supervised optimizer step on `samples` (see `Learner.sft_step`)."""
    t0 = time.perf_counter()
    batch = build_batch(samples, learner.device)
    loss_sum, lr, grad_norm = _optimizer_step(learner, lambda: nll_backward(learner, batch))
    wall = time.perf_counter() - t0
    seq_tokens = float(batch.lengths.sum().item())
    return {
        "loss": loss_sum,
        "tokens": float(batch.loss_mask.sum().item()),
        "sequences": float(batch.size),
        "sequence_tokens": seq_tokens,
        "grad_norm": float(grad_norm),
        "lr": lr,
        "update_tokens_per_s": seq_tokens / wall if wall > 0 else 0.0,
        "step_s": wall,
        "optimizer_steps": float(learner.optimizer_steps),
        "version": float(learner.version),
    }


@torch.no_grad()
def sft_loss(learner: Any, samples: list[Sample]) -> dict[str, float]:
    """The token-mean NLL (temperature 1) of `samples`' loss-masked tokens, without training."""
    batch = build_batch(samples, learner.device)
    total = 0.0
    for mi, _ in sft_micro_batches(learner, batch):
        lp, _ = learner._policy_forward(learner.model, mi, mi.loss_mask, temperature=1.0)
        total += float(-(lp * mi.loss_mask).sum().item())
    tokens = float(batch.loss_mask.sum().item())
    return {"loss": total / max(tokens, 1.0), "tokens": tokens, "sequences": float(batch.size)}


def _preference_inputs(
    learner: Any, chosen: list[Sample], rejected: list[Sample], loss: str, params: dict[str, Any]
) -> tuple[PreferenceTerm, Batch, torch.Tensor | None, torch.Tensor]:
    if len(chosen) != len(rejected) or not chosen:
        raise ValueError(
            f"preference pairs: need as many chosen as rejected samples, at least one; got "
            f"{len(chosen)} and {len(rejected)}"
        )
    term = PreferenceTerm(loss, params)
    batch = build_batch(chosen + rejected, learner.device)
    ref = None
    if preference_needs_reference(loss):
        ref = learner.compute_ref_logprobs(batch, temperature=1.0).sum(-1)
    return term, batch, ref, batch.loss_mask.sum(-1)


def _preference_pass(
    learner: Any,
    term: PreferenceTerm,
    batch: Batch,
    ref: torch.Tensor | None,
    tokens: torch.Tensor,
    backward: bool,
) -> dict[str, float]:
    n = batch.size // 2
    lengths = batch.lengths.tolist()
    pair_len = [max(lengths[i], lengths[i + n]) for i in range(n)]
    # a pair is two padded rows: plan on half the budget
    plan = plan_micro_batches(pair_len, max(1, learner.batch_cfg.micro_batch_tokens // 2), False)
    sums = dict.fromkeys(PreferenceTerm.sums, 0.0)
    for pairs in plan:
        rows = pairs + [i + n for i in pairs]
        sub = batch.select(rows)
        lp, _ = learner._policy_forward(learner.model, sub, sub.loss_mask, temperature=1.0)
        seq = lp.sum(-1)
        k = len(pairs)
        idx_c = torch.as_tensor(pairs, device=learner.device)
        out = term(
            PairInputs(
                seq[:k],
                seq[k:],
                ref[idx_c] if ref is not None else None,
                ref[idx_c + n] if ref is not None else None,
                tokens[idx_c],
                tokens[idx_c + n],
                n,
            )
        )
        assert out.loss is not None
        if backward:
            out.loss.backward()
        for key, v in out.sums.items():
            sums[key] += v
    return {
        "loss": sums["loss"],
        "chosen_reward": sums["chosen_reward"] / n,
        "rejected_reward": sums["rejected_reward"] / n,
        "margin": sums["margin"] / n,
        "accuracy": sums["correct"] / n,
        "pairs": float(n),
        "tokens": float(batch.loss_mask.sum().item()),
    }


def preference_step(
    learner: Any, chosen: list[Sample], rejected: list[Sample], loss: str, params: dict[str, Any]
) -> dict[str, float]:
    """One optimizer step of the preference loss `loss` on the pairs (see `Learner.preference_step`)."""
    t0 = time.perf_counter()
    term, batch, ref, tokens = _preference_inputs(learner, chosen, rejected, loss, params)
    sums, lr, grad_norm = _optimizer_step(
        learner, lambda: _preference_pass(learner, term, batch, ref, tokens, backward=True)
    )
    return {
        **sums,
        "grad_norm": float(grad_norm),
        "lr": lr,
        "step_s": time.perf_counter() - t0,
        "optimizer_steps": float(learner.optimizer_steps),
        "version": float(learner.version),
    }


@torch.no_grad()
def preference_eval(
    learner: Any, chosen: list[Sample], rejected: list[Sample], loss: str, params: dict[str, Any]
) -> dict[str, float]:
    """`preference_step`'s loss, rewards, margin and accuracy on the pairs, without training."""
    term, batch, ref, tokens = _preference_inputs(learner, chosen, rejected, loss, params)
    return _preference_pass(learner, term, batch, ref, tokens, backward=False)
