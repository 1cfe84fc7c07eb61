"""Lengths in tokens of the model's own tokenizer, for generators that size a document to a level:
`count_tokens`, and `fit_to_tokens`, the largest amount of filler whose rendering stays within a budget.
Does not know any domain.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=4)
def _tokenizer(spec: str) -> Any:
    from posttrain.models.loading import load_tokenizer

    return load_tokenizer(spec)


def count_tokens(text: str, tokenizer_spec: str) -> int:
    return len(_tokenizer(tokenizer_spec)(text, add_special_tokens=False)["input_ids"])


def fit_to_tokens(render: Callable[[int], str], target_tokens: int, tokenizer_spec: str) -> tuple[int, int]:
    """(k, tokens): the largest k whose `render(k)` is at most `target_tokens` tokens long, and its length.

    Searched on exact counts of whole renderings (doubling, then bisection), assuming more filler never
    makes the text shorter; k = 0 when even the bare rendering is longer."""
    lo, lo_tokens = 0, count_tokens(render(0), tokenizer_spec)
    if lo_tokens > target_tokens:
        return 0, lo_tokens
    hi = 1
    while (n := count_tokens(render(hi), tokenizer_spec)) <= target_tokens:
        lo, lo_tokens, hi = hi, n, hi * 2
    while hi - lo > 1:  # render(lo) fits, render(hi) does not
        mid = (lo + hi) // 2
        n = count_tokens(render(mid), tokenizer_spec)
        if n <= target_tokens:
            lo, lo_tokens = mid, n
        else:
            hi = mid
    return lo, lo_tokens
