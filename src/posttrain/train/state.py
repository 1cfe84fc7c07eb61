"""Learner state: the in-memory state dict, atomic checkpoint I/O, and merged weights for the engine.

Tensors of the policy (trainable parameters: LoRA adapters or all weights) and critic go to
safetensors; optimizer and RNG state to torch.save; counters, KL controller and configs to JSON.
Resuming from a checkpoint continues bit-identically. Does not checkpoint the orchestrator's state.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

STATE_FORMAT = 1


def merged_weights(model: Any) -> dict[str, Tensor]:
    """HF-named weights; for a peft model, W + scaling * B @ A per LoRA layer (the model is untouched)."""
    get_base = getattr(model, "get_base_model", None)
    if not callable(get_base):
        return {k: v.detach() for k, v in model.state_dict().items()}
    base = get_base()
    return merge_lora_state(base, {k: v.detach() for k, v in base.state_dict().items()})


def merge_lora_state(base: Any, sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """HF-named weights from `sd`, a state dict of peft's base model `base` under its own names (the
    live one, or a gathered copy of a sharded one): W + scaling * B @ A per LoRA layer, adapters dropped."""
    from peft.tuners.lora import LoraLayer

    merged: dict[str, Tensor] = {}
    for name, module in base.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if any(module.use_dora.get(ad, False) for ad in module.active_adapters):
            raise NotImplementedError("merging DoRA adapters is not supported; use plain LoRA")
        weight = sd[f"{name}.base_layer.weight"]
        delta = torch.zeros_like(weight, dtype=torch.float32)
        for ad in module.active_adapters:
            a_key = f"{name}.lora_A.{ad}.weight"
            if a_key not in sd:
                continue
            d = sd[f"{name}.lora_B.{ad}.weight"].float() @ sd[a_key].float()
            delta += (d.T if getattr(module, "fan_in_fan_out", False) else d) * module.scaling[ad]
        merged[f"{name}.weight"] = (weight.float() + delta).to(weight.dtype)
    out: dict[str, Tensor] = {}
    for k, v in sd.items():
        if ".lora_" in k:
            continue
        key = k.replace(".base_layer.", ".")
        out[key] = merged.get(key, v)
    return out


def _trainable(learner: Any) -> dict[str, Tensor]:
    return {n: p for n, p in learner.model.named_parameters() if p.requires_grad}


def learner_state_dict(learner: Any) -> dict[str, Any]:
    """A deep copy of everything needed to continue bit-identically."""
    return {
        "format": STATE_FORMAT,
        "policy": {n: p.detach().clone() for n, p in _trainable(learner).items()},
        "critic": {k: v.detach().clone() for k, v in learner.critic.state_dict().items()}
        if learner.critic
        else None,
        "optimizer": copy.deepcopy(learner.optimizer.state_dict()),
        "critic_optimizer": copy.deepcopy(learner.critic_optimizer.state_dict())
        if learner.critic_optimizer
        else None,
        "kl": dict(learner.kl_ctl.state_dict()),
        "entropy_coef": learner.entropy_coef,
        "generator": learner.generator.get_state(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if learner.device.type == "cuda" else None,
        "version": learner.version,
        "optimizer_steps": learner.optimizer_steps,
    }


def load_learner_state_dict(learner: Any, state: dict[str, Any]) -> None:
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"learner state format {state.get('format')!r} is not {STATE_FORMAT}")
    params = _trainable(learner)
    missing = sorted(set(params) - set(state["policy"]))
    extra = sorted(set(state["policy"]) - set(params))
    if missing or extra:
        raise ValueError(
            f"learner state does not match this policy (LoRA vs full, or another model?): "
            f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}"
        )
    with torch.no_grad():
        for n, p in params.items():
            t = state["policy"][n]
            if t.shape != p.shape:
                raise ValueError(
                    f"learner state: {n} has shape {tuple(t.shape)}, the policy has {tuple(p.shape)}"
                )
            p.copy_(t)
    if (state["critic"] is None) != (learner.critic is None):
        raise ValueError("learner state and this learner disagree on having a critic (trainer.critic)")
    if learner.critic is not None:
        learner.critic.load_state_dict(state["critic"])
    learner.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
    if learner.critic_optimizer is not None:
        learner.critic_optimizer.load_state_dict(copy.deepcopy(state["critic_optimizer"]))
    learner.kl_ctl.load_state_dict(state["kl"])
    learner.generator.set_state(state["generator"])
    torch.set_rng_state(state["torch_rng"])
    if state.get("cuda_rng") is not None and learner.device.type == "cuda":
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    learner.restore_counters(
        state["version"],
        state["optimizer_steps"],
        entropy_coef=state.get("entropy_coef"),  # None: a state from before entropy_floor keeps the config's
        optimizer_loaded=True,
    )


def _fsync_dir(path: Path, files: bool = True) -> None:
    """fsync the files directly in `path` (when `files`), then the directory itself (its entries)."""
    if files:
        for f in path.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_learner(learner: Any, directory: str | Path) -> None:
    """Write the learner state to `directory` atomically (temp dir, fsync, rename)."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.parent.mkdir(parents=True, exist_ok=True)
    state = learner_state_dict(learner)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-learner-", dir=out.parent))
    try:
        save_file({k: v.contiguous() for k, v in state["policy"].items()}, str(tmp / "policy.safetensors"))
        if state["critic"] is not None:
            save_file(
                {k: v.contiguous() for k, v in state["critic"].items()}, str(tmp / "critic.safetensors")
            )
        torch.save(
            {k: state[k] for k in ("optimizer", "critic_optimizer", "generator", "torch_rng", "cuda_rng")},
            tmp / "optimizer.pt",
        )
        meta = {
            "format": STATE_FORMAT,
            "version": state["version"],
            "optimizer_steps": state["optimizer_steps"],
            "kl": state["kl"],
            "entropy_coef": state["entropy_coef"],
            "seed": learner.seed,
            "model": learner.model_cfg.model_dump(mode="json"),
            "trainer": learner.trainer_cfg.model_dump(mode="json"),
            "algorithm": learner.algo_cfg.model_dump(mode="json"),
            "batch": learner.batch_cfg.model_dump(mode="json"),
        }
        (tmp / "learner.json").write_text(json.dumps(meta, indent=2))
        _fsync_dir(tmp)
        if out.exists():
            old = out.with_name(out.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
        _fsync_dir(out.parent, files=False)  # the rename itself
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_learner_state(directory: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(meta from learner.json, state dict) of a saved learner."""
    from safetensors.torch import load_file

    d = Path(directory)
    if not (d / "learner.json").is_file():
        raise FileNotFoundError(f"{d} is not a learner checkpoint (no learner.json)")
    meta = json.loads((d / "learner.json").read_text())
    # onto the CPU: a GPU learner's file loads anywhere; optimizer.load_state_dict moves each state tensor
    # to its parameter's device
    extra = torch.load(d / "optimizer.pt", weights_only=False, map_location="cpu")
    state = {
        "format": meta["format"],
        "policy": load_file(str(d / "policy.safetensors")),
        "critic": load_file(str(d / "critic.safetensors")) if (d / "critic.safetensors").is_file() else None,
        "kl": meta["kl"],
        "entropy_coef": meta.get("entropy_coef"),
        "version": meta["version"],
        "optimizer_steps": meta["optimizer_steps"],
        **extra,
    }
    return meta, state


def sections_of(meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(trainer, algorithm, batch) of a learner.json. One written before the batch section existed holds
    the batch sizes under trainer and algorithm: they are moved to their batch names (config.MOVED_KEYS).
    (One written before policy-loss configs holds GSPO's clip range flat at its defaults: AlgorithmConfig
    drops those.)"""
    from posttrain.config import MOVED_KEYS

    sections = {"trainer": dict(meta["trainer"]), "algorithm": dict(meta["algorithm"])}
    batch = dict(meta.get("batch", {}))
    for old, new in MOVED_KEYS.items():
        section, key = old.split(".")
        if section in sections and key in sections[section] and new.startswith("batch."):
            batch[new.split(".")[1]] = sections[section].pop(key)
    return sections["trainer"], sections["algorithm"], batch
