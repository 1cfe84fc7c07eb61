"""The run config tree: every default of a run lives here and nowhere else.

Owns the pydantic models, YAML loading, typed dotted overrides (`--set a.b=1`) and validation
errors that name the key, the value and what was expected. It does not know how a section is used.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and what would be right. `moved` maps each
    key of the config that now lives under another name (MOVED_KEYS) to that name."""

    def __init__(self, message: str, moved: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.moved = dict(moved or {})


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RopeScaling(Section):
    """RoPE scaling applied to the loaded model (transformers' `rope_parameters`): linear, dynamic NTK,
    YaRN or Llama-3. Only the keys of the chosen type may be set away from their defaults."""

    TYPE_KEYS: ClassVar[dict[str, set[str]]] = {
        "linear": set(),
        "dynamic": set(),
        "yarn": {"original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor"},
        "llama3": {"original_max_position_embeddings", "low_freq_factor", "high_freq_factor"},
    }

    type: Literal["linear", "dynamic", "yarn", "llama3"]
    factor: float = Field(..., gt=1.0, description="how many times the trained window is stretched")
    original_max_position_embeddings: int | None = Field(
        None, gt=0, description="yarn/llama3: the trained window; default the model's max_position_embeddings"
    )
    beta_fast: float = Field(32.0, gt=0.0, description="yarn: rotations above which a dimension is kept")
    beta_slow: float = Field(
        1.0, gt=0.0, description="yarn: rotations below which a dimension is interpolated"
    )
    attention_factor: float | None = Field(None, gt=0.0, description="yarn: default 0.1 ln(factor) + 1")
    low_freq_factor: float = Field(
        1.0, gt=0.0, description="llama3: wavelengths above window/this are scaled"
    )
    high_freq_factor: float = Field(4.0, gt=0.0, description="llama3: wavelengths below window/this are kept")

    @model_validator(mode="after")
    def _keys_of_type(self) -> RopeScaling:
        fields = type(self).model_fields
        foreign = sorted(
            k
            for k in self.model_fields_set - {"type", "factor"} - self.TYPE_KEYS[self.type]
            if getattr(self, k) != fields[k].default  # a dumped config repeats every default
        )
        if foreign:
            raise ValueError(f"{foreign} do not apply to rope type '{self.type}'")
        if self.type == "yarn" and self.beta_fast <= self.beta_slow:
            raise ValueError("yarn needs beta_fast > beta_slow")
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 needs high_freq_factor > low_freq_factor")
        return self


class VisionConfig(Section):
    """What trains in a vision-language policy (LLaVA-style; the language side follows lora_rank)."""

    train_tower: bool = Field(False, description="train the vision encoder (frozen by default)")
    train_projector: bool = Field(True, description="train the vision-to-language projector")


class ModelConfig(Section):
    """Which weights: `smollm2-135m`, a HF folder, a .gguf path, or `tiny:<family>`."""

    spec: str = "smollm2-135m"
    rope_scaling: RopeScaling | None = Field(
        None, description="stretch RoPE past the trained window, e.g. {type: yarn, factor: 4}"
    )
    dtype: Literal["float32", "bfloat16"] = "float32"
    lora_rank: int = Field(0, ge=0, description="0 = full fine-tune")
    lora_alpha: float = 32.0
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    lora_target_modules: list[str] = [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    vision: VisionConfig = Field(default_factory=VisionConfig)


def native_bf16(device: str = "cpu") -> bool:
    """Whether `device` runs bfloat16 matmuls natively: a CUDA GPU that supports them, or an x86 CPU
    with AVX512-BF16 or AMX-BF16 (read from /proc/cpuinfo). Elsewhere bf16 is emulated and slower
    than float32, so `dtype: auto` picks float32 there."""
    if device.startswith("cuda"):
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


class EngineConfig(Section):
    backend: Literal["paged", "hf", "vllm"] = "paged"
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="weights and activations of the engine; auto = bfloat16 where the device runs it natively "
        "(AVX512-BF16/AMX CPUs, bf16 GPUs), else float32; resolved when the config loads",
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "int8"] = Field(
        "auto",
        description="paged engine K/V pool; auto = the engine dtype; int8 = symmetric int8 with a float32 scale "
        "per token and KV head (about half the bytes of bfloat16), dequantized when attention reads it",
    )
    weight_quant: Literal["none", "int8", "int8_weight_only", "int4"] = Field(
        "none",
        description="paged engine on CPU: int8 = per-output-channel int8 weights x per-token int8 activations "
        "on an integer GEMM (fbgemm); int8_weight_only = int8 weights, bfloat16 activations; int4 = 4-bit "
        "weights in groups of 32, bfloat16 activations (least memory, largest error); none = the engine dtype",
    )
    lm_head_quant: Literal["same", "none", "int8", "int8_weight_only", "int4"] = Field(
        "same",
        description="with weight_quant, the output projection's (a fifth of a 135M model): same = weight_quant",
    )
    weight_quant_max_rows: int = Field(
        0,
        ge=0,
        description="with weight_quant: forwards of more rows than this (prefill, large batches) run on the "
        "float weights, then kept as well (more memory); 0 = every forward on the quantized weights",
    )
    block_size: int = Field(16, ge=1)
    num_kv_blocks: int = Field(2048, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: int = Field(4096, ge=1)
    enable_prefix_caching: bool = Field(
        True, description="reuse K/V of identical prompt prefixes across requests"
    )
    decode_staging: bool = Field(
        True,
        description="paged engine: keep each decode group's K/V contiguous across steps (no per-step block gather)",
    )
    device: str = Field("cpu", description="torch device of the paged engine: cpu, cuda, cuda:1, ...")
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="vllm backend: GPUs one engine shards its layers over (vLLM's tensor_parallel_size)",
    )
    pipeline_parallel_size: int = Field(
        1, ge=1, description="vllm backend: pipeline stages of one engine (vLLM's pipeline_parallel_size)"
    )
    gpu_memory_utilization: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="vllm backend: the share of GPU memory the engine takes (weights and KV cache); the rest "
        "is the colocated Learner's",
    )
    enforce_eager: bool = Field(
        False,
        description="vllm backend: run the model eagerly, without torch.compile or CUDA graphs (vLLM's "
        "enforce_eager): the engine starts in seconds instead of minutes, and each step is slower",
    )
    speculative: Literal["none", "ngram", "early_exit"] = Field(
        "none",
        description="paged engine: speculative decoding with exact acceptance (greedy output unchanged, "
        "sampled output from the same distribution); ngram = prompt lookup, drafts copied from what follows "
        "an earlier occurrence of the sequence's last tokens; early_exit = self-speculative, greedy drafts "
        "from the model's first early_exit_layers layers + final norm + head (untrained: slower here)",
    )
    early_exit_layers: int = Field(
        8, ge=1, description="early_exit: the layers the draft runs (fewer than the model's)"
    )
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="draft tokens verified per step")
    prompt_lookup_min: int = Field(2, ge=1, description="ngram: the shortest suffix matched")
    prompt_lookup_max: int = Field(4, ge=1, description="ngram: the longest suffix matched (tried first)")
    speculative_max_batch: int = Field(
        4,
        ge=1,
        description="speculate only while at most this many sequences decode (above, it does not pay)",
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(64, ge=1, description="per assistant turn")

    def resolved_dtype(self) -> str:
        """`dtype` with `auto` resolved for `device` (see `native_bf16`)."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if native_bf16(self.device) else "float32"

    PAGED_ONLY: ClassVar[tuple[str, ...]] = (
        "kv_cache_dtype",
        "weight_quant",
        "lm_head_quant",
        "weight_quant_max_rows",
        "speculative",
        "num_speculative_tokens",
        "prompt_lookup_min",
        "prompt_lookup_max",
        "speculative_max_batch",
        "early_exit_layers",
        "decode_staging",
    )

    VLLM_ONLY: ClassVar[tuple[str, ...]] = (
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "gpu_memory_utilization",
        "enforce_eager",
    )

    def vllm_only_settings(self) -> list[str]:
        """The keys set away from their defaults that only the vllm backend runs."""
        fields = type(self).model_fields
        return [
            f"engine.{k}={getattr(self, k)}" for k in self.VLLM_ONLY if getattr(self, k) != fields[k].default
        ]

    def paged_only_settings(self) -> list[str]:
        """The keys set away from their defaults that only the paged engine runs (another backend must
        refuse them rather than ignore them)."""
        fields = type(self).model_fields
        return [
            f"engine.{k}={getattr(self, k)}" for k in self.PAGED_ONLY if getattr(self, k) != fields[k].default
        ]

    @model_validator(mode="after")
    def _lookup_range(self) -> EngineConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"engine.prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                f"engine.prompt_lookup_max ({self.prompt_lookup_max})"
            )
        return self


class ServeConfig(Section):
    """`posttrain serve`: what its fast mode changes in the engine (standard mode is `engine` as it is)."""

    fast: dict[str, Any] = Field(
        default_factory=lambda: {
            "weight_quant": "int4",
            "lm_head_quant": "int8",
            "weight_quant_max_rows": 8,
            "speculative": "ngram",
        },
        description="engine keys that --mode fast (and the NAME-fast model of --mode both) sets over engine",
    )

    @field_validator("fast")
    @classmethod
    def _engine_keys(cls, v: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(v) - set(EngineConfig.model_fields))
        if unknown:
            raise ValueError(f"serve.fast names keys that are not engine keys: {unknown}")
        return v

    def fast_engine(self, engine: EngineConfig) -> EngineConfig:
        """`engine` with the fast-mode keys set (validated as one engine section)."""
        return EngineConfig.model_validate({**engine.model_dump(), **self.fast})


class DomainConfig(Section):
    name: str
    difficulties: list[int] = [0]
    weight: float = Field(
        1.0,
        gt=0.0,
        description="the domain's prior share of the curriculum, relative to the other domains': "
        "uniform_by_domain splits the batch in proportion to it; score-based samplers (adaptive, sec, dump) multiply "
        "each of the domain's arms' softmax term by it (adaptive's eps floor stays uniform)",
    )
    options: dict[str, Any] = {}


class RetentionSuiteConfig(Section):
    """One entry of curriculum.retention: a domain (with its generator options) and the levels scored."""

    name: str
    difficulties: list[int] = [0]
    options: dict[str, Any] = {}
    label: str | None = Field(
        None,
        description="the suite's name in its metrics (retention/<label>:<level>), in place of the domain's; "
        "needed when the domain is trained with other options (math with other reasoning-gym datasets, say), "
        "so its figures are not read as the trained domain's",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_weight(cls, data: Any) -> Any:
        # configs saved while suites were envs.domains entries carry `weight: 1.0`, which meant nothing here
        if isinstance(data, dict) and "weight" in data:
            if data["weight"] != 1.0:
                raise ValueError(
                    "a retention suite has no weight (it is scored, not sampled): remove 'weight'"
                )
            data = {k: v for k, v in data.items() if k != "weight"}
        return data

    @field_validator("label")
    @classmethod
    def _label_form(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or ":" in v or v != v.strip()):
            raise ValueError(f"label {v!r} must be a non-empty name without ':' or surrounding spaces")
        return v


# curriculum.retention=default: general skills outside the default training mix that the embedded 135M
# model sometimes has (instruction following, a character-level reasoning family) and the next levels of
# the default domains; entries the run trains are left out (default_retention)
DEFAULT_RETENTION: list[RetentionSuiteConfig] = [
    RetentionSuiteConfig(name="instruct.constraints", difficulties=[0]),
    RetentionSuiteConfig(
        name="math",
        difficulties=[0],
        options={"datasets": {"letter_counting": {"min_words": 6, "max_words": 10}}},
        label="letters",
    ),
    RetentionSuiteConfig(name="math", difficulties=[2]),
    RetentionSuiteConfig(name="code.unit_tests", difficulties=[1]),
]


def suite_overlap(suite: RetentionSuiteConfig, domains: list[DomainConfig]) -> tuple[list[int], bool]:
    """How a retention suite meets the training mix: (its levels the run trains with the same options,
    whether it needs a label: unlabelled, its domain trained with other options)."""
    twin = next((d for d in domains if d.name == suite.name), None)
    if twin is None:
        return [], False
    if dict(twin.options) == dict(suite.options):
        return [lvl for lvl in suite.difficulties if lvl in twin.difficulties], False
    return [], suite.label is None


def default_retention(domains: list[DomainConfig]) -> list[RetentionSuiteConfig]:
    """DEFAULT_RETENTION without what `domains` train: the trained levels of a suite with the trained
    entry's options, and an unlabelled suite whose domain is trained with other options."""
    out = []
    for suite in DEFAULT_RETENTION:
        trained, needs_label = suite_overlap(suite, domains)
        levels = [] if needs_label else [lvl for lvl in suite.difficulties if lvl not in trained]
        if levels:
            out.append(suite.model_copy(update={"difficulties": levels}, deep=True))
    return out


class EnvsConfig(Section):
    """Domains and difficulty levels to train on (`posttrain tasks list` shows them). The default mix
    holds what the embedded 135M model solves sometimes but not always; tools.apis level 0 is left
    out by default because the base model makes no valid tool call there (0% measured)."""

    domains: list[DomainConfig] = [
        DomainConfig(name="math", difficulties=[0, 1]),
        DomainConfig(name="code.unit_tests", difficulties=[0]),
    ]
    max_turns: int = Field(4, ge=1, description="assistant turns per episode")
    max_episode_tokens: int = Field(1024, ge=1, description="generated + observation tokens per episode")


class CurriculumConfig(Section):
    """Domain/difficulty sampling; the rules are documented in `posttrain.curriculum`."""

    sampler: Literal["adaptive", "uniform_by_domain", "dapo_filter_only", "sec", "dump"] = Field(
        "adaptive",
        description="dapo_filter_only: uniform_by_domain with DAPO's group filter (as algorithm.dynamic_sampling). "
        "The simulator's uniform_by_data is not offered: the task generators have no data size",
    )
    alpha: float = Field(0.5, gt=0.0, le=1.0, description="EMA rate of the learnability signal")
    tau: float = Field(0.5, gt=0.0, description="softmax temperature over min-max normalised scores")
    c: float = Field(0.4, ge=0.0, description="exploration bonus weight")
    eps: float = Field(
        0.2, ge=0.0, le=1.0, description="uniform mixing at the start of the run; every arm keeps >= eps/K"
    )
    eps_end: float | None = Field(
        0.3,
        ge=0.0,
        le=1.0,
        description="adaptive: eps at the end of the run, reached linearly with the run's "
        "progress (None: eps throughout)",
    )
    domain_mix: float = Field(
        0.3,
        ge=0.0,
        le=1.0,
        description="adaptive: share of uniform_by_domain blended into the policy, ramped "
        "linearly from 0 at the start of the run to this at its end",
    )
    lam: float = Field(
        10.0, ge=0.0, description="forgetting weight (10 forgot less than 1 in the simulation benchmark)"
    )
    forget_z: float = Field(
        1.0, ge=0.0, description="forgetting counts only the probe drop beyond this many standard errors"
    )
    max_share: float = Field(
        0.5, gt=0.0, le=1.0, description="cap on one arm's share (raised to 1/K if below)"
    )
    probe_every: int = Field(10, ge=0, description="retention probe period in steps; 0 = no probes")
    probe_size: int = Field(
        16, ge=1, description="held-out probe prompts per arm (16 keeps probes to about 1/3 of a CPU step)"
    )
    drift_every: int = Field(
        0,
        ge=0,
        description="drift probe period in steps (KL to the initial policy and entropy on general prompts "
        "outside every domain, from its own sampled completions; one learner forward); 0 = off",
    )
    drift_prompts: int = Field(16, ge=1, le=16, description="drift probe: general prompts used (of 16)")
    retention: list[RetentionSuiteConfig] | Literal["default"] = Field(
        [],
        description="retention suites: domains and levels outside envs.domains (or a trained domain's name "
        "with other options and a label), scored greedily every retention_every steps against the initial "
        "policy's scores of the same held-out tasks; 'default' = DEFAULT_RETENTION less what the run trains",
    )
    retention_every: int = Field(0, ge=0, description="retention suites' period in steps (sync mode)")
    retention_size: int = Field(16, ge=1, description="held-out tasks per retention suite (domain and level)")
    retention_stop: float | None = Field(
        None,
        gt=0.0,
        description="stop the run when a retention suite's delta from the initial policy is below "
        "-retention_stop with its 95% interval below 0; the newest checkpoint from before is kept as "
        "checkpoints/best",
    )
    drift_tokens: int = Field(48, ge=1, description="drift probe: tokens sampled per reference completion")
    retention_replay_gain: float = Field(
        0.0,
        ge=0.0,
        description="a retention suite that falls raises algorithm.replay_fraction by this much per unit of "
        "its forgetting (its drop from the initial policy beyond forget_z standard errors), capped at 1; "
        "0 = the fraction stays as set",
    )
    replay_rate: float = Field(0.05, ge=0.0, le=1.0, description="chance to replay a mastered prompt")
    mastered_p: float = Field(
        0.9, gt=0.0, le=1.0, description="observed success rate that marks a prompt mastered"
    )
    sec_alpha: float = Field(0.5, gt=0.0, le=1.0, description="sec: TD(0) step size")
    sec_tau: float = Field(1.0, gt=0.0, description="sec: Boltzmann temperature")
    dump_window: int = Field(300, ge=1, description="dump: |advantage| values kept per arm")
    dump_tau: float = Field(0.1, gt=0.0, description="dump: softmax temperature over UCB scores")
    lp_weight: float = Field(
        0.0, ge=0.0, description="adaptive: weight of the learning-progress term |fast - slow|"
    )
    weakness: float = Field(0.4, ge=0.0, description="adaptive: weight of the headroom term 1 - success rate")
    lp_fast: float = Field(
        0.2, gt=0.0, le=1.0, description="adaptive: EMA rate of the fast success-rate average"
    )
    lp_slow: float = Field(
        0.1,
        gt=0.0,
        le=1.0,
        description="adaptive: EMA rate of the slow one (< lp_fast); also train_retention's",
    )
    train_retention: bool = Field(
        True,
        description="adaptive: forgetting also read from the training groups' success rates (free evidence)",
    )
    probe_skip_rollouts: int = Field(
        64,
        ge=0,
        description="adaptive: no probe for an arm with this many training rollouts since its last one (0: probe all)",
    )
    cover_batch: bool = Field(
        False, description="adaptive: every available arm gets one group of each batch that has room for all"
    )
    cost_aware: bool = Field(
        False,
        description="adaptive: split tokens, not groups (reads update(..., tokens=); arms without a report count "
        "as 1). Off by default: on the real model it did worse than splitting groups (docs/curriculum.md)",
    )


class BatchConfig(Section):
    """How much one step generates and how it is cut for the update, with the names verl and OpenRLHF use.

    | key                  | counts                                              | verl                                          |
    |----------------------|-----------------------------------------------------|-----------------------------------------------|
    | `prompts_per_step`   | prompts (GRPO groups) sampled per RL step           | `data.train_batch_size`                       |
    | `samples_per_prompt` | rollouts per prompt, the GRPO group size            | `actor_rollout_ref.rollout.n`                 |
    | `mini_batches`       | optimizer steps per epoch over the step's rollouts  | `train_batch_size / ppo_mini_batch_size`      |
    | `ppo_epochs`         | passes over the step's rollouts                     | `actor.ppo_epochs`                            |
    | `micro_batch_tokens` | tokens per forward/backward chunk (grad. accum.)    | `ppo_max_token_len_per_gpu`, `use_dynamic_bsz`|

    Derived: rollouts per step = prompts_per_step x samples_per_prompt (fewer trained on when dynamic
    sampling drops groups or infrastructure failures drop rollouts); sequences per optimizer step =
    rollouts per step / mini_batches; optimizer steps per RL step = mini_batches x ppo_epochs.
    `micro_batch_tokens` changes memory and speed, not the update (up to float rounding).
    """

    prompts_per_step: int = Field(
        4,
        ge=1,
        description="prompts (GRPO groups) per RL step; verl data.train_batch_size (counted in prompts)",
    )
    samples_per_prompt: int = Field(
        8, ge=1, description="rollouts per prompt, the GRPO group size; verl actor_rollout_ref.rollout.n"
    )
    mini_batches: int = Field(
        1,
        ge=1,
        description="optimizer steps per epoch over a step's rollouts; verl train_batch_size / ppo_mini_batch_size",
    )
    ppo_epochs: int = Field(
        1, ge=1, description="passes over a step's rollouts; verl actor_rollout_ref.actor.ppo_epochs"
    )
    micro_batch_tokens: int = Field(
        4096,
        ge=1,
        description="tokens per forward/backward chunk, gradients accumulated over a mini-batch's chunks; "
        "verl ppo_max_token_len_per_gpu with use_dynamic_bsz",
    )


class PpoClipLossConfig(Section):
    """algorithm.policy_loss of type ppo_clip: its token-ratio clip range is algorithm.clip_low/clip_high
    (kept there, where every config already sets it) and its dual clip algorithm.dual_clip."""

    type: Literal["ppo_clip"] = "ppo_clip"


class GspoLossConfig(Section):
    """algorithm.policy_loss of type gspo: the clipped surrogate on the sequence ratio, with GSPO's own
    (1e-4-sized) clip range; the dual clip is algorithm.dual_clip."""

    type: Literal["gspo"] = "gspo"
    clip_low: float = Field(3e-4, ge=0.0, description="sequence-ratio clip below, 1 - clip_low")
    clip_high: float = Field(4e-4, ge=0.0, description="sequence-ratio clip above, 1 + clip_high")


class CustomLossConfig(Section):
    """algorithm.policy_loss of type custom: a policy-loss term class loaded by import path
    (`pkg.module:Class`), built as `Class(**kwargs)`; it is called like the registered terms
    (train/terms.py: `term(inputs: LossInputs) -> TermResult`)."""

    type: Literal["custom"] = "custom"
    path: str = Field(..., description="'package.module:Class' of the term")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of Class")

    @field_validator("path")
    @classmethod
    def _module_and_name(cls, v: str) -> str:
        module, _, name = v.partition(":")
        if not module or not name:
            raise ValueError(f"custom loss path '{v}' must be 'package.module:Class'")
        return v


PolicyLossConfig = Annotated[
    PpoClipLossConfig | GspoLossConfig | CustomLossConfig, Field(discriminator="type")
]


OLD_GSPO_DEFAULTS = {"gspo_clip_low": 3e-4, "gspo_clip_high": 4e-4}  # flat keys of old, now GSPO's config


class AlgorithmConfig(Section):
    advantage: str = "grpo"
    policy_loss: PolicyLossConfig = Field(
        default_factory=PpoClipLossConfig,
        description="the policy-loss term: a registered name (ppo_clip, gspo: its default config), "
        "{type: gspo, clip_low: .., clip_high: ..}, or {type: custom, path: 'pkg.mod:Class', kwargs: {..}}",
    )
    loss_agg: Literal[
        "token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"
    ] = "token_mean"
    normalize_std: bool = True
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lam: float = Field(0.95, ge=0.0, le=1.0)
    clip_low: float = Field(0.2, ge=0.0, description="ppo_clip: ratio clip below, 1 - clip_low")
    clip_high: float = Field(
        0.28, ge=0.0, description="ppo_clip: ratio clip above, 1 + clip_high (DAPO's clip-higher)"
    )
    dual_clip: float | None = Field(
        None, gt=1.0, description="ppo_clip and gspo: for A < 0 the loss is at most -A x dual_clip"
    )
    kl_coef: float = Field(0.0, ge=0.0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_in_reward: bool = False
    kl_target: float | None = Field(None, gt=0.0, description="adaptive KL coefficient target")
    kl_horizon: int = Field(10000, ge=1)
    kl_control: Literal["batch", "drift"] = Field(
        "batch",
        description="what the adaptive KL coefficient holds near kl_target: the training batch's KL, or "
        "the drift probe's (curriculum.drift_every; KL on general prompts outside every domain)",
    )
    entropy_coef: float = Field(0.0, description="entropy bonus weight (the start value under entropy_floor)")
    entropy_floor: float | None = Field(
        None,
        gt=0.0,
        description="nats per token: after each step the entropy bonus weight moves by entropy_floor_lr x "
        "(floor - batch entropy), never below 0, so a policy collapsing below the floor is pushed back",
    )
    entropy_floor_lr: float = Field(0.01, gt=0.0, description="entropy_floor: the weight's step per nat")
    replay_fraction: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="replay of general data: the initial policy's own completions of general prompts "
        "(orchestrator.replay) mixed into each update, this many per RL sequence (rounded half up, at "
        "least 1 while > 0), as a term (replay_loss) of weight replay_coef; 0 = off",
    )
    replay_coef: float = Field(
        0.1, gt=0.0, description="replay_fraction: weight of the replay term (replay_loss) in the loss"
    )
    replay_loss: Literal["nll", "kl"] = Field(
        "nll",
        description="replay_fraction: the replay term, token-mean over the replay completions' tokens: "
        "nll = their negative log-likelihood (a supervised term); kl = KL(initial policy || policy) over "
        "the whole vocabulary at each position (distillation from the reference's distribution; keeps a "
        "frozen reference copy under full fine-tuning; one process only)",
    )
    replay_tokens: int = Field(
        64, ge=1, description="replay_fraction: tokens sampled per reference completion of a replay prompt"
    )
    value_clip: float | None = 0.2
    value_coef: float = Field(0.5, ge=0.0)
    tis_cap: float | None = Field(2.0, gt=0.0, description="truncated importance sampling cap")
    tis_level: Literal["token", "sequence"] = "token"
    mask_ratio_low: float | None = None
    mask_ratio_high: float | None = None
    dynamic_sampling: bool = False
    max_resample_rounds: int = Field(2, ge=0)
    temperature: float = Field(
        1.0,
        gt=0.0,
        description="sampling temperature of the behaviour logprobs; the learner divides logits by it",
    )
    loss_norm_tokens: int | None = Field(
        None,
        ge=1,
        description="constant divisor of seq_mean_token_sum_norm, Dr. GRPO's generation budget; unset = "
        "engine.max_new_tokens, resolved when the config loads",
    )

    @field_validator("advantage")
    @classmethod
    def _known_advantage(cls, v: str) -> str:
        from posttrain.algos import list_advantages

        return _registered("advantage estimator", v, list_advantages())

    @model_validator(mode="before")
    @classmethod
    def _drop_dumped_gspo_defaults(cls, data: Any) -> Any:
        """Every config saved before policy-loss configs (a run's config.yaml) holds gspo_clip_low/high at
        their defaults, which are GspoLossConfig's: those are dropped so the run resumes as it was. Any
        other value is refused by the section ("moved to algorithm.policy_loss.clip_low")."""
        if isinstance(data, dict) and any(k in data for k in OLD_GSPO_DEFAULTS):
            data = dict(data)
            for key, default in OLD_GSPO_DEFAULTS.items():
                if key in data and data[key] == default:
                    del data[key]
        return data

    @field_validator("policy_loss", mode="before")
    @classmethod
    def _known_policy_loss(cls, v: Any) -> Any:
        """A plain registered name (today's form, `policy_loss: gspo`) is that type's default config."""
        from posttrain.algos import list_policy_losses

        name = v if isinstance(v, str) else v.get("type") if isinstance(v, dict) else None
        if isinstance(name, str) and name != "custom":
            _registered("policy loss", name, list_policy_losses())
        return {"type": v} if isinstance(v, str) else v


class MoeTrainConfig(Section):
    """Mixture-of-Experts options of the Learner (train/moe.py); any of them on needs an MoE policy."""

    routing_replay: bool = Field(
        False,
        description="route each token in the learner's forward to the experts the engine chose for it "
        "(the rollout's recorded routing; positions without one route freely), so the learner's logprobs "
        "use the engine's routing; needs gradient_checkpointing=false",
    )
    freeze_router: bool = Field(
        False, description="no gradient to the routers (their weights stay as loaded)"
    )
    aux_loss_coef: float = Field(
        0.0, ge=0.0, description="weight of the load-balancing loss (Switch/Mixtral; 1.0 when balanced)"
    )
    z_loss_coef: float = Field(
        0.0,
        ge=0.0,
        description="weight of the router z-loss (ST-MoE: mean squared logsumexp of router logits)",
    )

    @property
    def enabled(self) -> bool:
        return self.routing_replay or self.freeze_router or self.aux_loss_coef > 0 or self.z_loss_coef > 0


class TrainerConfig(Section):
    lr: float = Field(2e-5, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    lr_decay_steps: int = Field(
        0, ge=0, description="optimizer steps of the cosine/linear decay (needed by them)"
    )
    max_grad_norm: float = Field(1.0, gt=0.0)
    gradient_checkpointing: bool = False
    bf16_autocast: bool | None = Field(
        None,
        description="bfloat16 autocast in the learner's forward/backward; unset = on when the engine runs in bfloat16",
    )
    packing: bool = Field(
        False,
        description="pack rows that share no prompt into block-diagonal rows (padded was faster on "
        "`posttrain bench learner`, 32 x 64-256 tokens, in every variant)",
    )
    logprob_chunk_tokens: int = Field(1024, ge=1)
    share_prompt_prefix: bool = Field(
        True,
        description="the learner runs a GRPO group as one packed row: the shared prompt once, then every "
        "sample's completion, each masked to see the prompt and itself; equal to the full forward up to "
        "float rounding; off under gradient checkpointing",
    )
    single_pass_old_logprobs: bool = Field(
        True,
        description="when the update is one pass (batch.ppo_epochs=1, batch.mini_batches=1) with no critic, no KL in the "
        "reward and no ratio masking, take the PPO ratio's denominator from the training forward (detached) "
        "instead of a separate no-grad forward: equal in exact arithmetic, one forward fewer per step",
    )
    critic: Literal["none", "copy", "separate"] = "none"
    critic_spec: str | None = None
    critic_lr: float = Field(1e-5, gt=0.0)
    context_parallel: int = Field(
        1,
        ge=1,
        description="split every sequence zigzag over this many processes, attention by ring attention "
        "(one Learner per rank of an initialised torch.distributed group of this size); packing keeps each row's sequences apart, "
        "no dynamic NTK; shared-prompt micro-batches are off under it; with data_parallel or tensor_parallel "
        "a dp x cp (x tp) mesh (`train.distributed.parallelize_dp_cp`)",
    )
    data_parallel: int = Field(
        1,
        ge=1,
        description="FSDP2 data-parallel learner ranks (`train.distributed.shard_learner`), started and "
        "driven by the run (orchestrator.learner_group); a critic is sharded with the policy",
    )
    tensor_parallel: int = Field(
        1,
        ge=1,
        description="tensor-parallel learner ranks (`train.distributed.tensor_parallel_learner`), started "
        "and driven by the run; heads divisible by it (a critic's too); with data_parallel a 2-D mesh",
    )
    moe: MoeTrainConfig = Field(default_factory=MoeTrainConfig)
    device: str = Field(
        "cpu",
        description="torch device of the learner's policy, reference and critic: cpu, cuda (learner rank r "
        "takes cuda:(r % the GPUs it sees)), cuda:N; checked against this machine's CUDA when a run starts",
    )

    @field_validator("device")
    @classmethod
    def _device_form(cls, v: str) -> str:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", v):
            raise ValueError(f"'{v}' is not a learner device: use cpu, cuda or cuda:N")
        return v

    @property
    def learner_ranks(self) -> int:
        """Learner processes this config asks for: data x tensor x context parallel."""
        return self.data_parallel * self.tensor_parallel * self.context_parallel


class OrchestratorConfig(Section):
    steps: int = Field(
        40,
        ge=0,
        description="RL steps (learner updates) in the run; with orchestrator.token_budget, an upper bound",
    )
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = Field(1, ge=0)
    async_lag: Literal["fixed", "latest"] = Field(
        "fixed",
        description="async: 'fixed' generates batch b with the weights after b - max_staleness steps, or after the "
        "last periodic checkpoint's step if later (the pipeline restarts there), so a run does not depend on thread "
        "timing and resumes exactly from periodic checkpoints; 'latest' with the newest the learner has published "
        "by then (at most max_staleness behind: fresher, not reproducible)",
    )
    token_budget: int | None = Field(
        None,
        ge=1,
        description="stop after the step at which generated tokens (rollouts and retention probes) reach this; "
        "steps stays an upper bound",
    )
    checkpoint_every: int = Field(10, ge=0)
    keep_checkpoints: int = Field(2, ge=1)
    eval_n: int = Field(64, ge=1, description="held-out tasks per (domain, difficulty) for `posttrain eval`")
    free_kv_during_update: bool = True
    offload_optimizer: bool = False
    max_reward_fn_errors: int = Field(
        0,
        ge=0,
        description="reward-function errors (a reward function that raises or returns no finite number: a user "
        "error, never scored) a run tolerates; past them it stops with exit 2 naming the row and the exception. "
        "0: the first one stops it, in the first step where a wrong argument name shows",
    )
    infra_warn_share: float = Field(
        0.25,
        ge=0.0,
        le=1.0,
        description="warn (one line on stderr) after a step where more than this share of the episodes were "
        "infrastructure failures (not trained on); a step where all were stops the run with exit 1",
    )


class PlacementConfig(Section):
    """Where the roles run: `local` (one process) or `ray` (the rollout engines as Ray actors, the
    learner and the controller in this process); the engine's device is engine.device."""

    backend: Literal["local", "ray"] = "local"
    num_engines: int = Field(
        1, ge=1, description="ray: rollout-engine actors (requests go to the least busy)"
    )
    engine_cpus: float = Field(
        1.0, gt=0, description="ray: CPUs per rollout-engine actor (its torch threads)"
    )
    engine_gpus: float = Field(
        0.0,
        ge=0,
        description="ray: GPUs per rollout-engine actor (fractions share one); > 0 needs engine.device "
        "cuda, which under ray needs > 0 (Ray hides the GPUs from actors that reserve none)",
    )
    ray_address: str | None = Field(
        None, description="ray: the cluster to join (ray://host:10001 or auto); unset = a local one"
    )
    weight_sync: Literal["in_process", "shared_file", "broadcast"] = Field(
        "in_process",
        description="how weights reach the engine: in_process (handed over), shared_file (hashed pushes "
        "through weight_sync_dir, as engines in other processes read them), broadcast (torch.distributed "
        "from this process to the Ray engine actors: gloo on CPU engines, NCCL on CUDA ones; needs "
        "backend ray)",
    )
    weight_sync_dir: str | None = Field(
        None, description="shared_file: the folder pushes go through; unset = a fresh one in /dev/shm"
    )
    learner_ranks: int | None = Field(
        None,
        ge=1,
        description="learner rank processes; unset = trainer.data_parallel x tensor_parallel x "
        "context_parallel, which it must equal when set",
    )
    learner_cpus: float = Field(
        1.0,
        gt=0,
        description="ray: CPUs per learner rank actor (learner ranks > 1; one placement group, PACK)",
    )
    learner_gpus: float = Field(
        0.0,
        ge=0,
        description="ray: GPUs per learner rank actor (learner ranks > 1), a whole number (NCCL runs one "
        "rank per GPU); > 0 needs trainer.device cuda, which for Ray ranks needs > 0",
    )
    offload_engine_weights: bool = Field(
        False,
        description="free the paged engine's weights with its KV cache before each learner update; the push "
        "after it restores them (sync mode, paged engines, full weights pushed)",
    )


class SandboxConfig(Section):
    """Where untrusted code runs: a local warm pool of jailed workers, one or several remote sandbox
    services, or warm pools inside Ray actors."""

    mode: Literal["local", "remote", "ray"] = "local"
    url: str | None = Field(
        None,
        description="remote mode: http://host:port of `posttrain sandbox serve`; several, comma-separated, "
        "make a fleet (least-loaded first, a failed service's jobs retried on another)",
    )
    token: str | None = Field(None, description="remote mode: the service's bearer token")
    ray_actors: int = Field(
        2, ge=1, description="ray mode: sandbox actors, each owning a warm pool (least in flight first)"
    )
    ray_actor_cpus: float = Field(
        1.0, gt=0, description="ray mode: CPUs reserved per sandbox actor (one placement group, SPREAD)"
    )
    pool_size: int = Field(
        0,
        ge=0,
        description="workers per profile (ray mode: per actor); 0 = follow the CPU count "
        "(ray mode: the actor's CPUs, rounded up)",
    )
    recycle_after: int = Field(500, ge=1, description="replace a worker after this many jobs")
    allow_unisolated: bool = Field(
        False, description="run without namespaces (bwrap) when unavailable: unsafe"
    )
    allow_network: bool = Field(False, description="let jobs with Limits.network=True reach the network")
    wall_time_s: float = Field(
        60.0,
        gt=0.0,
        description="ceiling on every job's wall and CPU time; an environment's job asking for less "
        "keeps its own (the test harness sizes its jobs from the tests, at most 60 s)",
    )
    memory_mb: int = Field(512, ge=16, description="memory limit (address space, per process) of every job")
    job_disk_mb: int = Field(64, ge=1, description="size of each worker's private job tmpfs")
    memory_backstop_mb: int = Field(2048, ge=64, description="cgroup memory cap per worker (all its jobs)")
    max_pids: int = Field(128, ge=8, description="cgroup pids cap per worker (worker + job processes)")
    remote_timeout_s: float = Field(
        600.0, gt=0.0, description="remote and ray modes: the client's bound on one request (batch)"
    )
    max_request_mb: int = Field(16, ge=1, description="`sandbox serve`: largest accepted request body")
    max_concurrent_jobs: int = Field(
        64, ge=1, description="`sandbox serve`: jobs executing at once (a batch of N counts N)"
    )
    service_max_wall_time_s: float = Field(
        60.0,
        gt=0.0,
        description="`sandbox serve`: a job asking for more wall or CPU time is refused with 400",
    )
    service_max_memory_mb: int = Field(
        2048, ge=16, description="`sandbox serve`: largest per-job memory limit"
    )
    service_max_processes: int = Field(64, ge=1, description="`sandbox serve`: largest per-job process count")
    request_timeout_s: float = Field(
        30.0,
        gt=0.0,
        description="`sandbox serve`: bound on reading a request and "
        "writing its reply (stalled clients are dropped)",
    )


class TelemetryConfig(Section):
    run_dir: str = "runs"
    name: str | None = Field(None, description="run directory name under run_dir (one path component)")
    jsonl: bool = True
    tensorboard: bool = True
    wandb: Literal["off", "offline", "online"] = Field(
        "off",
        description="Weights & Biases: offline writes into the run dir (upload later with `wandb sync`)",
    )
    wandb_project: str = Field("posttrain", min_length=1, description="W&B project of the run")
    progress: bool = True
    renders_every: int = Field(
        10,
        ge=0,
        description="every N steps, save the images of sampled episodes (renders the environments fed back) "
        "into the run dir's renders/, shown in the report; 0 = never",
    )
    renders_per_step: int = Field(2, ge=1, description="episodes whose images are saved at such a step")

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str | None) -> str | None:
        from posttrain.telemetry.rundir import check_run_name

        return None if v is None else check_run_name(v)


class SFTConfig(Section):
    """Supervised fine-tuning (`posttrain sft`) on the RL learner: the data source, its held-out split and
    the length of training. The optimizer settings are trainer.* (lr, warmup_steps, lr_schedule,
    max_grad_norm) and the micro-batch size batch.micro_batch_tokens, as in RL."""

    data: str | None = Field(
        None, description="a JSONL chat dataset: {messages: [...]} or {prompt, completion} per line"
    )
    from_env: str | None = Field(
        None, description="a task domain whose reference solutions (replayed through it) are the data"
    )
    levels: list[int] = Field([0], min_length=1, description="from_env: the difficulties to draw tasks from")
    n: int = Field(256, ge=1, description="from_env: training examples (tasks, round-robin over levels)")
    heldout_frac: float = Field(
        0.1,
        ge=0.0,
        lt=1.0,
        description="held-out share for the held-out loss (from_env: that many tasks of the domain's "
        "heldout split; data: rows set aside by a seeded shuffle)",
    )
    epochs: int = Field(1, ge=1, description="passes over the training examples")
    steps: int = Field(0, ge=0, description="optimizer steps; 0 = epochs x ceil(examples / batch_size)")
    batch_size: int = Field(8, ge=1, description="sequences per optimizer step")
    eval_every: int = Field(
        10, ge=0, description="held-out loss every this many steps (and at the end); 0 = off"
    )
    checkpoint_every: int = Field(0, ge=0, description="checkpoint period in steps; 0 = only at the end")
    max_seq_tokens: int = Field(
        2048, ge=2, description="longer examples are skipped (counted), never cut: a cut one loses its end"
    )
    chat_format: Literal["smollm2", "hermes"] = Field(
        "smollm2", description="the tool-call syntax that assistant tool_calls are written in (the RL loop's)"
    )

    @model_validator(mode="after")
    def _one_source(self) -> SFTConfig:
        if self.data is not None and self.from_env is not None:
            raise ValueError("give sft.data or sft.from_env, not both")
        return self


class PairsConfig(Section):
    """Preference pairs and the length of a pair-training run (`posttrain rm train`, `posttrain dpo`).
    The optimizer settings are trainer.* and the micro-batch size batch.micro_batch_tokens, as in RL."""

    data: str | None = Field(
        None,
        description='a JSONL file of {"prompt", "chosen", "rejected"} rows (prompt: a string or a messages list)',
    )
    from_env: str | None = Field(
        None,
        description="a task domain: sample samples_per_task completions per task, pair a verifier success "
        "with a failure",
    )
    levels: list[int] = Field([0], min_length=1, description="from_env: the difficulties to draw tasks from")
    n: int = Field(64, ge=1, description="from_env: training tasks sampled (round-robin over levels)")
    samples_per_task: int = Field(8, ge=2, description="from_env: completions sampled per task")
    pairs_per_task: int = Field(
        1, ge=1, description="from_env: most (success, failure) pairs taken from one task's samples"
    )
    sampler_spec: str | None = Field(
        None, description="from_env: the model that samples the completions; unset = model.spec"
    )
    temperature: float = Field(1.0, gt=0.0, description="from_env: sampling temperature")
    heldout_frac: float = Field(
        0.2,
        ge=0.0,
        lt=1.0,
        description="held-out share for the held-out accuracy (from_env: that share of n tasks from the "
        "domain's heldout split; data: rows set aside by a seeded shuffle)",
    )
    epochs: int = Field(1, ge=1, description="passes over the training pairs")
    steps: int = Field(0, ge=0, description="optimizer steps; 0 = epochs x ceil(pairs / batch_size)")
    batch_size: int = Field(8, ge=1, description="pairs per optimizer step")
    eval_every: int = Field(
        10, ge=0, description="held-out figures every this many steps (and at the end); 0 = off"
    )
    checkpoint_every: int = Field(0, ge=0, description="checkpoint period in steps; 0 = only at the end")
    max_seq_tokens: int = Field(
        2048, ge=2, description="a pair with a longer sequence is skipped (counted), never cut"
    )
    chat_format: Literal["smollm2", "hermes"] = Field(
        "smollm2", description="the tool-call syntax that assistant tool_calls in data are written in"
    )
    rm_margin: float = Field(
        0.0, ge=0.0, description="rm: the Bradley-Terry margin m in -log sigmoid(r_chosen - r_rejected - m)"
    )

    @model_validator(mode="after")
    def _one_source(self) -> PairsConfig:
        if self.data is not None and self.from_env is not None:
            raise ValueError("give pairs.data or pairs.from_env, not both")
        return self


class DPOConfig(Section):
    """`posttrain dpo`: which registered preference loss and its hyperparameters (algos.preference).
    The reference is the initial policy: the base with adapters off under LoRA, a frozen copy otherwise."""

    loss: str = Field("dpo", description="dpo | ipo | simpo")
    beta: float = Field(0.1, gt=0.0, description="dpo: the KL strength beta")
    label_smoothing: float = Field(
        0.0, ge=0.0, lt=0.5, description="dpo: the chance eps that a label is wrong (conservative DPO)"
    )
    tau: float = Field(0.1, gt=0.0, description="ipo: the target log-ratio gap is 1 / (2 tau)")
    simpo_beta: float = Field(2.0, gt=0.0, description="simpo: the scale of the length-normalised logprob")
    simpo_gamma: float = Field(1.0, ge=0.0, description="simpo: the target reward margin")
    rounds: int = Field(
        1,
        ge=1,
        description="online preference optimisation: rounds of (sample pairs.n new tasks from the current "
        "policy, pair by verifier outcome, train the steps of one round); needs pairs.from_env. 1 = offline: "
        "the pairs are sampled once, from the initial policy",
    )

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, v: str) -> str:
        from posttrain.algos import list_preference_losses

        return _registered("preference loss", v, list_preference_losses())


