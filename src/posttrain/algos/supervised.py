"""The supervised loss of SFT: the negative log-likelihood of the target (assistant) tokens.

Weighted by `aggregation_weights(mask, "token_mean")` of the whole optimizer batch, the sums of its
micro-batches add up to exactly the batch's token-mean NLL. A pure function, like the RL losses.
"""

from __future__ import annotations

from torch import Tensor


def masked_nll(logprobs: Tensor, weights: Tensor) -> Tensor:
    """sum_t -logprobs[t] * weights[t] (`logprobs` are 0 off the mask; `weights` 0 there too)."""
    return -(logprobs * weights.to(logprobs.dtype)).sum()
