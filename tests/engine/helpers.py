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


# chi-square critical values at p = 0.001 for 1 .. 20 degrees of freedom
_CHI2_CRITICAL = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26, 32.91]
_CHI2_CRITICAL += [34.53, 36.12, 37.70, 39.25, 40.79, 42.31, 43.82, 45.31]


def assert_same_token_distribution(a_completions, b_completions, pos: int) -> None:
    """Two-sample chi-square (p = 0.001) on the token at `pos` of two equally many completions; tokens
    seen fewer than 20 times in both are pooled (expected counts >= 5)."""
    a = [c.token_ids[pos] for c in a_completions]
    b = [c.token_ids[pos] for c in b_completions]
    assert len(a) == len(b)
    common = [t for t in sorted(set(a) | set(b)) if a.count(t) + b.count(t) >= 20]
    table = [(a.count(t), b.count(t)) for t in common]
    rest = (len(a) - sum(x for x, _ in table), len(b) - sum(y for _, y in table))
    table += [rest] if sum(rest) else []
    chi = sum((x - (x + y) / 2) ** 2 / ((x + y) / 2) * 2 for x, y in table)
    assert 2 <= len(table) <= 21 and chi < _CHI2_CRITICAL[len(table) - 2], (pos, table)