class RewardConfig(Section):
    """A learned reward in RL runs: a reward model scores every training rollout, and the step trains on
    verifier_weight x the verifier's reward + model_weight x the model's score (both logged apart, as
    reward_component/DOMAIN/verifier and .../reward_model). Held-out probes and eval stay on the verifier.
    A reward server that fails marks the rollouts it should have scored as infrastructure failures."""

    model: str | None = Field(
        None, description="a `posttrain rm train` run dir or its reward_model/ HF folder, loaded in process"
    )
    url: str | None = Field(None, description="http://host:port of a `posttrain rm serve` reward server")
    verifier_weight: float = Field(1.0, ge=0.0, description="weight of the environment's verifier reward")
    model_weight: float = Field(1.0, ge=0.0, description="weight of the reward model's score")
    length_penalty: float = Field(
        0.0,
        ge=0.0,
        description="subtracted per generated token from the mixed reward (a guard against a reward model "
        "that pays for length); logged as rewards.length_penalty",
    )
    batch_size: int = Field(16, ge=1, description="sequences per reward-model forward or server request")
    max_concurrent_requests: int = Field(4, ge=1, description="url: requests in flight at once")
    timeout_s: float = Field(60.0, gt=0.0, description="url: bound on one request")
    ray_actors: int = Field(
        0,
        ge=0,
        description="model: reward-model Ray actors (batch_size sequences per call, to the actor with the "
        "fewest in flight; one placement group, PACK); 0 = the model runs in this process",
    )
    ray_actor_cpus: float = Field(1.0, gt=0, description="ray_actors: CPUs (torch threads) per reward actor")

    @model_validator(mode="after")
    def _one_source(self) -> RewardConfig:
        if self.model is not None and self.url is not None:
            raise ValueError("give reward.model or reward.url, not both")
        if self.ray_actors and self.model is None:
            raise ValueError(
                "reward.ray_actors runs reward.model in Ray actors: set reward.model (a reward server at "
                "reward.url is scaled where it runs)"
            )
        if self.length_penalty and not self.enabled:
            raise ValueError(
                "reward.length_penalty applies to a learned reward: set reward.model or reward.url"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.model is not None or self.url is not None


class RunConfig(Section):
    seed: int = 0
    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
    envs: EnvsConfig = EnvsConfig()
    curriculum: CurriculumConfig = CurriculumConfig()
    batch: BatchConfig = BatchConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    trainer: TrainerConfig = TrainerConfig()
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    placement: PlacementConfig = PlacementConfig()
    sandbox: SandboxConfig = SandboxConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    sft: SFTConfig = SFTConfig()
    pairs: PairsConfig = PairsConfig()
    dpo: DPOConfig = DPOConfig()
    reward: RewardConfig = RewardConfig()
    serve: ServeConfig = ServeConfig()

    @field_validator("envs")
    @classmethod
    def _domains_unique(cls, v: EnvsConfig) -> EnvsConfig:
        names = [d.name for d in v.domains]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"domain listed twice: {sorted(dup)}")
        return v

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        self.engine.dtype = self.engine.resolved_dtype()
        if self.curriculum.retention == "default":
            self.curriculum.retention = default_retention(self.envs.domains)
        try:
            self.serve.fast_engine(self.engine)
        except ValidationError as err:
            first = err.errors()[0]
            raise ValueError(f"serve.fast: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
        if self.trainer.bf16_autocast is None:
            self.trainer.bf16_autocast = self.engine.dtype == "bfloat16"
        if self.algorithm.loss_agg == "seq_mean_token_sum_norm" and self.algorithm.loss_norm_tokens is None:
            # Dr. GRPO divides each sequence's token-loss sum by a constant, the generation budget
            self.algorithm.loss_norm_tokens = self.engine.max_new_tokens
        check_critic(self.algorithm.advantage, self.trainer.critic)
        self._check_learner_ranks()
        self._check_replay()
        self._check_weight_offload()
        self._check_engine_gpus()
        self._check_learner_gpus()
        return self

    def _check_engine_gpus(self) -> None:
        """Ray makes an actor's reserved GPUs its only visible ones (cuda:0 first), and none when it
        reserves none: placement.engine_gpus and engine.device must agree."""
        p, device = self.placement, self.engine.device
        cuda = device.startswith("cuda")
        if p.engine_gpus > 0 and p.backend != "ray":
            raise ValueError(
                f"placement.engine_gpus={p.engine_gpus} reserves GPUs for Ray engine actors: set "
                "placement.backend=ray, or leave engine_gpus 0 (a local engine uses engine.device)"
            )
        if p.backend != "ray":
            return
        if p.engine_gpus > 0 and not cuda:
            raise ValueError(
                f"placement.engine_gpus={p.engine_gpus} with engine.device={device}: the engine would not "
                "use its GPU; set engine.device=cuda (or engine_gpus 0)"
            )
        if cuda and p.engine_gpus == 0:
            raise ValueError(
                f"engine.device={device} with placement.backend=ray and placement.engine_gpus=0: Ray hides "
                "the GPUs from an actor that reserves none; set placement.engine_gpus (e.g. 1)"
            )
        index = device.partition(":")[2]
        if cuda and index.isdigit() and int(index) >= math.ceil(p.engine_gpus):
            raise ValueError(
                f"engine.device={device} in a Ray actor of placement.engine_gpus={p.engine_gpus}: the actor "
                f"sees its {math.ceil(p.engine_gpus)} GPU(s) as cuda:0..; use engine.device=cuda"
            )

    def _check_learner_gpus(self) -> None:
        """placement.learner_gpus and trainer.device must agree, as engine_gpus and engine.device do; NCCL
        runs one learner rank per GPU. Whether this machine has CUDA is checked where the learner starts
        (`train.learner_device`): this config is validated again inside Ray actors that may see no GPU."""
        p, device = self.placement, self.trainer.device
        cuda, ranks, ray = device.startswith("cuda"), self.trainer.learner_ranks, p.backend == "ray"
        if p.learner_gpus > 0 and not (ray and ranks > 1):
            raise ValueError(
                f"placement.learner_gpus={p.learner_gpus} reserves GPUs for Ray learner rank actors: set "
                "placement.backend=ray with learner ranks > 1 (trainer.data_parallel, ...), or leave it 0 "
                "(a learner in this process or in local rank processes uses trainer.device)"
            )
        index = device.partition(":")[2]
        if cuda and index and ranks > 1 and not ray:
            raise ValueError(
                f"trainer.device={device} with {ranks} learner ranks: NCCL needs one GPU per rank; set "
                "trainer.device=cuda (rank r takes cuda:(r % GPUs))"
            )
        if not (ray and ranks > 1):
            return
        if p.learner_gpus > 0 and not cuda:
            raise ValueError(
                f"placement.learner_gpus={p.learner_gpus} with trainer.device={device}: the learner ranks "
                "would not use their GPUs; set trainer.device=cuda (or learner_gpus 0)"
            )
        if cuda and p.learner_gpus == 0:
            raise ValueError(
                f"trainer.device={device} with Ray learner ranks and placement.learner_gpus=0: Ray hides "
                "the GPUs from an actor that reserves none; set placement.learner_gpus (e.g. 1)"
            )
        if p.learner_gpus != int(p.learner_gpus):
            raise ValueError(
                f"placement.learner_gpus={p.learner_gpus}: NCCL runs one learner rank per GPU, not a share "
                "of one; use a whole number"
            )
        if cuda and index and int(index) >= p.learner_gpus:
            raise ValueError(
                f"trainer.device={device} in a Ray actor of placement.learner_gpus={p.learner_gpus}: the "
                f"actor sees its {int(p.learner_gpus)} GPU(s) as cuda:0..; use trainer.device=cuda"
            )

    def _check_weight_offload(self) -> None:
        """placement.offload_engine_weights frees what the next push restores, so every push must bring
        every weight, and nothing may generate between the release and that push."""
        if not self.placement.offload_engine_weights:
            return
        why = None
        if self.orchestrator.mode == "async":
            why = "orchestrator.mode=async generates during the update; use mode sync"
        elif self.engine.backend != "paged":
            why = f"engine.backend={self.engine.backend} has no weight release; use backend paged"
        elif self.model.lora_rank and self.placement.weight_sync != "in_process":
            why = (
                f"LoRA pushes through placement.weight_sync={self.placement.weight_sync} carry only the "
                "adapters, not the weights released; use weight_sync in_process"
            )
        if why is not None:
            raise ValueError(f"placement.offload_engine_weights: {why}")

    def _check_replay(self) -> None:
        """Replay of general data is one process's term; its KL form needs whole rows and the whole vocabulary."""
        if self.algorithm.replay_fraction <= 0 and self.curriculum.retention_replay_gain <= 0:
            return
        t = self.trainer
        if t.data_parallel > 1:
            raise ValueError(
                f"algorithm.replay_fraction (or curriculum.retention_replay_gain) with trainer.data_parallel="
                f"{t.data_parallel}: the replay term is computed on one process; set data_parallel to 1"
            )
        if self.algorithm.replay_loss == "kl" and (t.context_parallel > 1 or t.tensor_parallel > 1):
            raise ValueError(
                "algorithm.replay_loss=kl needs whole rows and the whole vocabulary on one process: not with "
                f"trainer.context_parallel={t.context_parallel} / tensor_parallel={t.tensor_parallel}; use "
                "replay_loss=nll"
            )

    def _check_learner_ranks(self) -> None:
        t, p = self.trainer, self.placement
        if p.learner_ranks is not None and p.learner_ranks != t.learner_ranks:
            raise ValueError(
                f"placement.learner_ranks={p.learner_ranks} but trainer.data_parallel x tensor_parallel x "
                f"context_parallel = {t.learner_ranks}: make them equal (or unset placement.learner_ranks)"
            )


def check_critic(advantage: str, critic: str) -> None:
    """Refuse an advantage estimator that needs a value function (it declares `needs_values`) without one."""
    from posttrain.algos import needs_values

    if critic == "none" and needs_values(advantage):
        raise ValueError(
            f"algorithm.advantage={advantage} needs a value function: set trainer.critic to 'copy' or 'separate'"
        )


def _registered(kind: str, name: str, names: list[str]) -> str:
    if name in names:
        return name
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise ValueError(f"unknown {kind} '{name}'{hint} (registered: {', '.join(names)})")


# ----------------------------------------------------------------------------------------------
# loading, overrides, errors

# keys that existed once and do nothing now: where their job went (or why there is none)
REMOVED_KEYS: dict[str, tuple[str | None, str]] = {
    "engine.quantize_lm_head": (
        "engine.lm_head_quant",
        "the output projection has its own choice: same (as weight_quant), none, int8, int8_weight_only, int4",
    ),
    "engine.temperature": (
        "algorithm.temperature",
        "the rollout sampling temperature is algorithm.temperature, which the learner divides by",
    ),
    "placement.device": (
        "engine.device",
        "engine.device picks the engine's torch device, trainer.device the learner's",
    ),
    "placement.num_gpus": (
        "placement.engine_gpus",
        "GPUs are reserved per Ray actor: placement.engine_gpus per rollout engine (placement.num_engines "
        "of them), placement.learner_gpus per Ray learner rank actor",
    ),
    "placement.num_nodes": (
        "placement.ray_address",
        "nodes are those of the Ray cluster at placement.ray_address; Ray places the actors on them",
    ),
    "sandbox.max_concurrent_requests": (
        "sandbox.max_concurrent_jobs",
        "the service counts jobs, not requests",
    ),
}
# keys that live under another name now, same meaning and default: the error names the new key
MOVED_KEYS: dict[str, str] = {
    "orchestrator.tasks_per_step": "batch.prompts_per_step",
    "algorithm.group_size": "batch.samples_per_prompt",
    "trainer.mini_batches": "batch.mini_batches",
    "trainer.ppo_epochs": "batch.ppo_epochs",
    "trainer.micro_batch_tokens": "batch.micro_batch_tokens",
    "algorithm.gspo_clip_low": "algorithm.policy_loss.clip_low",
    "algorithm.gspo_clip_high": "algorithm.policy_loss.clip_high",
}
# what a moved key's new home needs besides its name
MOVED_NOTES: dict[str, str] = {
    "algorithm.gspo_clip_low": "with algorithm.policy_loss.type=gspo",
    "algorithm.gspo_clip_high": "with algorithm.policy_loss.type=gspo",
}


def _valid_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        keys.append(path)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.extend(_valid_keys(ann, path + "."))
    return keys


def _format_loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    all_keys = _valid_keys(RunConfig)
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if p not in ("function-after[_cross_checks()]",))
        key = _format_loc(loc)
        if e["type"] == "extra_forbidden":
            # suggest the closest key among siblings first, then among all keys
            parent = ".".join(str(p) for p in loc[:-1] if not isinstance(p, int))
            leaf = str(loc[-1])
            siblings = (
                [k.split(".")[-1] for k in all_keys if k.rsplit(".", 1)[0] == parent and "." in k]
                if parent
                else [k for k in all_keys if "." not in k]
            )
            match = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.5)
            hint = f"; did you mean '{(parent + '.') if parent else ''}{match[0]}'?" if match else ""
            path = f"{parent}.{leaf}" if parent else leaf
            removed = REMOVED_KEYS.get(path)
            if removed is not None:
                target, why = removed
                hint = (f"; did you mean '{target}'?" if target else "") + f" (removed: {why})"
            if path in MOVED_KEYS:
                note = f", {MOVED_NOTES[path]}" if path in MOVED_NOTES else ""
                hint = f"; moved to '{MOVED_KEYS[path]}' (same meaning and default{note})"
            valid = ", ".join(sorted(siblings)) if siblings else ""
            lines.append(f"unknown key '{key}'{hint} (valid keys here: {valid})")
        else:
            value = e.get("input")
            shown = json.dumps(value, default=str) if not isinstance(value, dict) else "{...}"
            where = f"'{key}'" if key else "config"
            hint = ""
            if e["type"] == "literal_error" and isinstance(value, str):
                choices = re.findall(r"'([^']*)'", str(e.get("ctx", {}).get("expected", "")))
                close = difflib.get_close_matches(value, choices, n=1, cutoff=0.5)
                hint = f"; did you mean '{close[0]}'?" if close else ""
            lines.append(f"{where}: got {shown}: {e['msg']}{hint}")
    return "invalid config:\n  " + "\n  ".join(lines)


