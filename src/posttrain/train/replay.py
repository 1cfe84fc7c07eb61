"""Replay terms: general data mixed into the RL update (`orchestrator.replay`, algorithm.replay_fraction).

Unlike the micro-batch terms of train/terms.py a replay term runs its own forward passes over its own
rows: once per mini-batch the Learner hands it that mini-batch's share of the replay rows and it
accumulates replay_coef x its loss into the gradients of the optimizer step under way. `nll`: the
token-mean negative log-likelihood; `kl`: the token-mean KL(initial policy || policy) over the whole
vocabulary (distillation from the reference's full distribution, not only its sampled token).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from posttrain.algos import aggregation_weights
from posttrain.train.batch import Batch
from posttrain.train.forward import causal_lm, chunked_forward_kl
from posttrain.train.offline import nll_backward, sft_micro_batches


class ReplayNll:
    """replay_loss=nll: a supervised term on the replay completions."""

    metric = "replay_nll"
    needs_reference = False
    one_process = False  # holds with context and tensor parallelism

    def backward(self, learner: Any, batch: Batch, coef: float) -> float:
        return nll_backward(learner, batch, coef)


class ReplayKl:
    """replay_loss=kl: KL(initial policy || policy) at each replay position, over the whole vocabulary
    (one process's whole vocabulary and sequence: refused with context or tensor parallelism)."""

    metric = "replay_kl"
    needs_reference = True
    one_process = True

    def backward(self, learner: Any, batch: Batch, coef: float) -> float:
        weights = aggregation_weights(batch.loss_mask, "token_mean")
        total = 0.0
        for mi, rows in sft_micro_batches(learner, batch):
            w = weights[torch.as_tensor(rows, device=learner.device), : mi.token_ids.shape[1]]
            h, targets = learner.target_hidden(learner.model, mi, mi.loss_mask)
            ref_h, ref_head = reference_hidden(learner, mi)
            kl = chunked_forward_kl(
                causal_lm(learner.model).get_output_embeddings(),
                ref_head,
                h,
                ref_h,
                learner.trainer_cfg.logprob_chunk_tokens,
            )
            loss = (kl * w[targets.rows, targets.cols].to(kl.dtype)).sum()
            (coef * loss).backward()
            total += float(loss.item())
        return total


REPLAY_TERMS: dict[str, type[ReplayNll] | type[ReplayKl]] = {"nll": ReplayNll, "kl": ReplayKl}


@torch.no_grad()
def reference_hidden(learner: Any, batch: Batch) -> tuple[Tensor, nn.Module]:
    """The initial policy's hidden states at `batch`'s loss positions and its output layer: the frozen
    copy's, or under LoRA the base model's (adapters off; an adapted output layer is refused, its base
    weights would not be the reference once the backward recomputes it)."""
    if learner.lora:
        head = causal_lm(learner.model).get_output_embeddings()
        if any(p.requires_grad for p in head.parameters()):
            raise ValueError(
                "algorithm.replay_loss=kl under LoRA needs a frozen output layer: take lm_head out of "
                "model.lora_target_modules, or use replay_loss=nll"
            )
        with learner.model.disable_adapter():
            return learner.target_hidden(learner.model, batch, batch.loss_mask)[0], head
    if learner.reference is None:
        raise RuntimeError("algorithm.replay_loss=kl needs the frozen reference the Learner keeps for it")
    h = learner.target_hidden(learner.reference, batch, batch.loss_mask)[0]
    return h, causal_lm(learner.reference).get_output_embeddings()
