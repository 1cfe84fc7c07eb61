"""Arms of the curriculum bandit: one (domain, difficulty) pair each, and their string keys.

Owns the `Arm` type, its `"domain:difficulty"` key used in logs and saved state, and the checks that
a list of arms is usable. It does not know which domains exist (that is `posttrain.envs`).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import NamedTuple


class Arm(NamedTuple):
    domain: str
    difficulty: int

    @property
    def key(self) -> str:
        return f"{self.domain}:{self.difficulty}"


def arm_from_key(key: str) -> Arm:
    """Parse `"math:2"` back into `Arm("math", 2)`."""
    domain, sep, level = key.rpartition(":")
    if not sep or not domain:
        raise ValueError(f"arm key '{key}' is not of the form 'domain:difficulty' (e.g. 'math:0')")
    try:
        return Arm(domain, int(level))
    except ValueError:
        raise ValueError(f"arm key '{key}': difficulty '{level}' is not an integer") from None


def check_arms(arms: Iterable[object]) -> list[Arm]:
    """Validate and normalise a list of arms (tuples are accepted); raise ValueError naming the problem."""
    out: list[Arm] = []
    for raw in arms:
        if not isinstance(raw, tuple) or len(raw) != 2:
            raise ValueError(f"arm {raw!r} is not a (domain, difficulty) pair")
        domain, difficulty = raw
        if not isinstance(domain, str) or not domain.strip():
            raise ValueError(f"arm {raw!r}: domain must be a non-empty string")
        if ":" in domain:
            raise ValueError(f"arm {raw!r}: domain '{domain}' must not contain ':' (it separates the key)")
        if isinstance(difficulty, bool) or not isinstance(difficulty, numbers.Integral) or difficulty < 0:
            raise ValueError(f"arm {raw!r}: difficulty must be an integer >= 0, got {difficulty!r}")
        out.append(Arm(domain, int(difficulty)))
    if not out:
        raise ValueError("the curriculum needs at least one arm (domain, difficulty); got none")
    keys = [a.key for a in out]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise ValueError(f"arm listed twice: {dup}")
    return out
