"""Planted preference pairs for the pair-training tests: "<w> is good" preferred to "<w> is bad"."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = "apple river stone cloud tiger piano garden rocket candle forest mirror bridge violin desert".split()


def planted_pairs(path: Path, n: int, seed: int = 0) -> Path:
    """Write `n` seeded JSONL pair rows to `path` and return it."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        w = f"{rng.choice(WORDS)} {rng.choice(WORDS)}"
        rows.append(
            json.dumps({"prompt": f"Tell me about {w}.", "chosen": f"{w} is good", "rejected": f"{w} is bad"})
        )
    path.write_text("\n".join(rows) + "\n")
    return path
