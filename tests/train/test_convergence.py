"""Convergence: GRPO and PPO-with-critic raise the reward of a tiny verifiable task (catches sign errors).

Task: prompt [1, p, 2] with p in 3..6; the model answers two tokens in a 16-token vocabulary and
scores 1 when the first is p + 4 (the second is free). A random policy scores about 1/16. Rollouts come from a
plain sampler over the learner's own model (the engine is another package).
"""

from __future__ import annotations

import time

import torch

from posttrain.config import AlgorithmConfig, BatchConfig, ModelConfig, TrainerConfig
from posttrain.train import Learner, Sample

VOCAB = 16
PROMPTS = [3, 4, 5, 6]


def tiny_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


ANSWER_LEN = 2


def reward(p: int, answer: list[int]) -> float:
    """1 when the first answer token is p + 4; the second token is free (it must not matter)."""
    return float(answer[0] == p + 4)


@torch.no_grad()
def rollout(learner: Learner, group_size: int, gen: torch.Generator, step: int) -> list[Sample]:
    model = learner.model
    prompts = torch.tensor([[1, p, 2] for p in PROMPTS for _ in range(group_size)])
    seqs, lps = prompts, []
    for _ in range(ANSWER_LEN):
        logp = torch.log_softmax(model(seqs).logits[:, -1].float(), dim=-1)
        tok = torch.multinomial(logp.exp(), 1, generator=gen)
        lps.append(logp.gather(1, tok))
        seqs = torch.cat([seqs, tok], 1)
    out = []
    for i, row in enumerate(seqs.tolist()):
        out.append(
            Sample(
                token_ids=row,
                loss_mask=[0, 0, 0, 1, 1],
                behavior_logprobs=[0.0, 0.0, 0.0, float(lps[0][i]), float(lps[1][i])],
                reward=reward(row[1], row[3:]),
                group_id=step * 100 + i // group_size,
                policy_version=learner.version,
            )
        )
    return out


def mean_reward(samples: list[Sample]) -> float:
    return sum(s.reward for s in samples) / len(samples)


def train(
    algo: AlgorithmConfig, trainer: TrainerConfig, batch: BatchConfig, steps: int, group_size: int = 8
) -> tuple[float, list[float]]:
    learner = Learner(
        ModelConfig(spec="tiny:llama"), trainer, algo, seed=0, model=tiny_model(), batch_cfg=batch
    )
    gen = torch.Generator().manual_seed(1)
    history = []
    initial = mean_reward(rollout(learner, 64, gen, -1))
    for step in range(steps):
        samples = rollout(learner, group_size, gen, step)
        learner.step(samples)
        history.append(mean_reward(samples))
        if step >= 5 and sum(history[-3:]) / 3 > 0.95:
            break
    final = mean_reward(rollout(learner, 64, gen, 10_000))
    history.append(final)
    return initial, history


def test_grpo_converges():
    t0 = time.process_time()  # CPU seconds: wall time on a shared machine says little
    algo = AlgorithmConfig(advantage="grpo", policy_loss="ppo_clip", clip_low=0.2, clip_high=0.28)
    trainer, batch = TrainerConfig(lr=5e-3), BatchConfig(mini_batches=2, ppo_epochs=1)
    initial, history = train(algo, trainer, batch, steps=80)
    assert initial < 0.2, initial
    assert history[-1] > 0.8, history
    assert time.process_time() - t0 < 120


def test_ppo_with_critic_converges():
    t0 = time.process_time()  # CPU seconds: wall time on a shared machine says little
    algo = AlgorithmConfig(advantage="gae", policy_loss="ppo_clip", gamma=1.0, lam=0.95)
    trainer = TrainerConfig(lr=3e-3, critic="copy", critic_lr=1e-2)
    initial, history = train(algo, trainer, BatchConfig(mini_batches=2, ppo_epochs=1), steps=80)
    assert initial < 0.2, initial
    assert history[-1] > 0.8, history
    assert time.process_time() - t0 < 120
