"""The report's curriculum figure: a stacked area of domain shares over training steps.

Owns turning logged metric rows (the flat keys of `Sampler.signals()`) into a PNG. It does not read
run directories or decide where the report puts the file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

WEIGHT_PREFIX = "curriculum/weight/"


def domain_shares(metrics_rows: Sequence[dict]) -> tuple[list[float], dict[str, list[float]]]:
    """Steps and per-domain shares (sum of that domain's arm weights) from rows that log weights."""
    steps: list[float] = []
    shares: dict[str, list[float]] = {}
    rows = [r for r in metrics_rows if any(str(k).startswith(WEIGHT_PREFIX) for k in r)]
    domains = sorted(
        {
            str(k)[len(WEIGHT_PREFIX) :].rpartition(":")[0]
            for r in rows
            for k in r
            if str(k).startswith(WEIGHT_PREFIX)
        }
    )
    for n, row in enumerate(rows):
        steps.append(float(row.get("step", n)))
        per = dict.fromkeys(domains, 0.0)
        for k, v in row.items():
            if str(k).startswith(WEIGHT_PREFIX):
                per[str(k)[len(WEIGHT_PREFIX) :].rpartition(":")[0]] += float(v)
        for d in domains:
            shares.setdefault(d, []).append(per[d])
    return steps, shares


def plot_domain_shares(metrics_rows: Sequence[dict], path: str | Path) -> Path:
    """Write a PNG stacked area of domain shares over steps; ValueError if no row logs weights."""
    steps, shares = domain_shares(metrics_rows)
    if not steps:
        raise ValueError(f"no metric row has '{WEIGHT_PREFIX}<domain>:<difficulty>' keys; nothing to plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=110)
    names = list(shares)
    ax.stackplot(steps, [shares[d] for d in names], labels=names, alpha=0.85)
    ax.set_xlabel("step")
    ax.set_ylabel("sampling share")
    ax.set_ylim(0, 1)
    ax.set_xlim(min(steps), max(steps) if max(steps) > min(steps) else min(steps) + 1)
    ax.set_title("curriculum: domain shares over training")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
