"""Building the Learner's parts, in order, before any parallel plan or optimizer: the policy (loaded or
handed in, RoPE scaling, LoRA, the vision tower's trainable parts, MoE routing, gradient checkpointing),
the critic, the frozen reference, all on the learner's device. `build_parts` returns them as
`PolicyParts`; it runs no forward and builds no optimizer (train/optim.py does, from the planned parts).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from posttrain.longctx.rope import apply_rope_scaling, check_rope_scaling, rope_parameters
from posttrain.train.forward import ValueModel, causal_lm
from posttrain.train.moe import MoeRouting
from posttrain.train.vision import set_vision_trainable, vision_learner

CRITIC_CHOICES = ("none", "copy", "separate")


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
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return int(os.environ.get("LOCAL_RANK", dist.get_rank()))


@dataclass
class PolicyParts:
    """The modules a Learner trains and reads, on `device`, before any parallel plan."""

    policy: Any  # the causal LM (a peft model under LoRA)
    critic: ValueModel | None  # trainer.critic: a value head on a decoder, or None
    reference: Any  # the frozen initial policy (full fine-tuning with a KL or kept on request), else None
    vision: Any  # train/vision.py's VisionLearner for vision-language policies, else None
    moe: MoeRouting | None  # MoE routing replay / frozen router / aux losses, else None
    device: torch.device
    lora: bool
    dynamic_rope: bool  # dynamic NTK: a prompt's rotation depends on the whole sequence's length


def build_parts(
    model_cfg: Any,
    trainer_cfg: Any,
    seed: int = 0,
    model: Any = None,
    critic_model: Any = None,
    keep_reference: bool = False,
) -> PolicyParts:
    """The parts of a Learner. `model`/`critic_model`: modules handed in instead of loading model.spec /
    trainer.critic_spec. `keep_reference`: full fine-tuning keeps a frozen copy of the initial policy
    (LoRA's reference is the base with adapters off). Seeds torch with `seed` first."""
    from posttrain.models import load_policy, wrap_lora

    torch.manual_seed(seed)
    if model is None:
        model = apply_rope_scaling(
            load_policy(model_cfg.spec, dtype=model_cfg.dtype, seed=seed), model_cfg.rope_scaling
        )
    elif model_cfg.rope_scaling is not None:
        check_rope_scaling(causal_lm(model), model_cfg.rope_scaling)
    dynamic_rope = rope_parameters(causal_lm(model).config)["rope_type"] == "dynamic"
    # the policy moves before the reference and a critic copy are made from it: all on one device
    device = learner_device(trainer_cfg.device, group_rank())
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL collectives of a rank group run on it
    model = model.to(device)
    lora = model_cfg.lora_rank > 0
    # vision-language policies: images replayed through the model's own tower (train/vision.py)
    vision = vision_learner(model_cfg, causal_lm(model))

    critic_backbone: nn.Module | None = None
    if trainer_cfg.critic == "copy":
        critic_backbone = copy.deepcopy(causal_lm(model).get_decoder())
        hidden_size = causal_lm(model).config.hidden_size
    elif trainer_cfg.critic == "separate":
        cm = critic_model
        if cm is None:
            cm = apply_rope_scaling(load_policy(trainer_cfg.critic_spec, seed=seed), model_cfg.rope_scaling)
        critic_backbone = causal_lm(cm).get_decoder()
        hidden_size = causal_lm(cm).config.hidden_size

    reference: Any = None
    if not lora and keep_reference:
        reference = copy.deepcopy(model).eval()
        for p in reference.parameters():
            p.requires_grad_(False)
    if lora:
        model = wrap_lora(
            model,
            model_cfg.lora_rank,
            model_cfg.lora_alpha,
            model_cfg.lora_dropout,
            model_cfg.lora_target_modules,
            exclude_modules=vision.family.peft_exclude if vision is not None else None,
        )
    if vision is not None:  # after LoRA, which freezes all but its adapters
        v = model_cfg.vision
        set_vision_trainable(causal_lm(model), vision.family, v.train_tower, v.train_projector)
    model = model.to(device)
    # MoE policies: routing replay, a frozen router, aux losses, routing metrics (train/moe.py)
    moe = MoeRouting.attach(model, trainer_cfg.moe, trainer_cfg.gradient_checkpointing)
    model.eval()
    if trainer_cfg.gradient_checkpointing:
        lm = causal_lm(model)
        enable = getattr(lm, "activation_checkpointing_enable", None)
        if enable is not None:  # transformers >= 5
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    critic: ValueModel | None = None
    if critic_backbone is not None:
        critic = ValueModel(critic_backbone, hidden_size).to(device)
        for p in critic.parameters():
            p.requires_grad_(True)
        critic.eval()
    return PolicyParts(model, critic, reference, vision, moe, device, lora, dynamic_rope)
