"""Pure functions behind the samplers: per-group signals, softmax, bounded renormalisation and the
adaptive sampling rule.

Everything here is a function of its arguments (numpy arrays and floats); the samplers in
`samplers.py` own the state these are computed from. No randomness lives here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def group_abs_dev(group: Sequence[float]) -> float:
    """Mean |r - group mean| of one group: the learnability numerator (2p(1-p) for binary rewards)."""
    r = np.asarray(group, dtype=np.float64)
    return float(np.mean(np.abs(r - r.mean())))


def grpo_abs_advantages(group: Sequence[float], std_eps: float = 1e-6) -> np.ndarray:
    """|A_i| with GRPO's group normalisation A = (r - mean) / (std + eps), population std.

    All-equal groups give zeros. For binary rewards the mean is 2*sqrt(p(1-p)) (the signal sec/dump use).
    """
    r = np.asarray(group, dtype=np.float64)
    std = float(r.std())
    if std == 0.0:
        return np.zeros_like(r)
    return np.abs(r - r.mean()) / (std + std_eps)


def softmax(x: np.ndarray) -> np.ndarray:
    z = np.asarray(x, dtype=np.float64)
    z = np.exp(z - z.max())
    return z / z.sum()


def minmax(x: np.ndarray) -> np.ndarray:
    """Scale to [0, 1] across arms; all-equal input maps to zeros (no preference)."""
    x = np.asarray(x, dtype=np.float64)
    span = float(x.max() - x.min())
    if span <= 1e-12:
        return np.zeros_like(x)
    return (x - x.min()) / span


def bounded_renormalise(w: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Renormalise non-negative weights to sum to 1 with every entry in [lo, hi], by water-filling.

    Caps first: entries above `hi` are set to `hi` and the mass they lose is spread over the other
    entries in proportion to their weights; repeated until none exceeds `hi` (at most K rounds). Then
    the same for the floor: entries below `lo` are raised to `lo` and the others scaled down in
    proportion (this cannot push any of them above `hi`). Needs K*lo <= 1 <= K*hi.
    """
    w = np.asarray(w, dtype=np.float64)
    k = len(w)
    if k == 0:
        raise ValueError("bounded_renormalise: no weights")
    if np.any(w < 0) or not np.all(np.isfinite(w)):
        raise ValueError(f"bounded_renormalise: weights must be finite and >= 0, got {w.tolist()}")
    if k * lo > 1 + 1e-9 or k * hi < 1 - 1e-9:
        raise ValueError(f"bounded_renormalise: bounds [{lo}, {hi}] cannot hold {k} weights summing to 1")
    base = w / w.sum() if w.sum() > 0 else np.full(k, 1.0 / k)
    out = base.copy()
    fixed = np.zeros(k, dtype=bool)
    for bound, violates in ((hi, lambda v: v > hi + 1e-12), (lo, lambda v: v < lo - 1e-12)):
        for _ in range(k + 1):
            bad = ~fixed & violates(out)
            if not bad.any():
                break
            out[bad] = bound
            fixed |= bad
            free = ~fixed
            if not free.any():
                break
            remaining = 1.0 - out[fixed].sum()
            free_w = base[free]
            out[free] = free_w * (remaining / free_w.sum()) if free_w.sum() > 0 else remaining / free.sum()
    return out / out.sum()


def adaptive_policy(
    learnability: np.ndarray,
    counts: np.ndarray,
    total: int,
    forgetting: np.ndarray,
    *,
    c: float,
    lam: float,
    tau: float,
    eps: float,
    max_share: float,
    progress: np.ndarray | None = None,
    mu: float = 0.0,
    headroom: np.ndarray | None = None,
    nu: float = 0.0,
    cost: np.ndarray | None = None,
    prior: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The default rule over K available arms; returns (pi, raw scores s).

    s_k = L_k + c*sqrt(ln(N+1)/(n_k+1)) + lam*F_k (+ mu*LP_k and nu*W_k when progress LP and
    headroom W are given), min-max normalised across arms to [0, 1] (so the softmax part gives the best arm at most exp(1/tau) times
    the worst arm's odds, ~7x at the default tau=0.5); pi = (1-eps)*softmax(s/tau) + eps/K, then
    `bounded_renormalise` to [eps/K, max(max_share, 1/K)]. With `cost` (each arm's tokens per rollout
    relative to the others), the softmax part is divided by it and renormalised before the mixing,
    so it splits tokens rather than groups: an arm twice as long gets half the groups at equal score.
    With `prior` (each arm's domain weight) the softmax part is multiplied by it and renormalised, so
    before any evidence it splits as the prior does; the eps/K floor stays uniform.
    """
    k = len(learnability)
    bonus = c * np.sqrt(np.log(total + 1.0) / (np.asarray(counts, dtype=np.float64) + 1.0))
    s = np.asarray(learnability, dtype=np.float64) + bonus + lam * np.asarray(forgetting, dtype=np.float64)
    if progress is not None and mu > 0:
        s = s + mu * np.asarray(progress, dtype=np.float64)
    if headroom is not None and nu > 0:
        s = s + nu * np.asarray(headroom, dtype=np.float64)
    q = softmax(minmax(s) / tau)
    if cost is not None:
        q = q / np.asarray(cost, dtype=np.float64)
        q = q / q.sum()
    if prior is not None:
        q = q * np.asarray(prior, dtype=np.float64)
        q = q / q.sum()
    pi = (1.0 - eps) * q + eps / k
    return bounded_renormalise(pi, eps / k, max(max_share, 1.0 / k)), s


def raised_replay_fraction(base: float, gain: float, forgetting: Sequence[float]) -> float:
    """min(1, base + gain x max(forgetting)): the replay fraction raised by the worst-falling retention
    suite (`forgetting`: each suite's drop beyond its noise; none: base)."""
    worst = max(forgetting, default=0.0)
    return min(1.0, base + gain * max(0.0, worst))
