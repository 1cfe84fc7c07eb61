"""`posttrain report RUN_DIR`: an HTML page with PNG plots drawn from the run's metrics.jsonl.

Plots: reward per domain, held-out accuracy (the curriculum's probes over steps, and the final
`posttrain eval` against the baseline when eval.json exists), KL, entropy, response length, time per
phase, sandbox outcomes and domain shares. A plot whose metrics a run did not log is left out, not drawn empty.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from posttrain.telemetry.logger import read_metrics
from posttrain.telemetry.rundir import RunDir

PHASES = ["generate_s", "update_s", "weight_sync_s", "probe_s", "checkpoint_s", "idle_s"]


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def _keys(rows: list[dict[str, Any]], prefix: str) -> list[str]:
    return sorted({k for r in rows for k in r if k.startswith(prefix) and ":" not in k[len(prefix) :]})


def _line_plot(rows: list[dict[str, Any]], keys: list[str], title: str, ylabel: str, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = False
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for key in keys:
        xs, ys = _series(rows, key)
        if xs:
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key.split("/", 1)[-1])
            drawn = True
    if drawn:
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=90)
    plt.close(fig)
    return drawn


def _timeline_plot(rows: list[dict[str, Any]], path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    if not any(f"timeline/{p}" in r for r in rows for p in PHASES):
        return False
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        vals = [float(r.get(f"timeline/{phase}", 0.0)) for r in rows]
        if any(vals):
            ax.bar(steps, vals, bottom=bottom, label=phase.removesuffix("_s"))
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_title("time per phase")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def _eval_plot(result: dict[str, Any], path: Path) -> bool:
    """Held-out accuracy per domain from `posttrain eval RUN --json` (eval.json): the trained model and,
    when there is one, the baseline, with their 95% bootstrap intervals as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [(str(result.get("model", "model")), result.get("per_domain") or {})]
    if result.get("baseline_per_domain"):
        models.append((str(result.get("baseline", "baseline")), result["baseline_per_domain"]))
    domains = list(models[0][1])
    if not domains:
        return False
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(models)
    for j, (name, per) in enumerate(models):
        acc = [float(per[d]["accuracy"]) if d in per else float("nan") for d in domains]
        lo = [max(0.0, a - float(per[d]["ci_low"])) if d in per else 0.0 for a, d in zip(acc, domains, strict=True)]
        hi = [max(0.0, float(per[d]["ci_high"]) - a) if d in per else 0.0 for a, d in zip(acc, domains, strict=True)]
        xs = [i + (j - (len(models) - 1) / 2) * width for i in range(len(domains))]
        ax.bar(xs, acc, width, yerr=[lo, hi], capsize=3, label=name[-40:])
    title = "held-out accuracy (posttrain eval)"
    if "delta" in result:
        title += f": delta {result['delta']:+.3f} [{result['ci_low']:+.3f}, {result['ci_high']:+.3f}]"
    ax.set_title(title, fontsize=10)
    ax.set_xticks(range(len(domains)), domains)
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def write_report(run_dir: str | Path) -> Path:
    """Write `report/index.html` and its PNGs; returns the HTML path."""
    run = RunDir.open(run_dir)
    rows = read_metrics(run.metrics) if run.metrics.exists() else []
    out = run.report
    out.mkdir(exist_ok=True)
    sections: list[tuple[str, str]] = []

    def add(name: str, title: str, drawn: bool) -> None:
        if drawn:
            sections.append((title, name))

    reward_keys = [k for k in _keys(rows, "reward/") if k != "reward/mean"] + ["reward/mean"]
    add("reward.png", "Reward per domain", _line_plot(rows, reward_keys, "training reward", "mean reward", out / "reward.png"))
    add("heldout.png", "Held-out accuracy", _line_plot(rows, _keys(rows, "heldout/"), "held-out accuracy (probes)", "accuracy", out / "heldout.png"))
    add("kl.png", "KL to the reference", _line_plot(rows, ["train/kl"], "KL", "nats/token", out / "kl.png"))
    add("entropy.png", "Entropy", _line_plot(rows, ["train/entropy"], "policy entropy", "nats/token", out / "entropy.png"))
    add("length.png", "Response length", _line_plot(rows, _keys(rows, "response_tokens/"), "response length", "tokens", out / "length.png"))
    add("timeline.png", "Timeline per phase", _timeline_plot(rows, out / "timeline.png"))
    add("sandbox.png", "Sandbox outcomes", _line_plot(rows, _keys(rows, "sandbox/"), "sandbox outcomes per step", "count", out / "sandbox.png"))
    try:
        from posttrain.curriculum import plot_domain_shares

        if any(k.startswith("curriculum/weight/") for r in rows for k in r):
            plot_domain_shares(rows, out / "domain_shares.png")
            sections.append(("Domain shares (curriculum)", "domain_shares.png"))
    except ImportError:
        pass

    eval_path = run.path / "eval.json"
    eval_html = ""
    if eval_path.exists():
        result = json.loads(eval_path.read_text())
        if _eval_plot(result, out / "eval.png"):
            eval_html = '<h2>Held-out evaluation</h2><img src="eval.png" alt="held-out evaluation">'
        eval_html += "<h2>Evaluation</h2><pre>" + html.escape(json.dumps(result, indent=1)) + "</pre>"
    last = rows[-1] if rows else {}
    summary = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{v:.4g}</td></tr>"
        for k, v in sorted(last.items())
        if isinstance(v, int | float) and not isinstance(v, bool) and k != "time"
    )
    body = "\n".join(f'<h2>{html.escape(t)}</h2><img src="{n}" alt="{html.escape(t)}">' for t, n in sections)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>posttrain report: {html.escape(run.path.name)}</title>
<style>body{{font-family:sans-serif;max-width:960px;margin:auto}} img{{max-width:100%}}
table{{border-collapse:collapse}} td{{border:1px solid #ccc;padding:2px 6px;font-size:12px}}</style></head>
<body><h1>posttrain run <code>{html.escape(run.path.name)}</code></h1>
<p>{len(rows)} steps logged.</p>
{body}
{eval_html}
<h2>Last step</h2><table>{summary}</table>
</body></html>
"""
    index = out / "index.html"
    index.write_text(page)
    return index
