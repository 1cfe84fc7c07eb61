"""The Learner: policy (full or LoRA), optional critic and reference, and the RL update on a batch.

`step(samples)` computes old/reference logprobs, values, rewards (with KL folded in if asked),
advantages through the `posttrain.algos` registry, importance corrections against the engine's
behaviour logprobs, then `update()`: mini-batches x PPO epochs, token-budgeted micro-batches with
gradient accumulation, clipping, AdamW and the LR schedule. Knows nothing about environments.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.algos import (
    aggregation_weights,
    get_advantage,
    get_policy_loss,
    get_preference_loss,
    kl_estimate,
    make_kl_controller,
    masked_mean,
    masked_nll,
    mismatch_metrics,
    preference_needs_reference,
    ratio_mask,
    tis_weights,
    value_loss,
)
from posttrain.config import AlgorithmConfig, BatchConfig, ModelConfig, TrainerConfig
from posttrain.longctx.rope import apply_rope_scaling, check_rope_scaling, rope_parameters
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
from posttrain.train.distributed import full_value
from posttrain.train.forward import (
    Targets,
    ValueModel,
    causal_lm,
    chunked_forward_kl,
    chunked_logprobs,
    decoder_hidden,
    scatter_rows,
    select_targets,
    shared_prefix_hidden,
)
from posttrain.train.moe import MoeRouting
from posttrain.train.vision import set_vision_trainable, vision_learner

CRITIC_CHOICES = ("none", "copy", "separate")


def lr_factor(step: int, warmup_steps: int, schedule: str, decay_steps: int) -> float:
    """Multiplier of the base LR at optimizer step `step` (0-based): linear warmup, then the schedule."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if decay_steps <= 0:
        raise ValueError(
            f"trainer.lr_schedule={schedule} needs trainer.lr_decay_steps > 0 (total optimizer steps)"
        )
    progress = min(max((step - warmup_steps) / max(1, decay_steps - warmup_steps), 0.0), 1.0)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - progress
    raise ValueError(f"unknown lr_schedule '{schedule}'; choose constant, cosine or linear")


def make_adamw(params: list[nn.Parameter], lr: float, betas: tuple, weight_decay: float) -> torch.optim.AdamW:
    """AdamW, fused where torch has a fused kernel for these tensors (about 10x faster on CPU than the
    per-parameter loop: the optimizer step is memory-bound)."""
    fused = all(
        p.dtype in (torch.float32, torch.bfloat16, torch.float16) and p.device.type in ("cpu", "cuda")
        for p in params
    )
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused or None)


def learner_device(device: str, rank: int | None = None) -> torch.device:
    """The torch device of trainer.device `device` in this process: cpu; cuda:N as given; plain cuda is
    cuda:(rank % the GPUs this process sees) for learner rank `rank` (one GPU per rank, as NCCL wants),
    cuda:0 outside a rank group. Raises ValueError naming trainer.device where that GPU is not there."""
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            f"trainer.device={device}, but torch.cuda.is_available() is false in this process (no GPU "
            "visible, or a CPU-only torch build); set trainer.device=cpu"
        )
    count = torch.cuda.device_count()
    index = device.partition(":")[2]
    if index:
        if int(index) >= count:
            raise ValueError(f"trainer.device={device}, but this process sees {count} GPU(s): cuda:0..")
        return torch.device("cuda", int(index))
    return torch.device("cuda", (rank or 0) % count)


def group_rank() -> int | None:
    """This process's rank on its node in an initialised torch.distributed group (LOCAL_RANK where a
    launcher set it, else the group rank), or None outside one."""
    import os

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return int(os.environ.get("LOCAL_RANK", dist.get_rank()))


