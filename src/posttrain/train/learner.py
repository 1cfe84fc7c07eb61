"""The Learner: owns the parts (built in train/parts.py, split by a `ParallelPlan`), the optimizers
built from them (train/optim.py), the loss terms (train/terms.py) and the counters, and runs the
forward passes over them.

`step(samples)` is `prepare` then `update` (train/update.py): everything the update reads computed
together, then the micro-batch loop summing the terms. SFT and preference steps are term sets in
train/offline.py; replay terms in train/replay.py. Knows nothing about environments.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from torch import Tensor

from posttrain.algos import (
    AdvantageOutput,
    get_advantage,
    kl_estimate,
    make_kl_controller,
    masked_mean,
    mismatch_metrics,
)
from posttrain.config import AlgorithmConfig, BatchConfig, ModelConfig, TrainerConfig, check_critic
from posttrain.train.batch import (
    Batch,
    ModelInputs,
    Sample,
    build_batch,
    make_inputs,
    plan_micro_batches,
    plan_shared_micro_batches,
)
from posttrain.train.distributed import DataParallel, ParallelPlan, Placement, TensorParallel
from posttrain.train.forward import (
    Targets,
    causal_lm,
    chunked_logprobs,
    decoder_hidden,
    scatter_rows,
    select_targets,
    shared_prefix_hidden,
)
from posttrain.train.offline import preference_eval, preference_step, sft_loss, sft_step
from posttrain.train.optim import (
    Optimizers,
    build_optimizers,
    lr_factor,
    make_adamw,
    move_optimizer_state,
    set_lr,
)
from posttrain.train.parts import CRITIC_CHOICES, build_parts, group_rank, learner_device
from posttrain.train.replay import REPLAY_TERMS
from posttrain.train.terms import EntropyTerm, critic_terms, policy_loss_term, policy_terms
from posttrain.train.update import PreparedBatch, prepare_batch, run_update
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


class Learner:
    """Owns the trainable policy, the critic, the reference, their optimizers and the loss terms (see the
    module doc). Implements `train.protocol.LearnerProtocol`."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        trainer_cfg: TrainerConfig,
        algo_cfg: AlgorithmConfig | None = None,
        seed: int = 0,
        model: Any = None,
        critic_model: Any = None,
        batch_cfg: BatchConfig | None = None,
        keep_reference: bool = False,
        plan: ParallelPlan | None = None,
    ) -> None:
        """`algo_cfg`: the RL step's (None: its defaults; the SFT and preference steps read none of it).
        `keep_reference`: full fine-tuning keeps a frozen copy of the initial policy even when
        algorithm.kl_coef is 0 (preference losses compare with it; so does a replay term that needs it);
        LoRA's reference is always the base. The parts go to trainer.device (`learner_device`; this
        process's rank in an initialised torch.distributed group picks its GPU). `plan`: how the parts
        are split before the optimizers are built from them (a rank of a learner group passes
        `ParallelPlan.of(trainer)`); by default only context parallelism, when it is the only split."""
        algo_cfg = algo_cfg if algo_cfg is not None else AlgorithmConfig()
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
        # this rank's places once a plan split the parts (`replan`); None: not split that way
        self.dp: DataParallel | None = None
        self.tp: TensorParallel | None = None
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
        self.plan = plan
        self._apply_plan(plan)  # splits the parts, then builds the optimizers from them

    def replan(self, plan: ParallelPlan) -> Placement:
        """Split the parts of a Learner built unsplit (its plan split nothing by data or tensor
        parallelism) and never updated as `plan` says, and rebuild the optimizers from the split parts
        (`train.distributed.shard_learner` and its siblings are shorthands for this). Returns this
        rank's `Placement` (its places, and the mesh of a 2-D or 3-D plan)."""
        if self.dp is not None or self.tp is not None:
            raise ValueError(
                f"this learner is already split (plan {self.plan}); a learner is split once, before its "
                "first update"
            )
        placed = self._apply_plan(plan)
        self.plan = plan
        return placed

    def _apply_plan(self, plan: ParallelPlan) -> Placement:
        placed = plan.split(self)
        self.dp, self.tp, self.cp = placed.dp, placed.tp, placed.cp
        self.optimizers = build_optimizers(
            self.model, self.critic, self.trainer_cfg, placed.optimizer_factory
        )
        return placed

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

    def model_inputs(self, batch: Batch) -> ModelInputs:
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
        h, targets = self.target_hidden(model, batch, mask, inputs)
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

    def target_hidden(
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
            inputs = inputs if inputs is not None else self.model_inputs(batch)
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
        inputs = inputs if inputs is not None else self.model_inputs(batch)
        targets = select_targets(mask, batch.token_ids, inputs.flat_offset)
        with self._autocast():
            v = self.critic(inputs, targets.src)
        return scatter_rows(v.float(), targets, tuple(batch.token_ids.shape))

    def micro_batches(self, batch: Batch) -> list[tuple[list[int], int]]:
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
    def select_rows(batch: Batch, rows: list[int], prefix: int) -> Batch:
        sub = batch.select(rows)
        sub.meta["shared_prefix"] = prefix
        return sub

    @torch.no_grad()
    def _no_grad_map(self, batch: Batch, fn: Any) -> Tensor:
        out = torch.zeros_like(batch.loss_mask)
        for rows, prefix in self.micro_batches(batch):
            sub = self.select_rows(batch, rows, prefix)
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
        for rows, prefix in self.micro_batches(batch):
            sub = self.select_rows(batch, rows, prefix)
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
        result = run_update(self, prepared)
        metrics.update(result.metrics)
        old = result.old_logprobs  # prepare's, or in single pass the training forward's
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
        """Everything the update reads, computed together before it (train/update.py `prepare_batch`)."""
        return prepare_batch(self, samples, replay)

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

    def count_optimizer_step(self, new_version: bool = False) -> None:
        """Count one optimizer step taken (train/update.py, once per mini-batch); `new_version`: the step
        also made a new policy version (an SFT or preference step; the RL step counts its own)."""
        self.optimizer_steps += 1
        if new_version:
            self.version += 1

    def restore_counters(
        self,
        version: int,
        optimizer_steps: int,
        entropy_coef: float | None = None,
        optimizer_loaded: bool = False,
    ) -> None:
        """Set the counters a checkpoint holds (train/state.py, train/distributed.py `load_sharded`):
        the policy version, the optimizer steps, the entropy coefficient (None: keep the current one);
        `optimizer_loaded`: the optimizers' state was just loaded beside the parts (not offloaded)."""
        self.version, self.optimizer_steps = int(version), int(optimizer_steps)
        if entropy_coef is not None:
            self.entropy_coef = float(entropy_coef)
        if optimizer_loaded:
            self.optimizer_offloaded = False

    def clip_grad_norm(self, max_norm: float, params: list[Tensor] | None = None) -> Tensor:
        """Clip the policy's gradients (or those of `params`), summing cp ranks' partial gradients first."""
        params = self.trainable if params is None else params
        if self.cp is not None and self.dp is None:  # each rank holds its positions' gradient: sum them
            self.cp.all_reduce_grads(params)  # (under FSDP its reduce-scatter sums them)
        if self.tp is not None:  # replicated tensors and sharded DTensors: torch's clip cannot mix them
            from posttrain.train.distributed import clip_grad_norm

            return clip_grad_norm(params, max_norm)
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def set_lr(self) -> float:
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
            prepared = PreparedBatch(b, AdvantageOutput(b.advantages, returns, zero), b.old_logprobs, False)
        return run_update(self, prepared).metrics

    # ------------------------------------------------------------------------------------------
    # supervised and preference steps (train/offline.py)

    def sft_step(self, samples: list[Sample]) -> dict[str, float]:
        """One supervised optimizer step on `samples`: the token-mean negative log-likelihood (at
        temperature 1) of their loss-masked tokens, accumulated over token-budgeted micro-batches
        (batch.micro_batch_tokens), clipped (trainer.max_grad_norm), AdamW at the scheduled LR.

        Metrics: loss (the NLL before the step), tokens (trained on), sequences, sequence_tokens,
        grad_norm, lr, update_tokens_per_s, step_s, optimizer_steps, version."""
        return sft_step(self, samples)

    def sft_loss(self, samples: list[Sample]) -> dict[str, float]:
        """The token-mean NLL (temperature 1) of `samples`' loss-masked tokens, without training:
        {"loss", "tokens", "sequences"}."""
        return sft_loss(self, samples)

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
        return preference_step(self, chosen, rejected, loss, params)

    def preference_eval(
        self, chosen: list[Sample], rejected: list[Sample], loss: str, **params: Any
    ) -> dict[str, float]:
        """`preference_step`'s loss, rewards, margin and accuracy on the pairs, without training."""
        return preference_eval(self, chosen, rejected, loss, params)

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
