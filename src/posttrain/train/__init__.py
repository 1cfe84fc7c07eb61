"""The Learner: forward logprobs, micro-batching, optimizer, LoRA/full, checkpoint I/O of learner state.

It does not know about environments, engines or rewards' meaning: it trains on `Sample`s.

API used by the RL loop::

    from posttrain.train import Learner, Sample

    Sample(token_ids, loss_mask, behavior_logprobs, reward, group_id, policy_version=0)
        # one trajectory as the engine's token ids; loss_mask 1 on generated tokens (loss_mask[0] must
        # be 0: the first token has no logprob); behavior_logprobs from the engine (0.0 where mask 0)

    learner = Learner(model_cfg, trainer_cfg, algo_cfg=None, seed=0, model=None, critic_model=None, batch_cfg=None,
                      plan=None)
        # built in stages: train/parts.py builds the parts, the Learner applies its plan (a
        # train.distributed.ParallelPlan: dp, tp, cp) to them, train/optim.py builds the optimizers from
        # the split parts; learner.replan(plan) splits an unsplit, never-updated one;
        # algo_cfg None: the RL defaults (SFT needs none);
        # batch_cfg: mini_batches, ppo_epochs, micro_batch_tokens of the update (None: the defaults);
        # LoRA when model_cfg.lora_rank > 0 (reference = adapters disabled, no second copy);
        # full fine-tuning keeps a frozen reference copy only when algo_cfg.kl_coef > 0;
        # critic per trainer_cfg.critic: "none" | "copy" (value head on a copy of the policy's
        # decoder) | "separate" (value head on trainer_cfg.critic_spec's decoder, same tokenizer)
    metrics = learner.step(samples, current_version=None)   # one whole RL update; version += 1
    learner.prepare(samples) -> PreparedBatch; learner.update(prepared) -> dict  # step's two phases
        # prepared.old: the old logprobs, or FROM_FORWARD in single pass (the training forward gives them)
        # the loss is the sum of the terms in learner.terms (train/terms.py): algorithm.policy_loss
        # ({type: ppo_clip | gspo | custom, ...}), MoE aux, entropy, KL; with a critic learner.critic_terms
    learner.compute_logprobs(batch_or_samples) -> Tensor [B, L]  # 0 where loss_mask is 0
    learner.update(batch) -> dict                           # also on a Batch with old_logprobs, advantages
    learner.sft_step(samples) -> dict                       # one supervised step: token-mean NLL of the mask
    learner.sft_loss(samples) -> dict                       # that NLL without training (held-out loss)
    learner.preference_step(chosen, rejected, "dpo", beta=0.1) -> dict  # DPO/IPO/SimPO step on pairs
    learner.preference_eval(chosen, rejected, "dpo", beta=0.1) -> dict  # its loss/margin/accuracy, no step
    new_reward_model(spec) / load_reward_model(folder) -> RewardModel   # scalar head, HF seq-cls folder
    RewardLearner(reward_model, trainer_cfg, batch_cfg).step(chosen_ids, rejected_ids)  # Bradley-Terry
    encode_chat(tokenizer, messages, tools) -> (ids, mask)  # SFT: mask = the assistant tokens + their EOS
    learner.weights() -> dict[str, Tensor]                  # HF names, LoRA merged, for the engine
    learner.lora_base() / learner.lora_update(version)      # LoRA: base weights, adapters (train/weights.py)
    learner.attach_image_store(store) / learner.image_store # vision-language policies' image source
    learner.state_dict() / learner.load_state_dict(state)   # everything; bit-identical continuation
    learner.save(directory) / Learner.load(directory, model=None)  # atomic checkpoint folder
    learner.offload_optimizer() / learner.reload_optimizer()  # AdamW state to/from CPU (no-op on CPU)
    learner.version                                          # bumps after each step
    learner_device(trainer_cfg.device, rank) -> torch.device # where the Learner puts its tensors

Set `algorithm.temperature` to the engine's sampling temperature: the learner divides logits by it so
its logprobs and the behaviour logprobs describe the same distribution.

Metrics of `step` (all floats): loss, kl (when kl_coef > 0), kl_loss, entropy, clipfrac, approx_kl,
ratio_max, grad_norm, lr, value_loss / vf_clipfrac / critic_grad_norm / value_mean (with a critic),
mismatch_abs_log_ratio, mismatch_max_abs_log_ratio, mismatch_kl_k3, tis_clip_frac,
ratio_masked_frac, reward_mean, reward_std, zero_signal_group_frac, advantage_mean,
advantage_abs_mean, kl_coef, staleness_mean, staleness_max, sequences, tokens (generated),
sequence_tokens, update_tokens, update_tokens_per_s, padding_frac, shared_prefix_frac, prepare_s,
update_s, step_s,
optimizer_steps, version.

Micro-batches (trainer.share_prompt_prefix, default on): the rows of one GRPO group whose prompt is
identical run as one packed row, the prompt once and then every row's completion back to back, under
a mask that lets each completion see the prompt and its own earlier tokens
(`forward.shared_prefix_hidden`). A group of 8 with a 100-token prompt computes 100 + the sum of its
completions' lengths positions instead of 8 x (100 + the longest completion), in one long row. Logprobs
and gradients equal the plain forward up to float rounding (tested). Other rows are padded (trainer.packing=false, the default) or packed first-fit-
decreasing into block-diagonal rows. `posttrain bench learner --json` (32 sequences of 64..256 tokens,
3 repeats, medians) measured packed/padded tokens/s of 0.79 (full fp32), 0.80 (full bf16), 0.90 (LoRA
fp32) and 0.94 (LoRA bf16): packing saved almost no padding (18.4% vs 19.4%: rows are as long as the
longest sequence) and its 4-D block mask is slower, so padded is the default.

Single pass (trainer.single_pass_old_logprobs, default on): with one optimizer step over the batch, no
critic, no KL in the reward and no ratio masking, the PPO ratio's denominator is the training
forward's own logprobs, detached (ratio exactly 1, same gradient); the separate no-grad forward is
skipped.
"""

from posttrain.train.batch import Batch, Sample, build_batch
from posttrain.train.learner import Learner, learner_device, lr_factor
from posttrain.train.reward_model import (
    RewardLearner,
    RewardModel,
    load_reward_model,
    new_reward_model,
    tokenizer_fingerprint,
)
from posttrain.train.sft import encode_chat, sft_sample
from posttrain.train.state import merged_weights, save_learner

load_learner = Learner.load  # rebuild a Learner from a checkpoint folder

__all__ = [
    "Batch",
    "Learner",
    "RewardLearner",
    "RewardModel",
    "Sample",
    "build_batch",
    "encode_chat",
    "learner_device",
    "load_learner",
    "load_reward_model",
    "lr_factor",
    "merged_weights",
    "new_reward_model",
    "save_learner",
    "sft_sample",
    "tokenizer_fingerprint",
]
