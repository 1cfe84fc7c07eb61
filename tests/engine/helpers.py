"""Helpers for the engine tests: tiny random models (one per family), random prompts, HF references."""

from __future__ import annotations

import functools

import torch

from posttrain.models import load_policy


@functools.cache
def tiny(family: str, seed: int = 0):
    return load_policy(f"tiny:{family}", seed=seed)


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 49152) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def hf_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> list[float]:
    """Logprob of each completion token under a full-sequence forward (no KV cache)."""
    logits = model(torch.tensor([prompt + completion])).logits[0].float()
    if temperature > 0:
        logits = logits / temperature
    lp = torch.log_softmax(logits, -1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(completion)]
