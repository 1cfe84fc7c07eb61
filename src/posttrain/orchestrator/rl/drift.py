"""Drift probes that need no verifier: how far the policy has moved from where it started on general
prompts outside every training domain.

At the start of a run the engine (still holding the initial policy, the reference) samples one
completion of each of `GENERAL_PROMPTS` (T=1, fixed seeds), and the learner scores those tokens:
the reference's logprobs and entropy. Every `curriculum.drift_every` steps the learner scores the same
tokens again with the current policy (one forward, no generation) and reports, over the completion
tokens:

- `drift/kl_k3`: mean of exp(r) - 1 - r with r = log p_policy - log p_ref: Schulman's k3 estimator of
  KL(ref || policy) per token, unbiased because the tokens are the reference's own samples, and >= 0;
- `drift/kl_k1`: mean of log p_ref - log p_policy, the plain estimator of the same KL;
- `drift/entropy` and `drift/ref_entropy`: the policy's and the reference's mean per-token entropy.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from posttrain.types import Message

# instructions of no training domain: writing, explanation, advice, everyday knowledge
GENERAL_PROMPTS = [
    "Write a short poem about the sea.",
    "Explain why the sky is blue in two sentences.",
    "Give three tips for sleeping better.",
    "What is the capital of France, and what is it famous for?",
    "Describe your favourite season and why.",
    "Write a friendly email inviting a colleague to lunch.",
    "Summarize the story of Little Red Riding Hood.",
    "What are the benefits of regular exercise?",
    "Translate 'good morning, how are you?' into Spanish.",
    "Suggest a name for a small coffee shop and explain it.",
    "How do plants make their food?",
    "Write two sentences about a cat who loves to travel.",
    "What should I pack for a weekend hiking trip?",
    "Explain what a rainbow is to a five-year-old.",
    "Give a recipe idea that uses tomatoes and basil.",
    "Why do people keep diaries?",
]


class DriftProbe:
    """The reference's completions of the general prompts and its scores of them (see the module doc)."""

    def __init__(
        self, samples: list[Any], ref_logprobs: torch.Tensor, ref_entropy: torch.Tensor, mask: torch.Tensor
    ):
        self.samples = samples
        self.ref_logprobs = ref_logprobs
        self.ref_entropy = ref_entropy
        self.mask = mask

    @classmethod
    def build(
        cls,
        engine: Any,
        tokenizer: Any,
        learner: Any,
        *,
        n_prompts: int,
        max_tokens: int,
        seed: int,
        loop: asyncio.AbstractEventLoop,
    ) -> DriftProbe:
        """Sample the reference's completions with `engine` (it must still hold the initial policy) and
        score them with `learner` (likewise)."""
        if not 1 <= n_prompts <= len(GENERAL_PROMPTS):
            raise ValueError(f"curriculum.drift_prompts must be 1..{len(GENERAL_PROMPTS)}, got {n_prompts}")
        samples = reference_completions(
            engine, tokenizer, GENERAL_PROMPTS[:n_prompts], max_tokens=max_tokens, seed=seed, loop=loop
        )
        if not samples:
            raise ValueError("the drift probe's reference completions are all empty")
        lp, ent, mask = learner.score_tokens(samples)
        return cls(samples, lp, ent, mask)

    def measure(self, learner: Any) -> dict[str, float]:
        """The drift figures of the learner's current policy against the reference."""
        lp, ent, _ = learner.score_tokens(self.samples)
        m = self.mask > 0
        r = (lp - self.ref_logprobs)[m].double()
        return {
            "drift/kl_k3": float((torch.exp(r) - 1 - r).mean()),
            "drift/kl_k1": float((-r).mean()),
            "drift/entropy": float(ent[m].double().mean()),
            "drift/ref_entropy": float(self.ref_entropy[m].double().mean()),
            "drift/tokens": float(m.sum()),
        }


def reference_completions(
    engine: Any,
    tokenizer: Any,
    prompts: list[str],
    *,
    max_tokens: int,
    seed: int,
    loop: asyncio.AbstractEventLoop,
) -> list[Any]:
    """One completion of each user prompt, sampled by `engine` at T=1 with a fixed seed per prompt, as
    `train.Sample`s (loss mask on the completion, the engine's logprobs); empty completions left out."""
    from posttrain.engine import GenerationRequest, SamplingParams
    from posttrain.models.chat import encode_messages
    from posttrain.train import Sample

    encoded = [encode_messages(tokenizer, [Message("user", p)]) for p in prompts]

    async def sample_all() -> list[Any]:
        return list(
            await asyncio.gather(
                *(
                    engine.agenerate(
                        GenerationRequest(
                            prompt_token_ids=ids,
                            params=SamplingParams(
                                temperature=1.0, max_tokens=max_tokens, seed=seed * 7919 + i
                            ),
                        )
                    )
                    for i, ids in enumerate(encoded)
                )
            )
        )

    outs = loop.run_until_complete(sample_all())
    samples = []
    for ids, out in zip(encoded, outs, strict=True):
        completion = list(out.completions[0].token_ids)
        if not completion:
            continue
        samples.append(
            Sample(
                ids + completion,
                [0] * len(ids) + [1] * len(completion),
                [0.0] * len(ids) + [float(x) for x in out.completions[0].logprobs],
                reward=0.0,
                group_id=len(samples),
                policy_version=0,
            )
        )
    return samples