def parse_override_value(raw: str) -> Any:
    """Type an override value the way YAML would: 3 -> int, 1e-5 -> float, true -> bool, [a,b] -> list."""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    # YAML reads '1e-5' as a string (it wants '1.0e-5'); accept the form people type.
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") else value
        except ValueError:
            return value
    return value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides to a nested dict (copied). Lists of sections index as a.0.b."""
    import copy

    data = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. trainer.lr=1e-5)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"override '{item}' has an empty key")
        parts = key.split(".")
        node: Any = data
        for i, part in enumerate(parts[:-1]):
            if isinstance(node, list):
                try:
                    node = node[int(part)]
                except (ValueError, IndexError):
                    raise ConfigError(
                        f"override '{key}': '{part}' is not a valid index into {'.'.join(parts[:i])}"
                    ) from None
                continue
            if part not in node or not isinstance(node[part], dict | list):
                node[part] = {} if part not in node else node[part]
                if not isinstance(node[part], dict | list):
                    raise ConfigError(
                        f"override '{key}': '{'.'.join(parts[: i + 1])}' is a value, not a section"
                    )
            node = node[part]
        leaf = parts[-1]
        if isinstance(node, list):
            try:
                node[int(leaf)] = parse_override_value(raw)
            except (ValueError, IndexError):
                raise ConfigError(f"override '{key}': '{leaf}' is not a valid index") from None
        else:
            node[leaf] = parse_override_value(raw)
    return data


def _moved_in(err: ValidationError) -> dict[str, str]:
    """The MOVED_KEYS among the unknown keys of `err`: old name -> new name."""
    unknown = (".".join(str(p) for p in e["loc"]) for e in err.errors() if e["type"] == "extra_forbidden")
    return {key: MOVED_KEYS[key] for key in unknown if key in MOVED_KEYS}


def config_from_dict(data: dict) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err), moved=_moved_in(err)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML config (or the defaults when path is None), apply overrides, validate."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p} (give a YAML file, e.g. configs/default.yaml)")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {p} is not valid YAML: {err}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"config file {p} must hold a mapping at the top level, got {type(loaded).__name__}"
            )
        data = loaded
    if overrides:
        base = config_to_dict(config_from_dict(data))
        # validation resolved engine.dtype 'auto', an unset trainer.bf16_autocast and algorithm.loss_norm_tokens;
        # put back what was given, so that an override of what they depend on (engine.dtype, engine.device,
        # engine.max_new_tokens) resolves them anew
        given = {
            sec: data.get(sec) if isinstance(data.get(sec), dict) else {}
            for sec in ("engine", "trainer", "algorithm")
        }
        base["engine"]["dtype"] = given["engine"].get("dtype", "auto")
        base["trainer"]["bf16_autocast"] = given["trainer"].get("bf16_autocast")
        base["algorithm"]["loss_norm_tokens"] = given["algorithm"].get("loss_norm_tokens")
        data = apply_overrides(base, overrides)
    return config_from_dict(data)


def config_to_dict(cfg: RunConfig) -> dict:
    return cfg.model_dump(mode="json")


def config_to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write `cfg` as YAML atomically (temp file, fsync, rename): a crash leaves the old file or the new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        fh.write(config_to_yaml(cfg))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