class Learner:
    """Owns the trainable policy, the critic, the reference and their optimizers (see the package doc)."""

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
    ) -> None:
        """`keep_reference`: full fine-tuning keeps a frozen copy of the initial policy even when
        algorithm.kl_coef is 0 (preference losses compare with it; so does algorithm.replay_loss=kl);
        LoRA's reference is always the base.
        The policy (`model` too, when one is handed in), reference and critic go to trainer.device
        (`learner_device`; this process's rank in an initialised torch.distributed group picks its GPU)."""
        from posttrain.models import load_policy, wrap_lora

        self.model_cfg, self.trainer_cfg, self.algo_cfg, self.seed = model_cfg, trainer_cfg, algo_cfg, seed
        self.batch_cfg = batch_cfg if batch_cfg is not None else BatchConfig()
        get_advantage(algo_cfg.advantage)  # fail early on unknown names
        get_policy_loss(algo_cfg.policy_loss)
        if algo_cfg.advantage == "gae" and trainer_cfg.critic == "none":
            raise ValueError(
                "algorithm.advantage=gae needs a value function: set trainer.critic to 'copy' or 'separate'"
            )
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

        torch.manual_seed(seed)
        if model is None:
            model = apply_rope_scaling(
                load_policy(model_cfg.spec, dtype=model_cfg.dtype, seed=seed), model_cfg.rope_scaling
            )
        elif model_cfg.rope_scaling is not None:
            check_rope_scaling(causal_lm(model), model_cfg.rope_scaling)
        self.dynamic_rope = rope_parameters(causal_lm(model).config)["rope_type"] == "dynamic"
        # the policy moves before the reference and a critic copy are made from it: all on one device
        self.device = learner_device(trainer_cfg.device, group_rank())
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL collectives of a rank group run on it
        model = model.to(self.device)
        self.lora = model_cfg.lora_rank > 0
        # vision-language policies: images replayed through the model's own tower (train/vision.py)
        self.vision = vision_learner(model_cfg, causal_lm(model))

        critic_backbone: nn.Module | None = None
        if trainer_cfg.critic == "copy":
            critic_backbone = copy.deepcopy(causal_lm(model).get_decoder())
            hidden_size = causal_lm(model).config.hidden_size
        elif trainer_cfg.critic == "separate":
            cm = critic_model
            if cm is None:
                cm = apply_rope_scaling(
                    load_policy(trainer_cfg.critic_spec, seed=seed), model_cfg.rope_scaling
                )
            critic_backbone = causal_lm(cm).get_decoder()
            hidden_size = causal_lm(cm).config.hidden_size

        self.reference: Any = None
        keep_reference = keep_reference or algo_cfg.replay_loss == "kl"
        if not self.lora and (algo_cfg.kl_coef > 0 or keep_reference):
            self.reference = copy.deepcopy(model).eval()
            for p in self.reference.parameters():
                p.requires_grad_(False)
        if self.lora:
            model = wrap_lora(
                model,
                model_cfg.lora_rank,
                model_cfg.lora_alpha,
                model_cfg.lora_dropout,
                model_cfg.lora_target_modules,
                exclude_modules=self.vision.family.peft_exclude if self.vision is not None else None,
            )
        if self.vision is not None:  # after LoRA, which freezes all but its adapters
            v = model_cfg.vision
            set_vision_trainable(causal_lm(model), self.vision.family, v.train_tower, v.train_projector)
        self.model = model.to(self.device)
        # MoE policies: routing replay, a frozen router, aux losses, routing metrics (train/moe.py)
        self.moe = MoeRouting.attach(self.model, trainer_cfg.moe, trainer_cfg.gradient_checkpointing)
        self.model.eval()
        if trainer_cfg.gradient_checkpointing:
            lm = causal_lm(self.model)
            enable = getattr(lm, "activation_checkpointing_enable", None)
            if enable is not None:  # transformers >= 5
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        self.critic: ValueModel | None = None
        if critic_backbone is not None:
            self.critic = ValueModel(critic_backbone, hidden_size).to(self.device)
            for p in self.critic.parameters():
                p.requires_grad_(True)
            self.critic.eval()

        betas = tuple(trainer_cfg.betas)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        if not self.trainable:
            raise ValueError("the policy has no trainable parameters")
        self.optimizer = make_adamw(self.trainable, trainer_cfg.lr, betas, trainer_cfg.weight_decay)
        self.critic_optimizer = (
            make_adamw(list(self.critic.parameters()), trainer_cfg.critic_lr, betas, trainer_cfg.weight_decay)
            if self.critic is not None
            else None
        )
        self.kl_ctl = make_kl_controller(algo_cfg.kl_coef, algo_cfg.kl_target, algo_cfg.kl_horizon)
        self.entropy_coef = float(algo_cfg.entropy_coef)  # moves under algorithm.entropy_floor
        self.generator = torch.Generator().manual_seed(seed)
        self.version = 0
        self.optimizer_steps = 0
        self.optimizer_offloaded = False
        self.pad_id = int(getattr(causal_lm(self.model).config, "pad_token_id", None) or 0)
        self.dp: Any = None  # a train.distributed.DataParallel once shard_learner() made this a rank
        self.tp: Any = None  # a train.distributed.TensorParallel once tensor_parallel_learner() split it
        self.cp: Any = None  # a train.context_parallel.ContextParallel under trainer.context_parallel > 1
        if trainer_cfg.context_parallel > 1:
            from posttrain.train.context_parallel import context_parallel_learner

            if self.vision is not None:
                raise ValueError(
                    "trainer.context_parallel > 1 does not run vision-language policies (their images "
                    "enter at the embeddings on the single-process path); set it to 1"
                )
            if trainer_cfg.data_parallel == 1 and trainer_cfg.tensor_parallel == 1:
                # else train.distributed.parallelize_dp_cp makes the mesh
                self.cp = context_parallel_learner(self)

    # ------------------------------------------------------------------------------------------
    # forward passes

    def _autocast(self) -> Any:
        if self.trainer_cfg.bf16_autocast:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return torch.autocast(device_type=self.device.type, enabled=False)

    def _inputs(self, batch: Batch) -> ModelInputs:
        return make_inputs(batch.token_ids, batch.lengths, self.trainer_cfg.packing, self.pad_id)

    def _policy_forward(
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

    def _value_forward(self, batch: Batch, mask: Tensor, inputs: ModelInputs | None = None) -> Tensor:
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
        return self._no_grad_map(batch, lambda sub: self._value_forward(sub, sub.loss_mask))

    # ------------------------------------------------------------------------------------------
    # the RL step

    def step(
        self, samples: list[Sample], current_version: int | None = None, replay: list[Sample] | None = None
    ) -> dict[str, float]:
        """The whole RL update for one batch of samples; returns metrics. Bumps `version`.

        `replay`: supervised samples mixed into the update (general data, `orchestrator.replay`): each
        optimizer step adds algorithm.replay_coef x the replay term (`_replay_backward`: token-mean NLL,
        or the full-vocabulary KL from the initial policy) of its share of them (split over the
        mini-batches in order) to the RL loss. Metrics `replay_nll` or `replay_kl` (before the step),
        `replay_sequences`, `replay_tokens`."""
        t0 = time.perf_counter()
        a = self.algo_cfg
        if replay and self.dp is not None:
            raise ValueError(
                "algorithm.replay_fraction > 0 is not available with a data-parallel learner: the replay "
                "term is computed on one process"
            )
        if replay and a.replay_loss == "kl" and (self.cp is not None or self.tp is not None):
            raise ValueError(
                "algorithm.replay_loss=kl is computed on one process's whole vocabulary and sequence: not "
                "with trainer.context_parallel or tensor_parallel > 1; use replay_loss=nll"
            )
        batch = build_batch(samples, self.device)
        if self.moe is not None:
            self.moe.check_rollouts(batch)
        replay_batch = build_batch(replay, self.device) if replay else None
        mask = batch.loss_mask
        current = self.version if current_version is None else current_version
        metrics: dict[str, float] = {}

        use_kl = self.kl_ctl.value > 0
        single_pass = self.single_pass(use_kl)
        if not single_pass:
            batch.old_logprobs = self.compute_logprobs(batch)
        if use_kl:
            batch.ref_logprobs = self.compute_ref_logprobs(batch)
        if self.critic is not None:
            batch.old_values = self.compute_values(batch)
        t_prep = time.perf_counter()

        # token rewards: the outcome reward on the last generated token, minus beta * KL if folded in
        token_rewards = torch.zeros_like(mask)
        last = last_token_index(mask)
        token_rewards[torch.arange(batch.size, device=self.device), last] = batch.rewards
        if use_kl and not single_pass:
            kl_tok = kl_estimate(batch.old_logprobs, batch.ref_logprobs, a.kl_estimator) * mask
            metrics["kl"] = float(masked_mean(kl_tok, mask).item())
            if a.kl_in_reward:
                token_rewards = token_rewards - self.kl_ctl.value * kl_tok
        adv_out = get_advantage(a.advantage)(
            token_rewards,
            mask,
            batch.group_ids,
            values=batch.old_values,
            gamma=a.gamma,
            lam=a.lam,
            normalize_std=a.normalize_std,
        )
        batch.advantages, batch.returns = adv_out.advantages, adv_out.returns

        if single_pass:
            # old logprobs, TIS weights and the KL come from the training forward itself (see _update)
            metrics.update(self._update(batch, single_pass=True, replay=replay_batch))
            if use_kl:
                assert batch.old_logprobs is not None and batch.ref_logprobs is not None
                kl_tok = kl_estimate(batch.old_logprobs, batch.ref_logprobs, a.kl_estimator) * mask
                metrics["kl"] = float(masked_mean(kl_tok, mask).item())
        else:
            # importance correction: behaviour (engine, maybe stale) -> learner before the update
            self._importance(batch)
            metrics.update(self._update(batch, replay=replay_batch))
        assert batch.old_logprobs is not None
        metrics.update(
            mismatch_metrics(batch.old_logprobs, batch.behavior_logprobs, mask, a.tis_cap, batch.policy_mask)
        )

        if use_kl and a.kl_control == "batch":  # "drift": the run steers it from the drift probe
            self.kl_ctl.update(metrics["kl"], batch.size)
        if a.entropy_floor is not None and "entropy" in metrics:
            step = a.entropy_floor_lr * (a.entropy_floor - metrics["entropy"])
            self.entropy_coef = max(0.0, self.entropy_coef + step)
            metrics["entropy_coef"] = self.entropy_coef
        if self.moe is not None:
            metrics.update(self.moe.pop_metrics())
        groups = torch.unique(batch.group_ids)
        zero_groups = torch.unique(batch.group_ids[adv_out.zero_signal])
        staleness = (current - batch.policy_versions).float()
        metrics.update(
            reward_mean=float(batch.rewards.mean().item()),
            reward_std=float(batch.rewards.std().item()) if batch.size > 1 else 0.0,
            zero_signal_group_frac=float(zero_groups.numel() / max(groups.numel(), 1)),
            advantage_mean=float(masked_mean(batch.advantages, mask).item()),
            advantage_abs_mean=float(masked_mean(batch.advantages.abs(), mask).item()),
            kl_coef=float(self.kl_ctl.value),
            staleness_mean=float(staleness.mean().item()),
            staleness_max=float(staleness.max().item()),
            sequences=float(batch.size),
            tokens=float(mask.sum().item()),
            sequence_tokens=float(batch.lengths.sum().item()),
            prepare_s=t_prep - t0,
            step_s=time.perf_counter() - t0,
        )
        if batch.old_values is not None:
            metrics["value_mean"] = float(masked_mean(batch.old_values, mask).item())
        self.version += 1
        metrics["version"] = float(self.version)
        return metrics

    def single_pass(self, use_kl: bool | None = None) -> bool:
        """Whether `step` takes the old logprobs from the training forward: one optimizer step over the
        whole batch (so the pre-update policy is the one being differentiated), and nothing needs the
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

    def _importance(self, batch: Batch) -> None:
        """Ratio mask and TIS weights of behaviour (engine, maybe stale) -> learner before the update."""
        a = self.algo_cfg
        assert batch.old_logprobs is not None
        batch.policy_mask = ratio_mask(
            batch.old_logprobs,
            batch.behavior_logprobs,
            batch.loss_mask,
            a.mask_ratio_low,
            a.mask_ratio_high,
            a.tis_level,
        )
        if a.tis_cap is not None:
            batch.is_weights = tis_weights(
                batch.old_logprobs, batch.behavior_logprobs, batch.loss_mask, a.tis_cap, a.tis_level
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

    def _clip_critic_grad_norm(self, max_norm: float) -> float:
        assert self.critic is not None
        return full_value(self._clip_grad_norm(max_norm, list(self.critic.parameters())))

    def _set_lr(self) -> float:
        tc = self.trainer_cfg
        f = lr_factor(self.optimizer_steps, tc.warmup_steps, tc.lr_schedule, tc.lr_decay_steps)
        for g in self.optimizer.param_groups:
            g["lr"] = tc.lr * f
        if self.critic_optimizer is not None:
            for g in self.critic_optimizer.param_groups:
                g["lr"] = tc.critic_lr * f
        return tc.lr * f

    def update(self, batch: Batch) -> dict[str, float]:
        """Optimise on a prepared batch (old_logprobs and advantages set); returns metrics."""
        if batch.old_logprobs is None or batch.advantages is None:
            raise ValueError("update() needs batch.old_logprobs and batch.advantages (step() fills them)")
        return self._update(batch)

    def _update(
        self, batch: Batch, single_pass: bool = False, replay: Batch | None = None
    ) -> dict[str, float]:
        """`update`; with `single_pass` the batch has no old logprobs yet: each micro-batch's are its own
        training-forward logprobs, detached (the ratio is exactly 1, the gradient the same), its TIS
        weights are computed from them, and `batch.old_logprobs` / `is_weights` are filled in.
        `replay`: supervised rows, split over the mini-batches in order (see `step`)."""
        if batch.advantages is None:
            raise ValueError("update() needs batch.advantages (step() fills them)")
        if self.critic is not None and (batch.returns is None or batch.old_values is None):
            raise ValueError("update() with a critic needs batch.returns and batch.old_values")
        if self.optimizer_offloaded:
            self.reload_optimizer()
        tc, a = self.trainer_cfg, self.algo_cfg
        if single_pass:
            batch.old_logprobs = torch.zeros_like(batch.loss_mask)
            if a.tis_cap is not None:
                batch.is_weights = torch.zeros_like(batch.loss_mask)
        policy_loss_fn = get_policy_loss(a.policy_loss)
        # GSPO clips a sequence ratio, whose useful range is ~1e-4, not PPO's token-ratio 0.2
        clip_low, clip_high = (
            (a.gspo_clip_low, a.gspo_clip_high) if a.policy_loss == "gspo" else (a.clip_low, a.clip_high)
        )
        use_kl_loss = batch.ref_logprobs is not None and not a.kl_in_reward and self.kl_ctl.value > 0
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

        def add_local(key: str, value: float, weight: float = 1.0) -> None:
            local_sums[key] = local_sums.get(key, 0.0) + value * weight
            local_counts[key] = local_counts.get(key, 0.0) + weight

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
                    self.optimizer.zero_grad(set_to_none=True)
                    if self.critic_optimizer is not None:
                        self.critic_optimizer.zero_grad(set_to_none=True)
                    mb_loss = mb_vloss = 0.0
                    micro = self._micro_batches(mb)
                    shares = [(m, 1.0) for m in micro] if self.dp is None else self.dp.share(micro)
                    for (rows, prefix), scale in shares:
                        counted = scale > 0  # a weight-0 repeat only keeps the ranks' collectives in step
                        mi = self._select(mb, rows, prefix)
                        width = mi.token_ids.shape[1]
                        ridx = torch.as_tensor(rows, device=self.device)
                        wp, wt = w_pol[ridx, :width], w_tok[ridx, :width]
                        mmask = mi.train_mask
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
                        if single_pass:
                            brows = torch.as_tensor([mb_rows[r] for r in rows], device=self.device)
                            mi.old_logprobs = lp.detach().to(batch.loss_mask.dtype)
                            batch.old_logprobs[brows, :width] = mi.old_logprobs
                            if a.tis_cap is not None:
                                mi.is_weights = tis_weights(
                                    mi.old_logprobs,
                                    mi.behavior_logprobs,
                                    mi.loss_mask,
                                    a.tis_cap,
                                    a.tis_level,
                                )
                                batch.is_weights[brows, :width] = mi.is_weights
                        out = policy_loss_fn(
                            lp,
                            mi.old_logprobs,
                            mi.advantages,
                            mmask,
                            clip_low=clip_low,
                            clip_high=clip_high,
                            dual_clip=a.dual_clip,
                            weights=mi.is_weights,
                        )
                        loss = (out.loss_tokens * wp).sum()
                        pg = float(loss.item())
                        moe_loss = self.moe.loss() if self.moe is not None else None
                        if moe_loss is not None:  # this micro-batch's share of the mini-batch's tokens
                            loss = loss + moe_loss * (float(mi.lengths.sum()) / float(mb.lengths.sum()))
                        if self.entropy_coef != 0.0:
                            loss = loss - self.entropy_coef * (ent * wp).sum()
                        if use_kl_loss:
                            kl_tok = kl_estimate(lp, mi.ref_logprobs, a.kl_estimator) * mi.loss_mask
                            kl_term = (kl_tok * wp).sum()
                            loss = loss + self.kl_ctl.value * kl_term
                            if counted:
                                add_local("kl_loss", float(kl_term.item()))
                        (loss if scale == 1.0 else loss * scale).backward()
                        if self.critic is not None:  # a weight-0 repeat too: a sharded critic's collectives
                            v = self._value_forward(mi, mi.loss_mask, inputs)
                            vl, vclipped = value_loss(
                                v, mi.old_values, mi.returns, mi.loss_mask, a.value_clip
                            )
                            vloss = (vl * wt).sum()
                            (a.value_coef * scale * vloss).backward()
                            if counted:
                                mb_vloss += float(vloss.item())
                                nv = float(mi.loss_mask.sum().item())
                                add_local(
                                    "vf_clipfrac",
                                    float(vclipped[mi.loss_mask > 0].float().mean().item()),
                                    nv,
                                )
                        if not counted:
                            continue
                        mb_loss += pg
                        m = mmask > 0
                        n_mi = float(m.sum().item())
                        with torch.no_grad():
                            lr_ = (lp - mi.old_logprobs)[m]
                            add_local(
                                "clipfrac", float(out.clipped[m].float().mean().item()) if n_mi else 0.0, n_mi
                            )
                            add_local(
                                "entropy",
                                float(ent[mi.loss_mask > 0].mean().item()),
                                float(mi.loss_mask.sum().item()),
                            )
                            add_local(
                                "approx_kl",
                                float((torch.exp(-lr_) - 1 + lr_).mean().item()) if n_mi else 0.0,
                                n_mi,
                            )
                            if n_mi:
                                ratio_max = max(ratio_max, float(out.ratio[m].max().item()))
                    if replay is not None:
                        r_rows = list(
                            range(round(k * replay.size / n_mini), round((k + 1) * replay.size / n_mini))
                        )
                        if r_rows:
                            term, n_tok = self._replay_backward(replay.select(r_rows))
                            add(f"replay_{a.replay_loss}", term, n_tok)
                    if self.dp is not None:
                        mb_loss, mb_vloss = self.dp.sum_([mb_loss, mb_vloss])
                    grad_norm = self._clip_grad_norm(tc.max_grad_norm)
                    self.optimizer.step()
                    if self.critic is not None and self.critic_optimizer is not None:
                        add("critic_grad_norm", self._clip_critic_grad_norm(tc.max_grad_norm))
                        self.critic_optimizer.step()
                        add("value_loss", mb_vloss)
                    self.optimizer_steps += 1
                    add("policy_loss", mb_loss)
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
        return out_metrics

    def _replay_backward(self, replay: Batch) -> tuple[float, float]:
        """Backward of replay_coef x the replay term over `replay`'s loss-masked tokens, accumulated into
        the gradients of the optimizer step under way; returns (the term before the step, its token
        count). The term (algorithm.replay_loss) is the token-mean NLL at temperature 1 (`nll`), or the
        token-mean KL(initial policy || policy) over the whole vocabulary at each of those positions
        (`kl`: distillation from the reference's full distribution, not only its sampled token)."""
        weights = aggregation_weights(replay.loss_mask, "token_mean")
        coef = self.algo_cfg.replay_coef
        total = 0.0
        for mi, rows in self._sft_micro_batches(replay):
            w = weights[torch.as_tensor(rows, device=self.device), : mi.token_ids.shape[1]]
            if self.algo_cfg.replay_loss == "kl":
                h, targets = self._target_hidden(self.model, mi, mi.loss_mask)
                ref_h, ref_head = self._reference_hidden(mi)
                kl = chunked_forward_kl(
                    causal_lm(self.model).get_output_embeddings(),
                    ref_head,
                    h,
                    ref_h,
                    self.trainer_cfg.logprob_chunk_tokens,
                )
                loss = (kl * w[targets.rows, targets.cols].to(kl.dtype)).sum()
            else:
                lp, _ = self._policy_forward(self.model, mi, mi.loss_mask, temperature=1.0)
                loss = masked_nll(lp, w)
            (coef * loss).backward()
            total += float(loss.item())
        return total, float(replay.loss_mask.sum().item())

    @torch.no_grad()
    def _reference_hidden(self, batch: Batch) -> tuple[Tensor, nn.Module]:
        """The initial policy's hidden states at `batch`'s loss positions and its output layer: the
        frozen copy's, or under LoRA the base model's (adapters off; an adapted output layer is refused,
        its base weights would not be the reference once the backward recomputes it)."""
        if self.lora:
            head = causal_lm(self.model).get_output_embeddings()
            if any(p.requires_grad for p in head.parameters()):
                raise ValueError(
                    "algorithm.replay_loss=kl under LoRA needs a frozen output layer: take lm_head out of "
                    "model.lora_target_modules, or use replay_loss=nll"
                )
            with self.model.disable_adapter():
                return self._target_hidden(self.model, batch, batch.loss_mask)[0], head
        if self.reference is None:
            raise RuntimeError("algorithm.replay_loss=kl needs the frozen reference the Learner keeps for it")
        h = self._target_hidden(self.reference, batch, batch.loss_mask)[0]
        return h, causal_lm(self.reference).get_output_embeddings()

    # ------------------------------------------------------------------------------------------
    # supervised fine-tuning

    def sft_step(self, samples: list[Sample]) -> dict[str, float]:
        """One supervised optimizer step on `samples`: the token-mean negative log-likelihood (at
        temperature 1) of their loss-masked tokens, accumulated over token-budgeted micro-batches
        (batch.micro_batch_tokens), clipped (trainer.max_grad_norm), AdamW at the scheduled LR.

        Metrics: loss (the NLL before the step), tokens (trained on), sequences, sequence_tokens,
        grad_norm, lr, update_tokens_per_s, step_s, optimizer_steps, version."""
        t0 = time.perf_counter()
        batch = build_batch(samples, self.device)
        if self.optimizer_offloaded:
            self.reload_optimizer()
        weights = aggregation_weights(batch.loss_mask, "token_mean")
        lr = self._set_lr()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        self.model.train()
        try:
            for mi, rows in self._sft_micro_batches(batch):
                w = weights[torch.as_tensor(rows, device=self.device), : mi.token_ids.shape[1]]
                lp, _ = self._policy_forward(self.model, mi, mi.loss_mask, temperature=1.0)
                loss = masked_nll(lp, w)
                loss.backward()
                loss_sum += float(loss.item())
            grad_norm = self._clip_grad_norm(self.trainer_cfg.max_grad_norm)
            self.optimizer.step()
        finally:
            self.model.eval()
        self.optimizer_steps += 1
        self.version += 1
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
            "optimizer_steps": float(self.optimizer_steps),
            "version": float(self.version),
        }

    @torch.no_grad()
    def sft_loss(self, samples: list[Sample]) -> dict[str, float]:
        """The token-mean NLL (temperature 1) of `samples`' loss-masked tokens, without training:
        {"loss", "tokens", "sequences"}."""
        batch = build_batch(samples, self.device)
        total = 0.0
        for mi, _ in self._sft_micro_batches(batch):
            lp, _ = self._policy_forward(self.model, mi, mi.loss_mask, temperature=1.0)
            total += float(-(lp * mi.loss_mask).sum().item())
        tokens = float(batch.loss_mask.sum().item())
        return {"loss": total / max(tokens, 1.0), "tokens": tokens, "sequences": float(batch.size)}

    def _sft_micro_batches(self, batch: Batch) -> list[tuple[Batch, list[int]]]:
        plan = plan_micro_batches(
            batch.lengths.tolist(), self.batch_cfg.micro_batch_tokens, self.trainer_cfg.packing
        )
        return [(batch.select(rows), rows) for rows in plan]

    # ------------------------------------------------------------------------------------------
    # preference optimisation (DPO, IPO, SimPO)

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
        t0 = time.perf_counter()
        fn, batch, ref, tokens = self._preference_inputs(chosen, rejected, loss)
        if self.optimizer_offloaded:
            self.reload_optimizer()
        lr = self._set_lr()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.train()
        try:
            sums = self._preference_pass(fn, batch, ref, tokens, params, backward=True)
            grad_norm = self._clip_grad_norm(self.trainer_cfg.max_grad_norm)
            self.optimizer.step()
        finally:
            self.model.eval()
        self.optimizer_steps += 1
        self.version += 1
        return {
            **sums,
            "grad_norm": float(grad_norm),
            "lr": lr,
            "step_s": time.perf_counter() - t0,
            "optimizer_steps": float(self.optimizer_steps),
            "version": float(self.version),
        }

    @torch.no_grad()
    def preference_eval(
        self, chosen: list[Sample], rejected: list[Sample], loss: str, **params: Any
    ) -> dict[str, float]:
        """`preference_step`'s loss, rewards, margin and accuracy on the pairs, without training."""
        fn, batch, ref, tokens = self._preference_inputs(chosen, rejected, loss)
        return self._preference_pass(fn, batch, ref, tokens, params, backward=False)

    def _preference_inputs(
        self, chosen: list[Sample], rejected: list[Sample], loss: str
    ) -> tuple[Any, Batch, Tensor | None, Tensor]:
        if len(chosen) != len(rejected) or not chosen:
            raise ValueError(
                f"preference pairs: need as many chosen as rejected samples, at least one; got "
                f"{len(chosen)} and {len(rejected)}"
            )
        fn = get_preference_loss(loss)
        batch = build_batch(chosen + rejected, self.device)
        ref = None
        if preference_needs_reference(loss):
            ref = self.compute_ref_logprobs(batch, temperature=1.0).sum(-1)
        return fn, batch, ref, batch.loss_mask.sum(-1)

    def _preference_pass(
        self,
        fn: Any,
        batch: Batch,
        ref: Tensor | None,
        tokens: Tensor,
        params: dict[str, Any],
        backward: bool,
    ) -> dict[str, float]:
        n = batch.size // 2
        lengths = batch.lengths.tolist()
        pair_len = [max(lengths[i], lengths[i + n]) for i in range(n)]
        # a pair is two padded rows: plan on half the budget
        plan = plan_micro_batches(pair_len, max(1, self.batch_cfg.micro_batch_tokens // 2), False)
        loss_sum = margin_sum = chosen_sum = rejected_sum = correct = 0.0
        for pairs in plan:
            rows = pairs + [i + n for i in pairs]
            sub = batch.select(rows)
            lp, _ = self._policy_forward(self.model, sub, sub.loss_mask, temperature=1.0)
            seq = lp.sum(-1)
            k = len(pairs)
            idx_c = torch.as_tensor(pairs, device=self.device)
            ref_c = ref[idx_c] if ref is not None else None
            ref_r = ref[idx_c + n] if ref is not None else None
            out = fn(
                seq[:k],
                seq[k:],
                ref_c,
                ref_r,
                chosen_tokens=tokens[idx_c],
                rejected_tokens=tokens[idx_c + n],
                **params,
            )
            loss = out.loss.sum() / n
            if backward:
                loss.backward()
            loss_sum += float(loss.item())
            margin_sum += float(out.reward_margin.sum().item())
            chosen_sum += float(out.chosen_rewards.sum().item())
            rejected_sum += float(out.rejected_rewards.sum().item())
            correct += float((out.chosen_rewards > out.rejected_rewards).sum().item())
        return {
            "loss": loss_sum,
            "chosen_reward": chosen_sum / n,
            "rejected_reward": rejected_sum / n,
            "margin": margin_sum / n,
            "accuracy": correct / n,
            "pairs": float(n),
            "tokens": float(batch.loss_mask.sum().item()),
        }

    # ------------------------------------------------------------------------------------------
    # weights and state

    def weights(self) -> dict[str, Tensor]:
        """HF-named policy weights for the engine; LoRA deltas merged in (the model is not modified).

        For full fine-tuning the tensors share storage with the live parameters: copy them if they
        must stay fixed while the learner trains on."""
        from posttrain.train.state import merged_weights

        if self.dp is not None or self.tp is not None:
            from posttrain.train.distributed import full_weights

            return full_weights(self)
        return merged_weights(self.model)

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
        from posttrain.train.state import load_learner

        return load_learner(directory, model=model, critic_model=critic_model)

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.optimizer, self.critic_optimizer) if o is not None]

    def offload_optimizer(self) -> None:
        """Move AdamW state to CPU memory (frees accelerator memory for the engine). On a CPU-only
        learner the state already lives in CPU memory: nothing moves, only the flag is recorded."""
        if self.device.type != "cpu":
            for opt in self._optimizers():
                for st in opt.state.values():
                    for k, v in st.items():
                        if isinstance(v, Tensor) and v.device.type != "cpu":
                            st[k] = v.to("cpu", non_blocking=True)
        self.optimizer_offloaded = True

    def reload_optimizer(self) -> None:
        """Move AdamW state back to the learner's device (a no-op on CPU)."""
        if self.device.type != "cpu":
            for opt in self._optimizers():
                for st in opt.state.values():
                    for k, v in st.items():
                        if isinstance(v, Tensor) and k != "step":
                            st[k] = v.to(self.device, non_blocking=True)
        self.optimizer_offloaded = False
