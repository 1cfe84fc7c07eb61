"""The Learner: the RL step on a batch, over parts built (train/parts.py) and optimizers built from
them (train/optim.py).

`step(samples)` is `prepare` then `update`. `prepare` computes everything the update reads, all
together: old/reference logprobs, values, token rewards (with the KL folded in if asked), advantages
through the `posttrain.algos` registry, importance corrections against the engine's behaviour logprobs
(or marks the old logprobs as the training forward's own: single pass). `update` runs mini-batches x
PPO epochs of token-budgeted micro-batches, summing the loss terms it is handed (train/terms.py) with
gradient accumulation, clipping and the LR schedule. SFT and preference steps are term sets in
train/offline.py; replay terms in train/replay.py. Knows nothing about environments.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from posttrain.algos import (
    AdvantageOutput,
    aggregation_weights,
    get_advantage,
    kl_estimate,
    make_kl_controller,
    masked_mean,
    mismatch_metrics,
    ratio_mask,
    tis_weights,
)
from posttrain.config import AlgorithmConfig, BatchConfig, ModelConfig, TrainerConfig, check_critic
from posttrain.train import offline
from posttrain.train.batch import (
    Batch,
    ModelInputs,
    Sample,
    build_batch,
    last_token_index,
    make_inputs,
    plan_micro_batches,
    plan_shared_micro_batches,
)
from posttrain.train.distributed import ParallelPlan, full_value
from posttrain.train.forward import (
    Targets,
    causal_lm,
    chunked_logprobs,
    decoder_hidden,
    scatter_rows,
    select_targets,
    shared_prefix_hidden,
)
from posttrain.train.optim import (
    OptimizerFactory,
    Optimizers,
    build_optimizers,
    lr_factor,
    make_adamw,
    move_optimizer_state,
    set_lr,
)
from posttrain.train.parts import CRITIC_CHOICES, build_parts, group_rank, learner_device
from posttrain.train.replay import REPLAY_TERMS
from posttrain.train.terms import EntropyTerm, LossInputs, add_terms, critic_terms, policy_terms
from posttrain.train.weights import WeightUpdate, lora_base, lora_update

# built in parts.py and optim.py; importable from here as before
__all__ = [
    "CRITIC_CHOICES",
    "Learner",
    "PreparedBatch",
    "group_rank",
    "learner_device",
    "lr_factor",
    "make_adamw",
]


@dataclass
class PreparedBatch:
    """What `prepare` computed for a batch: `batch` with old_logprobs (unless `old_from_forward`),
    ref_logprobs (when a KL is taken), old_values (with a critic), advantages, returns, and the
    importance corrections set; nothing is filled in later."""

    batch: Batch
    advantage: AdvantageOutput
    old_from_forward: bool  # single pass: each micro-batch's old logprobs are its training forward's
    use_kl: bool
    replay: Batch | None = None
    kl: float | None = None  # the batch's KL from the reference, when known before the update
    prepare_s: float = 0.0


class Learner:
    """Owns the trainable policy, the critic, the reference, their optimizers and the loss terms (see the
    module doc). Implements `train.protocol.LearnerProtocol`."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        trainer_cfg: TrainerConfig,
        algo_cfg: AlgorithmConfig,
        seed: int = 0,
        model: Any = None,
        critic_model: Any = None,
        batch_cfg: BatchConfig | None = None,
        keep_reference: bool = False,
        plan: ParallelPlan | None = None,
    ) -> None:
        """`keep_reference`: full fine-tuning keeps a frozen copy of the initial policy even when
        algorithm.kl_coef is 0 (preference losses compare with it; so does a replay term that needs it);
        LoRA's reference is always the base. The parts go to trainer.device (`learner_device`; this
        process's rank in an initialised torch.distributed group picks its GPU). `plan`: how the parts
        are split before the optimizers are built from them (a rank of a learner group passes
        `ParallelPlan.of(trainer)`); by default only context parallelism, when it is the only split."""
        from posttrain.train.terms import policy_loss_term

        self.model_cfg, self.trainer_cfg, self.algo_cfg, self.seed = model_cfg, trainer_cfg, algo_cfg, seed
        self.batch_cfg = batch_cfg if batch_cfg is not None else BatchConfig()
        get_advantage(algo_cfg.advantage)  # fail early on unknown names
        policy_loss = policy_loss_term(algo_cfg)
        check_critic(algo_cfg.advantage, trainer_cfg.critic)
        if trainer_cfg.critic == "separate" and critic_model is None and not trainer_cfg.critic_spec:
            raise ValueError(
                "trainer.critic=separate needs trainer.critic_spec (a model spec for the critic)"
            )
        if algo_cfg.loss_agg == "seq_mean_token_sum_norm" and algo_cfg.loss_norm_tokens is None:
            raise ValueError(
                "algorithm.loss_agg=seq_mean_token_sum_norm needs algorithm.loss_norm_tokens, Dr. GRPO's constant "
                "(a run config sets it to engine.max_new_tokens)"
            )
        if trainer_cfg.lr_schedule != "constant" and trainer_cfg.lr_decay_steps <= 0:
            raise ValueError(
                f"trainer.lr_schedule={trainer_cfg.lr_schedule} needs trainer.lr_decay_steps > 0"
            )
        self.replay_term = REPLAY_TERMS[algo_cfg.replay_loss]()
        keep = keep_reference or self.replay_term.needs_reference or algo_cfg.kl_coef > 0
        parts = build_parts(model_cfg, trainer_cfg, seed, model, critic_model, keep_reference=keep)
        self.model, self.critic, self.reference = parts.policy, parts.critic, parts.reference
        self.vision, self.moe, self.device = parts.vision, parts.moe, parts.device
        self.lora, self.dynamic_rope = parts.lora, parts.dynamic_rope
        self.kl_ctl = make_kl_controller(algo_cfg.kl_coef, algo_cfg.kl_target, algo_cfg.kl_horizon)
        self.entropy_term = EntropyTerm(float(algo_cfg.entropy_coef))  # moves under algorithm.entropy_floor
        self.terms = policy_terms(policy_loss, algo_cfg, self.kl_ctl, self.entropy_term, self.moe)
        self.critic_terms = critic_terms(algo_cfg) if self.critic is not None else []
        self.generator = torch.Generator().manual_seed(seed)
        self.version = 0
        self.optimizer_steps = 0
        self.optimizer_offloaded = False
        self.pad_id = int(getattr(causal_lm(self.model).config, "pad_token_id", None) or 0)
        self.dp: Any = None  # a train.distributed.DataParallel once shard_learner() made this a rank
        self.tp: Any = None  # a train.distributed.TensorParallel once tensor_parallel_learner() split it
        self.cp: Any = None  # a train.context_parallel.ContextParallel under trainer.context_parallel > 1
        if trainer_cfg.context_parallel > 1 and self.vision is not None:
            raise ValueError(
                "trainer.context_parallel > 1 does not run vision-language policies (their images "
                "enter at the embeddings on the single-process path); set it to 1"
            )
        if plan is None:  # dp or tp > 1: a rank group passes the whole plan (with its process group)
            alone = trainer_cfg.data_parallel == 1 and trainer_cfg.tensor_parallel == 1
            plan = ParallelPlan(cp=trainer_cfg.context_parallel if alone else 1)
        self.optimizers: Optimizers
        plan.apply(self)  # splits the parts, then builds the optimizers from them

    def build_optimizers(self, factory: OptimizerFactory | None = None) -> None:
        """(Re)build the optimizers from the parts as they are now: a parallel plan (train/distributed.py)
        calls this once it has sharded or split them, before any step. `factory(params, lr)`: AdamW."""
        self.optimizers = build_optimizers(self.model, self.critic, self.trainer_cfg, factory)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.optimizers.policy

    @property
    def critic_optimizer(self) -> torch.optim.Optimizer | None:
        return self.optimizers.critic

    @property
    def trainable(self) -> list[torch.nn.Parameter]:
        return self.optimizers.trainable

    @property
    def entropy_coef(self) -> float:
        return self.entropy_term.coef

    @entropy_coef.setter
    def entropy_coef(self, value: float) -> None:
        self.entropy_term.coef = float(value)

    # ------------------------------------------------------------------------------------------
    # forward passes

    def _autocast(self) -> Any:
        if self.trainer_cfg.bf16_autocast:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return torch.autocast(device_type=self.device.type, enabled=False)

    def _inputs(self, batch: Batch) -> ModelInputs:
        return make_inputs(batch.token_ids, batch.lengths, self.trainer_cfg.packing, self.pad_id)

    def policy_forward(
        self,
        model: Any,
        batch: Batch,
        mask: Tensor,
        inputs: ModelInputs | None = None,
        temperature: float | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(logprobs, entropy) as `[b, L]` matrices, nonzero only where `mask` is 1. A micro-batch
        planned with a shared prefix (`batch.meta["shared_prefix"]`) runs that prefix once. Logits are
        divided by `temperature` (None: algorithm.temperature, the RL sampling temperature)."""
        if self.dp is not None and model is self.model and not self.dp.inside:  # through the FSDP root
            return self.dp.root(batch, mask, inputs, temperature)
        if self.cp is not None:  # this rank's shard of every row, attention round the ring
            temp = self.algo_cfg.temperature if temperature is None else temperature
            chunk = self.trainer_cfg.logprob_chunk_tokens
            return self.cp.policy_forward(model, batch, mask, temp, chunk, self._autocast())
        h, targets = self._target_hidden(model, batch, mask, inputs)
        with self._autocast():
            lp, ent = chunked_logprobs(
                causal_lm(model).get_output_embeddings(),
                h,
                targets.token,
                self.trainer_cfg.logprob_chunk_tokens,
                self.algo_cfg.temperature if temperature is None else temperature,
            )
        shape = tuple(batch.token_ids.shape)
        return scatter_rows(lp, targets, shape), scatter_rows(ent, targets, shape)

    _policy_forward = policy_forward  # the name the passes below call (a test wraps it per instance)

    def _target_hidden(
        self, model: Any, batch: Batch, mask: Tensor, inputs: ModelInputs | None = None
    ) -> tuple[Tensor, Targets]:
        """The decoder's hidden states `[n, H]` at the positions predicting the n tokens where `mask` is
        1, and those targets (the one-process path: no FSDP root, no context parallelism)."""
        lm = causal_lm(model)
        prefix = int(batch.meta.get("shared_prefix", 0))
        if prefix > 0:
            width = batch.token_ids.shape[1]
            offsets = torch.arange(batch.size, device=self.device) * width
            targets = select_targets(mask, batch.token_ids, offsets)
        else:
            inputs = inputs if inputs is not None else self._inputs(batch)
            targets = select_targets(mask, batch.token_ids, inputs.flat_offset)
            if self.vision is not None and batch.images:
                inputs = self.vision.attach(
                    lm, inputs, batch.token_ids, batch.loss_mask, batch.lengths, batch.images
                )
        routed = (
            self.moe.forward(batch, inputs, prefix)
            if self.moe is not None and model is self.model
            else contextlib.nullcontext()
        )
        with self._autocast(), routed:
            if prefix > 0:
                hidden = shared_prefix_hidden(lm.get_decoder(), batch.token_ids, batch.lengths, prefix)
            else:
                assert inputs is not None
                hidden = decoder_hidden(lm.get_decoder(), inputs)
        return hidden.reshape(-1, hidden.shape[-1])[targets.src], targets

    def value_forward(self, batch: Batch, mask: Tensor, inputs: ModelInputs | None = None) -> Tensor:
        """The critic's values `[b, L]` where `mask` is 1 (0 elsewhere), with gradient."""
        assert self.critic is not None
        if self.cp is not None:  # this rank's shard of every row, attention round the ring
            if self.dp is not None and not self.dp.inside:  # a dp x cp mesh: through the critic's FSDP root
                return self.dp.critic_root(batch, mask)
            return self.cp.value_forward(self.critic, batch, mask, self._autocast())
        inputs = inputs if inputs is not None else self._inputs(batch)
        targets = select_targets(mask, batch.token_ids, inputs.flat_offset)
        with self._autocast():
            v = self.critic(inputs, targets.src)
        return scatter_rows(v.float(), targets, tuple(batch.token_ids.shape))

    def _micro_batches(self, batch: Batch) -> list[tuple[list[int], int]]:
        """(rows, shared prefix length) per micro-batch; the prefix is 0 unless prompt sharing is on."""
        tc, budget = self.trainer_cfg, self.batch_cfg.micro_batch_tokens
        # dynamic NTK rotates a prompt by the length of the whole sequence: a shared prompt is not shared
        if (
            tc.share_prompt_prefix
            and not tc.gradient_checkpointing
            and not self.dynamic_rope
            and self.cp is None
            and self.vision is None  # image features enter at the embeddings, per row
        ):
            return plan_shared_micro_batches(
                batch.token_ids, batch.loss_mask, batch.lengths, batch.group_ids, budget, tc.packing
            )
        return [(rows, 0) for rows in plan_micro_batches(batch.lengths.tolist(), budget, tc.packing)]

    @staticmethod
    def _select(batch: Batch, rows: list[int], prefix: int) -> Batch:
        sub = batch.select(rows)
        sub.meta["shared_prefix"] = prefix
        return sub

    @torch.no_grad()
    def _no_grad_map(self, batch: Batch, fn: Any) -> Tensor:
        out = torch.zeros_like(batch.loss_mask)
        for rows, prefix in self._micro_batches(batch):
            sub = self._select(batch, rows, prefix)
            idx = torch.as_tensor(rows, device=self.device)
            out[idx, : sub.token_ids.shape[1]] = fn(sub)
        return out

    def compute_logprobs(
        self, batch: Batch | list[Sample], model: Any = None, temperature: float | None = None
    ) -> Tensor:
        """Learner logprobs `[B, L]` of the tokens where `loss_mask` is 1 (0 elsewhere), no grad;
        logits divided by `temperature` (None: algorithm.temperature)."""
        if isinstance(batch, list):
            batch = build_batch(batch, self.device)
        model = self.model if model is None else model
        extra = {} if temperature is None else {"temperature": temperature}
        return self._no_grad_map(
            batch, lambda sub: self._policy_forward(model, sub, sub.loss_mask, **extra)[0]
        )

    @torch.no_grad()
    def score_tokens(self, samples: list[Sample]) -> tuple[Tensor, Tensor, Tensor]:
        """(logprobs, entropy, loss mask) `[B, L]` of the current policy over the samples' loss-mask
        tokens at temperature 1 (the model's own distribution), no grad."""
        batch = build_batch(samples, self.device)
        lp = torch.zeros_like(batch.loss_mask)
        ent = torch.zeros_like(batch.loss_mask)
        for rows, prefix in self._micro_batches(batch):
            sub = self._select(batch, rows, prefix)
            idx = torch.as_tensor(rows, device=self.device)
            width = sub.token_ids.shape[1]
            lp[idx, :width], ent[idx, :width] = self._policy_forward(
                self.model, sub, sub.loss_mask, temperature=1.0
            )
        return lp, ent, batch.loss_mask

    def compute_ref_logprobs(self, batch: Batch | list[Sample], temperature: float | None = None) -> Tensor:
        """Reference logprobs: LoRA adapters disabled, or the frozen copy for full fine-tuning."""
        if isinstance(batch, list):
            batch = build_batch(batch, self.device)
        if self.lora:
            with self.model.disable_adapter():
                return self.compute_logprobs(batch, temperature=temperature)
        if self.reference is None:
            raise RuntimeError(
                "no reference model: full fine-tuning keeps a frozen copy only when algorithm.kl_coef > 0 "
                "(or keep_reference=True)"
            )
        return self.compute_logprobs(batch, model=self.reference, temperature=temperature)

    def compute_values(self, batch: Batch) -> Tensor:
        if self.critic is None:
            raise RuntimeError("no critic: set trainer.critic to 'copy' or 'separate'")
        return self._no_grad_map(batch, lambda sub: self.value_forward(sub, sub.loss_mask))

    # ------------------------------------------------------------------------------------------
    # the RL step: prepare, then update

    def step(
        self, samples: list[Sample], current_version: int | None = None, replay: list[Sample] | None = None
    ) -> dict[str, float]:
        """The whole RL update for one batch of samples (`prepare`, then `update`); returns metrics.
        Bumps `version`.

        `replay`: supervised samples mixed into the update (general data, `orchestrator.replay`): each
        optimizer step adds algorithm.replay_coef x the replay term (train/replay.py: token-mean NLL, or
        the full-vocabulary KL from the initial policy) of its share of them (split over the mini-batches
        in order) to the RL loss. Metrics `replay_nll` or `replay_kl` (before the step),
        `replay_sequences`, `replay_tokens`."""
        t0 = time.perf_counter()
        a = self.algo_cfg
        prepared = self.prepare(samples, replay)
        batch, mask = prepared.batch, prepared.batch.loss_mask
        current = self.version if current_version is None else current_version
        metrics: dict[str, float] = {} if prepared.kl is None else {"kl": prepared.kl}
        update_metrics, forward_logprobs = self._update(prepared)
        metrics.update(update_metrics)
        old = batch.old_logprobs if forward_logprobs is None else forward_logprobs
        assert old is not None
        if prepared.use_kl and prepared.kl is None:  # single pass: the KL of the training forward's
            assert batch.ref_logprobs is not None
            kl_tok = kl_estimate(old, batch.ref_logprobs, a.kl_estimator) * mask
            metrics["kl"] = float(masked_mean(kl_tok, mask).item())
        metrics.update(mismatch_metrics(old, batch.behavior_logprobs, mask, a.tis_cap, batch.policy_mask))

        if prepared.use_kl and a.kl_control == "batch":  # "drift": the run steers it from the drift probe
            self.kl_ctl.update(metrics["kl"], batch.size)
        if a.entropy_floor is not None and "entropy" in metrics:
            self.entropy_coef = max(
                0.0, self.entropy_coef + a.entropy_floor_lr * (a.entropy_floor - metrics["entropy"])
            )
            metrics["entropy_coef"] = self.entropy_coef
        if self.moe is not None:
            metrics.update(self.moe.pop_metrics())
        groups = torch.unique(batch.group_ids)
        zero_groups = torch.unique(batch.group_ids[prepared.advantage.zero_signal])
        staleness = (current - batch.policy_versions).float()
        advantages = prepared.advantage.advantages
        metrics.update(
            reward_mean=float(batch.rewards.mean().item()),
            reward_std=float(batch.rewards.std().item()) if batch.size > 1 else 0.0,
            zero_signal_group_frac=float(zero_groups.numel() / max(groups.numel(), 1)),
            advantage_mean=float(masked_mean(advantages, mask).item()),
            advantage_abs_mean=float(masked_mean(advantages.abs(), mask).item()),
            kl_coef=float(self.kl_ctl.value),
            staleness_mean=float(staleness.mean().item()),
            staleness_max=float(staleness.max().item()),
            sequences=float(batch.size),
            tokens=float(mask.sum().item()),
            sequence_tokens=float(batch.lengths.sum().item()),
            prepare_s=prepared.prepare_s,
            step_s=time.perf_counter() - t0,
        )
        if batch.old_values is not None:
            metrics["value_mean"] = float(masked_mean(batch.old_values, mask).item())
        self.version += 1
        metrics["version"] = float(self.version)
        return metrics

    def prepare(self, samples: list[Sample], replay: list[Sample] | None = None) -> PreparedBatch:
        """Everything the update reads, computed together before it: old logprobs (or, in single pass,
        the mark that the training forward gives them), reference logprobs under a KL, the critic's
        values, token rewards (the outcome on the last generated token, minus the KL when folded in),
        advantages and returns, the ratio mask and truncated importance weights."""
        t0 = time.perf_counter()
        a = self.algo_cfg
        if replay and self.dp is not None:
            raise ValueError(
                "algorithm.replay_fraction > 0 is not available with a data-parallel learner: the replay "
                "term is computed on one process"
            )
        if replay and self.replay_term.one_process and (self.cp is not None or self.tp is not None):
            raise ValueError(
                f"algorithm.replay_loss={a.replay_loss} is computed on one process's whole vocabulary and "
                "sequence: not with trainer.context_parallel or tensor_parallel > 1; use replay_loss=nll"
            )
        batch = build_batch(samples, self.device)
        if self.moe is not None:
            self.moe.check_rollouts(batch)
        replay_batch = build_batch(replay, self.device) if replay else None
        mask = batch.loss_mask
        use_kl = self.kl_ctl.value > 0
        single_pass = self.single_pass(use_kl)
        if not single_pass:
            batch.old_logprobs = self.compute_logprobs(batch)
        if use_kl:
            batch.ref_logprobs = self.compute_ref_logprobs(batch)
        if self.critic is not None:
            batch.old_values = self.compute_values(batch)

        token_rewards = torch.zeros_like(mask)
        token_rewards[torch.arange(batch.size, device=self.device), last_token_index(mask)] = batch.rewards
        kl = None
        if use_kl and not single_pass:
            assert batch.old_logprobs is not None and batch.ref_logprobs is not None
            kl_tok = kl_estimate(batch.old_logprobs, batch.ref_logprobs, a.kl_estimator) * mask
            kl = float(masked_mean(kl_tok, mask).item())
            if a.kl_in_reward:
                token_rewards = token_rewards - self.kl_ctl.value * kl_tok
        adv = get_advantage(a.advantage)(
            token_rewards,
            mask,
            batch.group_ids,
            values=batch.old_values,
            gamma=a.gamma,
            lam=a.lam,
            normalize_std=a.normalize_std,
        )
        batch.advantages, batch.returns = adv.advantages, adv.returns
        if not single_pass:  # importance correction: behaviour (engine, maybe stale) -> learner
            assert batch.old_logprobs is not None
            batch.policy_mask = ratio_mask(
                batch.old_logprobs,
                batch.behavior_logprobs,
                mask,
                a.mask_ratio_low,
                a.mask_ratio_high,
                a.tis_level,
            )
            if a.tis_cap is not None:
                batch.is_weights = tis_weights(
                    batch.old_logprobs, batch.behavior_logprobs, mask, a.tis_cap, a.tis_level
                )
        return PreparedBatch(batch, adv, single_pass, use_kl, replay_batch, kl, time.perf_counter() - t0)

    def single_pass(self, use_kl: bool | None = None) -> bool:
        """Whether `prepare` takes the old logprobs from the training forward: one optimizer step over
        the whole batch (so the pre-update policy is the one being differentiated), and nothing needs the
        old logprobs before the update (no critic, no KL folded into the reward, no ratio masking)."""
        tc, a = self.trainer_cfg, self.algo_cfg
        use_kl = self.kl_ctl.value > 0 if use_kl is None else use_kl
        return (
            tc.single_pass_old_logprobs
            and self.dp is None  # each rank differentiates only its rows: the old logprobs need every row
            and self.batch_cfg.ppo_epochs == 1
            and self.batch_cfg.mini_batches == 1
            and self.critic is None
            and not (use_kl and a.kl_in_reward)
            and a.mask_ratio_low is None
            and a.mask_ratio_high is None
        )

    # ------------------------------------------------------------------------------------------
    # the optimisation

    def _clip_grad_norm(self, max_norm: float, params: list[Tensor] | None = None) -> Tensor:
        """Clip the policy's gradients (or those of `params`), summing cp ranks' partial gradients first."""
        params = self.trainable if params is None else params
        if self.cp is not None and self.dp is None:  # each rank holds its positions' gradient: sum them
            self.cp.all_reduce_grads(params)  # (under FSDP its reduce-scatter sums them)
        if self.tp is not None:  # replicated tensors and sharded DTensors: torch's clip cannot mix them
            from posttrain.train.distributed import clip_grad_norm

            return clip_grad_norm(params, max_norm)
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def _set_lr(self) -> float:
        return set_lr(self.optimizers, self.trainer_cfg, self.optimizer_steps)

    def update(self, prepared: PreparedBatch | Batch) -> dict[str, float]:
        """Optimise on a prepared batch (`prepare`'s, or a `Batch` with old_logprobs and advantages
        set); returns metrics."""
        if isinstance(prepared, Batch):
            b = prepared
            if b.old_logprobs is None or b.advantages is None:
                raise ValueError("update() needs batch.old_logprobs and batch.advantages (step() fills them)")
            zero = torch.zeros(b.size, dtype=torch.bool, device=b.advantages.device)
            returns = b.returns if b.returns is not None else b.advantages
            prepared = PreparedBatch(b, AdvantageOutput(b.advantages, returns, zero), False, False)
        return self._update(prepared)[0]

    def _update(self, prepared: PreparedBatch) -> tuple[dict[str, float], Tensor | None]:
        """(metrics, the training forward's detached logprobs where they are the old ones, else None)."""
        batch, replay = prepared.batch, prepared.replay
        if self.critic is not None and (batch.returns is None or batch.old_values is None):
            raise ValueError("update() with a critic needs batch.returns and batch.old_values")
        if self.optimizer_offloaded:
            self.reload_optimizer()
        tc, a = self.trainer_cfg, self.algo_cfg
        forward_logprobs = torch.zeros_like(batch.loss_mask) if prepared.old_from_forward else None
        sum_keys = [k for term in (*self.terms, *self.critic_terms) for k in term.sums]
        t0 = time.perf_counter()
        sums: dict[str, float] = {}
        counts: dict[str, float] = {}
        local_sums: dict[
            str, float
        ] = {}  # per micro-batch: this rank's share (reduced over ranks at the end)
        local_counts: dict[str, float] = {}

        def add(key: str, value: float, weight: float = 1.0) -> None:
            sums[key] = sums.get(key, 0.0) + value * weight
            counts[key] = counts.get(key, 0.0) + weight

        cells = tokens = computed = 0  # positions run (padding included), sequence tokens, real positions run
        ratio_max = 1.0
        self.model.train()
        if self.critic is not None:
            self.critic.train()
        try:
            for _ in range(self.batch_cfg.ppo_epochs):
                perm = torch.randperm(batch.size, generator=self.generator).tolist()
                n_mini = min(self.batch_cfg.mini_batches, batch.size)
                bounds = [round(i * batch.size / n_mini) for i in range(n_mini + 1)]
                for k in range(n_mini):
                    mb_rows = perm[bounds[k] : bounds[k + 1]]
                    mb = batch.select(mb_rows)
                    w_pol = aggregation_weights(mb.train_mask, a.loss_agg, a.loss_norm_tokens)
                    w_tok = aggregation_weights(mb.loss_mask, "token_mean")
                    lr = self._set_lr()
                    for opt in self.optimizers.all():
                        opt.zero_grad(set_to_none=True)
                    mb_sums = dict.fromkeys(sum_keys, 0.0)
                    micro = self._micro_batches(mb)
                    shares = [(m, 1.0) for m in micro] if self.dp is None else self.dp.share(micro)
                    for (rows, prefix), scale in shares:
                        counted = scale > 0  # a weight-0 repeat only keeps the ranks' collectives in step
                        mi = self._select(mb, rows, prefix)
                        width = mi.token_ids.shape[1]
                        ridx = torch.as_tensor(rows, device=self.device)
                        inputs = self._inputs(mi) if (prefix == 0 or self.critic is not None) else None
                        seq_tokens = int(mi.lengths.sum().item()) if counted else 0
                        tokens += seq_tokens
                        if counted and prefix > 0:  # the prefix once, then every row's suffix, unpadded
                            run = seq_tokens - (mi.size - 1) * prefix
                            computed, cells = computed + run, cells + run
                        elif counted:
                            assert inputs is not None
                            computed += inputs.tokens
                            cells += inputs.cells
                        lp, ent = self._policy_forward(self.model, mi, mi.loss_mask, inputs)
                        x = LossInputs(
                            logprobs=lp,
                            weights=w_pol[ridx, :width],
                            loss_mask=mi.loss_mask,
                            entropy=ent,
                            mask=mi.train_mask,
                            old_logprobs=mi.old_logprobs,
                            ref_logprobs=mi.ref_logprobs,
                            behavior_logprobs=mi.behavior_logprobs,
                            advantages=mi.advantages,
                            is_weights=mi.is_weights,
                            token_weights=w_tok[ridx, :width],
                            old_values=mi.old_values,
                            returns=mi.returns,
                            token_share=float(mi.lengths.sum()) / float(mb.lengths.sum()),
                            grad_scale=scale,
                        )
                        if forward_logprobs is not None:  # single pass: the old policy is this forward's
                            x.old_logprobs = lp.detach().to(batch.loss_mask.dtype)
                            brows = torch.as_tensor([mb_rows[r] for r in rows], device=self.device)
                            forward_logprobs[brows, :width] = x.old_logprobs
                            if a.tis_cap is not None:
                                x.is_weights = tis_weights(
                                    x.old_logprobs, mi.behavior_logprobs, mi.loss_mask, a.tis_cap, a.tis_level
                                )
                        loss, results = add_terms(self.terms, x)
                        assert loss is not None
                        (loss if scale == 1.0 else loss * scale).backward()
                        if self.critic_terms:  # a weight-0 repeat too: a sharded critic's collectives
                            x.values = self.value_forward(mi, mi.loss_mask, inputs)
                            critic_loss, critic_results = add_terms(self.critic_terms, x)
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
                            term = self.replay_term.backward(self, sub, a.replay_coef)
                            add(self.replay_term.metric, term, float(sub.loss_mask.sum().item()))
                    if self.dp is not None:
                        mb_sums = dict(zip(mb_sums, self.dp.sum_(list(mb_sums.values())), strict=True))
                    grad_norm = self._clip_grad_norm(tc.max_grad_norm)
                    self.optimizer.step()
                    if self.critic is not None and self.critic_optimizer is not None:
                        critic_params = list(self.critic.parameters())
                        add(
                            "critic_grad_norm",
                            full_value(self._clip_grad_norm(tc.max_grad_norm, critic_params)),
                        )
                        self.critic_optimizer.step()
                    self.optimizer_steps += 1
                    for key, v in mb_sums.items():
                        add(key, v)
                    add("grad_norm", full_value(grad_norm))
                    add("lr", lr)
        finally:
            self.model.eval()
            if self.critic is not None:
                self.critic.eval()
        if self.dp is not None:
            local_sums, local_counts = self.dp.reduce_weighted(local_sums, local_counts)
            tokens, computed, cells = (int(x) for x in self.dp.sum_([tokens, computed, cells]))
            ratio_max = self.dp.max_(ratio_max)
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
            optimizer_steps=float(self.optimizer_steps),
        )
        return out_metrics, forward_logprobs

    # ------------------------------------------------------------------------------------------
    # supervised and preference steps (train/offline.py)

    def sft_step(self, samples: list[Sample]) -> dict[str, float]:
        """One supervised optimizer step on `samples`: the token-mean negative log-likelihood (at
        temperature 1) of their loss-masked tokens, accumulated over token-budgeted micro-batches
        (batch.micro_batch_tokens), clipped (trainer.max_grad_norm), AdamW at the scheduled LR.

        Metrics: loss (the NLL before the step), tokens (trained on), sequences, sequence_tokens,
        grad_norm, lr, update_tokens_per_s, step_s, optimizer_steps, version."""
        return offline.sft_step(self, samples)

    def sft_loss(self, samples: list[Sample]) -> dict[str, float]:
        """The token-mean NLL (temperature 1) of `samples`' loss-masked tokens, without training:
        {"loss", "tokens", "sequences"}."""
        return offline.sft_loss(self, samples)

    def preference_step(
        self, chosen: list[Sample], rejected: list[Sample], loss: str, **params: Any
    ) -> dict[str, float]:
        """One optimizer step of the registered preference loss `loss` (algos.preference) on the pairs
        (chosen[i], rejected[i]): per-sequence logprobs summed over each loss mask at temperature 1,
        the reference's from the base with adapters off (LoRA) or the frozen copy (full), the pair
        losses averaged; micro-batched by pairs (batch.micro_batch_tokens), clipped, AdamW.

        Metrics: loss, chosen_reward, rejected_reward, margin (their mean gap), accuracy (share of pairs
        whose chosen response has the higher implicit reward), pairs, tokens, grad_norm, lr, step_s,
        optimizer_steps, version. The figures are of the policy before the step."""
        return offline.preference_step(self, chosen, rejected, loss, params)

    def preference_eval(
        self, chosen: list[Sample], rejected: list[Sample], loss: str, **params: Any
    ) -> dict[str, float]:
        """`preference_step`'s loss, rewards, margin and accuracy on the pairs, without training."""
        return offline.preference_eval(self, chosen, rejected, loss, params)

    # ------------------------------------------------------------------------------------------
    # weights, images and state

    def weights(self) -> dict[str, Tensor]:
        """HF-named policy weights for the engine; LoRA deltas merged in (the model is not modified).

        For full fine-tuning the tensors share storage with the live parameters: copy them if they
        must stay fixed while the learner trains on."""
        from posttrain.train.state import merged_weights

        if self.dp is not None or self.tp is not None:
            from posttrain.train.distributed import full_weights

            return full_weights(self)
        return merged_weights(self.model)

    def lora_base(self) -> dict[str, Tensor]:
        """The LoRA-adapted modules' base weights, whole (train/weights.py `lora_base`)."""
        return lora_base(self.model)

    def lora_update(self, version: int) -> WeightUpdate:
        """The policy's LoRA adapters as an update of `version` (train/weights.py `lora_update`)."""
        return lora_update(self.model, version)

    @property
    def image_store(self) -> Any:
        """Where a vision-language policy reads its rollouts' images from (None for text models)."""
        return self.vision.store if self.vision is not None else None

    def attach_image_store(self, store: Any) -> None:
        """Read images from `store` (a content-addressed image store); a text model has none to read."""
        if self.vision is not None:
            self.vision.store = store

    def state_dict(self) -> dict[str, Any]:
        from posttrain.train.state import learner_state_dict

        return learner_state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from posttrain.train.state import load_learner_state_dict

        load_learner_state_dict(self, state)

    def save(self, directory: str) -> None:
        from posttrain.train.state import save_learner

        save_learner(self, directory)

    @classmethod
    def load(cls, directory: str, model: Any = None, critic_model: Any = None) -> Learner:
        """Rebuild a Learner from the configs saved with it and restore its state."""
        from posttrain.train.state import read_learner_state, sections_of

        meta, state = read_learner_state(directory)
        trainer, algorithm, batch = sections_of(meta)
        learner = cls(
            ModelConfig(**meta["model"]),
            TrainerConfig(**trainer),
            AlgorithmConfig(**algorithm),
            seed=int(meta["seed"]),
            model=model,
            critic_model=critic_model,
            batch_cfg=BatchConfig(**batch),
        )
        learner.load_state_dict(state)
        return learner

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return self.optimizers.all()

    def offload_optimizer(self) -> None:
        """Move AdamW state to CPU memory (frees accelerator memory for the engine). On a CPU-only
        learner the state already lives in CPU memory: nothing moves, only the flag is recorded."""
        if self.device.type != "cpu":
            move_optimizer_state(self._optimizers(), torch.device("cpu"))
        self.optimizer_offloaded = True

    def reload_optimizer(self) -> None:
        """Move AdamW state back to the learner's device (a no-op on CPU)."""
        if self.device.type != "cpu":
            move_optimizer_state(self._optimizers(), self.device)
        self.optimizer_offloaded = False
