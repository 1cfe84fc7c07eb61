"""`posttrain report RUN_DIR`: an HTML page drawn from the run's config.yaml, metrics.jsonl and eval.json.

It opens with a summary (model, domains, steps, wall time, the held-out table with 95% intervals,
pass@k, baseline and paired delta), then the charts (accuracy charts hold only accuracy-like series;
tokens, time and counts get charts of their own), then the last step's metrics as a table. A chart whose
metrics a run did not log is left out, not drawn empty. Reads files only: imports no other posttrain layer.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.telemetry.logger import read_metrics
from posttrain.telemetry.renders import read_renders
from posttrain.telemetry.rundir import RunDir

PHASES = ["generate_s", "update_s", "weight_sync_s", "probe_s", "checkpoint_s", "idle_s"]
SHARE_PREFIX = "curriculum/domain_share/"
WEIGHT_PREFIX = "curriculum/weight/"
RETENTION_PREFIX = "retention_delta/"
TOKEN_SERIES = {
    "rollout/generated_tokens": "training rollouts",
    "heldout/generated_tokens": "held-out probes",
}


@dataclass
class Chart:
    """One PNG of the report: its file, title, and the metric series drawn in it (as labelled)."""

    file: str
    title: str
    series: list[str] = field(default_factory=list)


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v == v  # v == v: not NaN


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if _num(v):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def _keys(rows: list[dict[str, Any]], prefix: str) -> list[str]:
    return sorted({k for r in rows for k in r if k.startswith(prefix) and ":" not in k[len(prefix) :]})


def accuracy_keys(rows: list[dict[str, Any]]) -> list[str]:
    """The per-domain held-out probe accuracies: `heldout/<domain>` series whose every value is a fraction
    (token counts and other non-accuracy figures logged under heldout/ are left out)."""
    out = []
    for key in _keys(rows, "heldout/"):
        if key.endswith("_tokens") or key.endswith("_s"):
            continue
        _, ys = _series(rows, key)
        if ys and all(0.0 <= y <= 1.0 for y in ys):
            out.append(key)
    return out


def domain_shares(rows: list[dict[str, Any]]) -> tuple[list[int], dict[str, list[float]]]:
    """Steps and each domain's sampling share, from `curriculum/domain_share/<d>` where logged, else the
    sum of that domain's arm weights `curriculum/weight/<d>:<difficulty>`."""
    steps: list[int] = []
    shares: dict[str, list[float]] = {}
    logged = [r for r in rows if any(str(k).startswith((SHARE_PREFIX, WEIGHT_PREFIX)) for k in r)]
    per_row: list[dict[str, float]] = []
    for r in logged:
        direct = {
            k[len(SHARE_PREFIX) :]: float(v) for k, v in r.items() if k.startswith(SHARE_PREFIX) and _num(v)
        }
        if not direct:
            for k, v in r.items():
                if k.startswith(WEIGHT_PREFIX) and _num(v):
                    dom = k[len(WEIGHT_PREFIX) :].rpartition(":")[0]
                    direct[dom] = direct.get(dom, 0.0) + float(v)
        per_row.append(direct)
        steps.append(int(r["step"]))
    names = sorted({d for p in per_row for d in p})
    for d in names:
        shares[d] = [p.get(d, 0.0) for p in per_row]
    return steps, shares


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _line_plot(
    rows: list[dict[str, Any]],
    keys: list[str],
    title: str,
    ylabel: str,
    path: Path,
    labels: dict[str, str] | None = None,
    ylim: tuple[float, float] | None = None,
    band: tuple[str, str] | None = None,
) -> list[str]:
    """Draw the keys that have data; returns the labels drawn ([] = no file written). `band`: suffixes
    of each key's interval series (e.g. ("_lo", "_hi")), shaded around its line, with a line at 0."""
    plt = _plt()
    drawn: list[str] = []
    fig, ax = plt.subplots(figsize=(7, 3.4))
    if band:
        ax.axhline(0.0, color="grey", lw=0.8)
    for key in keys:
        xs, ys = _series(rows, key)
        if xs:
            label = (labels or {}).get(key, key.split("/", 1)[-1])
            line = ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)[0]
            drawn.append(label)
            lo_key, hi_key = (key + band[0], key + band[1]) if band else ("", "")
            spans = [(r["step"], r[lo_key], r[hi_key]) for r in rows if band and _num(r.get(lo_key))]
            if spans:
                bx, lo, hi = zip(*spans, strict=True)
                ax.fill_between(bx, lo, hi, color=line.get_color(), alpha=0.2)
    if drawn:
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if ylim:
            ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=90)
    plt.close(fig)
    return drawn


def retention_suites(rows: list[dict[str, Any]]) -> list[str]:
    """The retention suites a run logged (`retention_delta/<domain>:<level>`), sorted."""
    out = set()
    for r in rows:
        for k in r:
            if k.startswith(RETENTION_PREFIX) and not k.endswith(("_lo", "_hi", "_se")):
                out.add(k[len(RETENTION_PREFIX) :])
    return sorted(out)


def _retention_plot(rows: list[dict[str, Any]], path: Path) -> list[str]:
    """Each retention suite's paired change from the initial policy over steps, its 95% interval shaded."""
    suites = retention_suites(rows)
    return _line_plot(
        rows,
        [RETENTION_PREFIX + s for s in suites],
        "retention suites: change from the initial policy (95% interval)",
        "accuracy delta",
        path,
        {RETENTION_PREFIX + s: s for s in suites},
        band=("_lo", "_hi"),
    )


def _timeline_plot(rows: list[dict[str, Any]], path: Path) -> list[str]:
    drawn = [p for p in PHASES if any(_num(r.get(f"timeline/{p}")) and r[f"timeline/{p}"] for r in rows)]
    if not drawn:
        return []
    plt = _plt()
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    bottom = [0.0] * len(rows)
    for phase in drawn:
        vals = [
            float(r.get(f"timeline/{phase}", 0.0)) if _num(r.get(f"timeline/{phase}")) else 0.0 for r in rows
        ]
        ax.bar(steps, vals, bottom=bottom, label=phase.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_title("time per phase")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [p.removesuffix("_s") for p in drawn]


def _shares_plot(rows: list[dict[str, Any]], path: Path) -> list[str]:
    steps, shares = domain_shares(rows)
    if not steps:
        return []
    plt = _plt()
    names = list(shares)
    fig, ax = plt.subplots(figsize=(7, 3.4))
    ax.stackplot(steps, [shares[d] for d in names], labels=names, alpha=0.85)
    ax.set_title("curriculum: domain shares of the sampled tasks")
    ax.set_xlabel("step")
    ax.set_ylabel("sampling share")
    ax.set_ylim(0, 1)
    ax.set_xlim(min(steps), max(steps) if max(steps) > min(steps) else min(steps) + 1)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return names


def _models(result: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    models = [(str(result.get("model", "model")), result.get("per_domain") or {})]
    if result.get("baseline_per_domain"):
        models.append((str(result.get("baseline", "baseline")), result["baseline_per_domain"]))
    return models


def _eval_plot(result: dict[str, Any], path: Path) -> list[str]:
    """Held-out strict accuracy per domain from eval.json: the model and, when there is one, the
    baseline, with their 95% bootstrap intervals as error bars."""
    models = _models(result)
    domains = list(models[0][1])
    if not domains:
        return []
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.4))
    width = 0.8 / len(models)
    for j, (name, per) in enumerate(models):
        acc = [float(per[d]["accuracy"]) if d in per else float("nan") for d in domains]
        lo = [
            max(0.0, a - float(per[d]["ci_low"])) if d in per else 0.0
            for a, d in zip(acc, domains, strict=True)
        ]
        hi = [
            max(0.0, float(per[d]["ci_high"]) - a) if d in per else 0.0
            for a, d in zip(acc, domains, strict=True)
        ]
        xs = [i + (j - (len(models) - 1) / 2) * width for i in range(len(domains))]
        ax.bar(xs, acc, width, yerr=[lo, hi], capsize=3, label=name[-40:])
    ax.set_title("held-out strict accuracy (posttrain eval), 95% intervals", fontsize=10)
    ax.set_xticks(range(len(domains)), domains)
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [name[-40:] for name, _ in models]


def _pass_at_plot(result: dict[str, Any], path: Path) -> list[str]:
    """pass@k against k per domain: the model solid, the baseline dashed."""
    ks = [int(k) for k in result.get("pass_at_k") or []]
    if len(ks) < 2:
        return []
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.4))
    drawn: list[str] = []
    for j, (_, per) in enumerate(_models(result)):
        for dom, entry in per.items():
            got = [(k, entry["pass_at"][str(k)]["value"]) for k in ks if str(k) in entry.get("pass_at", {})]
            if got:
                label = f"{dom} ({'baseline' if j else 'model'})"
                ax.plot([k for k, _ in got], [v for _, v in got], "--" if j else "-", marker="o", label=label)
                drawn.append(label)
    if drawn:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_title("held-out pass@k (unbiased estimator)", fontsize=10)
        ax.set_xlabel("k")
        ax.set_ylabel("pass@k")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=90)
    plt.close(fig)
    return drawn


# ---------------------------------------------------------------------------------------------- HTML


def _e(x: Any) -> str:
    return html.escape(str(x))


def _table(header: list[str], rows: list[list[str]], cls: str = "") -> str:
    """An HTML table; cells are already escaped HTML."""
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def fmt_interval(value: float, lo: float, hi: float, signed: bool = False) -> str:
    s = "+" if signed else ""
    return f"{value:{s}.3f} [{lo:{s}.3f}, {hi:{s}.3f}]"


def fmt_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h} h {m} min" if h else f"{m} min {s} s" if m else f"{s} s"


def wall_time_s(rows: list[dict[str, Any]]) -> float | None:
    """From the end of the first logged step to the end of the last, plus the first step's own wall time."""
    times = [float(r["time"]) for r in rows if _num(r.get("time"))]
    if not times:
        return None
    first = next(r for r in rows if _num(r.get("time")))
    step0 = first.get("timeline/step_s")
    if not _num(step0):
        step0 = sum(
            float(first.get(f"timeline/{p}", 0.0)) for p in PHASES if _num(first.get(f"timeline/{p}"))
        )
    return max(times) - min(times) + float(step0)


def _load_config(path: Path) -> dict[str, Any]:
    import yaml

    try:
        cfg = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _facts(cfg: dict[str, Any], rows: list[dict[str, Any]], result: dict[str, Any] | None) -> str:
    model = (cfg.get("model") or {}).get("spec", "?")
    domains = []
    for d in (cfg.get("envs") or {}).get("domains") or []:
        lv = d.get("difficulties")
        domains.append(
            f"{d.get('name')} (difficulty {', '.join(map(str, lv))})" if lv else str(d.get("name"))
        )
    planned = (cfg.get("orchestrator") or {}).get("steps")
    steps = max((int(r["step"]) for r in rows), default=0)
    facts: list[tuple[str, str]] = [("model", _e(model))]
    algo = cfg.get("algorithm") or {}
    # a run saved before the batch section existed kept the group size as algorithm.group_size
    group = (cfg.get("batch") or {}).get("samples_per_prompt", algo.get("group_size", "?"))
    if algo:
        loss = algo.get("policy_loss", "?")  # {type: ..., its knobs} since policy-loss configs; a name before
        loss = loss.get("type", "?") if isinstance(loss, dict) else loss
        facts.append(
            (
                "algorithm",
                _e(f"{algo.get('advantage', '?')} advantages, {loss} loss, group size {group}"),
            )
        )
    facts.append(("domains", _e("; ".join(domains)) if domains else "?"))
    facts.append(
        (
            "steps",
            _e(f"{steps} of {planned} planned" if planned else str(steps))
            + _e(f" ({len(rows)} rows in metrics.jsonl)"),
        )
    )
    wall = wall_time_s(rows)
    if wall is not None:
        facts.append(("wall time", _e(fmt_duration(wall))))
    last = rows[-1] if rows else {}
    tokens = last.get("counters/rollout_tokens")
    if _num(tokens):
        probe = last.get("counters/probe_tokens", 0.0)
        facts.append(("generated tokens", _e(f"{tokens:,.0f} in rollouts, {probe:,.0f} in held-out probes")))
    if result is not None:
        facts.append(("evaluated policy", f"<code>{_e(result.get('model', '?'))}</code>"))
        if result.get("baseline"):
            facts.append(("baseline", f"<code>{_e(result['baseline'])}</code>"))
    rows_html = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in facts)
    return f'<table class="facts"><tbody>{rows_html}</tbody></table>'


def _eval_summary(result: dict[str, Any]) -> str:
    """The held-out table, one row per domain and figure (strict accuracy, then pass@k), with the model,
    the baseline and their paired delta side by side, each with its 95% interval."""
    per = result.get("per_domain") or {}
    base = result.get("baseline_per_domain") or {}
    dper = result.get("delta_per_domain") or {}
    ks = [str(k) for k in result.get("pass_at_k") or []]
    header = ["domain", "figure", "n tasks", f"model <code>{_e(result.get('model', '?'))}</code> [95% CI]"]
    if base:
        header.append(f"baseline <code>{_e(result.get('baseline', '?'))}</code> [95% CI]")
    if dper:
        header.append("delta (model - baseline) [95% CI]")

    def value(d: dict[str, Any], k: str | None) -> str:
        if k is None:
            return _e(fmt_interval(d["accuracy"], d["ci_low"], d["ci_high"])) if "accuracy" in d else ""
        p = (d.get("pass_at") or {}).get(k)
        return _e(fmt_interval(p["value"], p["ci_low"], p["ci_high"])) if p else ""

    def change(d: dict[str, Any], k: str | None) -> str:
        p = d if k is None else (d.get("pass_at") or {}).get(k)
        return _e(fmt_interval(p["delta"], p["ci_low"], p["ci_high"], True)) if p and "delta" in p else ""

    rows: list[list[str]] = []
    for dom, d in per.items():
        for i, k in enumerate([None, *ks]):
            row = [
                _e(dom) if i == 0 else "",
                "accuracy (strict)" if k is None else f"pass@{k}",
                _e(d.get("n", "")) if i == 0 else "",
                value(d, k),
            ]
            if base:
                row.append(value(base.get(dom, {}), k))
            if dper:
                row.append(change(dper.get(dom, {}), k))
            rows.append(row)
    if "delta" in result:
        for i, k in enumerate([None, *ks]):
            row = [
                "<b>all</b>" if i == 0 else "",
                "accuracy (strict)" if k is None else f"pass@{k}",
                _e(result.get("n_tasks", "")) if i == 0 else "",
                "",
            ]
            if base:
                row.append("")
            row.append(
                change(result, None)
                if k is None
                else change({"pass_at": result.get("delta_pass_at") or {}}, k)
            )
            rows.append(row)
    how = result.get("accuracy_definition", "strict success per task")
    note = (
        f"Accuracy is {_e(how)}. {_e(result.get('n_per_arm', '?'))} held-out tasks per domain and difficulty, "
        f"temperature {_e(result.get('temperature', 0.0))}, {_e(result.get('samples_per_task', 1))} sample(s) "
        "per task; 95% bootstrap intervals over tasks; deltas paired over the same tasks."
    )
    return _table(header, rows, "heldout") + f'<p class="note">{note}</p>'


def _shaped_table(result: dict[str, Any]) -> str:
    """Mean shaped reward and its components per domain: what training optimises, not accuracy."""
    models = _models(result)
    names = sorted({c for _, per in models for d in per.values() for c in d.get("mean_components", {})})
    if not any("mean_reward" in d for _, per in models for d in per.values()):
        return ""
    rows = []
    for j, (_, per) in enumerate(models):
        for dom, d in per.items():
            comps = d.get("mean_components", {})
            rows.append(
                [
                    _e(dom),
                    "baseline" if j else "model",
                    _e(f"{d['mean_reward']:.3f}") if "mean_reward" in d else "",
                ]
                + [_e(f"{comps[c]:.3f}") if c in comps else "" for c in names]
            )
    header = ["domain", "", "mean shaped reward"] + [f"mean {_e(c)}" for c in names]
    return "<h3>Shaped reward and its components (not accuracy)</h3>" + _table(header, rows, "shaped")


def _probe_summary(rows: list[dict[str, Any]]) -> str:
    keys = accuracy_keys(rows)
    if not keys:
        return "<p>No held-out figures: the run logged no probes and has no eval.json.</p>"
    out = []
    for key in keys:
        xs, ys = _series(rows, key)
        out.append([_e(key.split("/", 1)[1]), _e(f"{ys[-1]:.3f}"), _e(xs[-1])])
    return (
        _table(["domain", "last probe accuracy", "at step"], out, "heldout")
        + '<p class="note">Probe scores are small greedy samples without intervals; run '
        "<code>posttrain eval RUN_DIR --baseline MODEL</code> for the held-out table with 95% intervals.</p>"
    )


def _last_step_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    last = rows[-1]
    cells = [
        [_e(k), _e(f"{v:.4g}")]
        for k, v in sorted(last.items())
        if _num(v) and k not in ("time", "step") and not k.startswith("curriculum/")
    ]
    return (
        f"<details><summary>All metrics at step {_e(last.get('step'))} (curriculum signals are in the "
        f"domain-share chart)</summary>{_table(['metric', 'value'], cells, 'metrics')}</details>"
    )


CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:1em auto;padding:0 1em;color:#222}
img{max-width:100%} figure{margin:0 0 1.2em 0} figcaption{font-size:12px;color:#555}
table{border-collapse:collapse;margin:.4em 0} td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:left}
table.facts th{background:#f4f4f4;width:11em}
table.heldout td,table.shaped td{font-variant-numeric:tabular-nums;white-space:nowrap}
thead th{background:#f4f4f4} .note{font-size:12px;color:#555} .charts{display:grid;grid-template-columns:1fr 1fr;gap:8px}"""


def _renders_section(run: RunDir, episodes: int = 4) -> str:
    """The latest saved episodes' images (telemetry.renders_every), each with its description."""
    saved = read_renders(run.renders)[-episodes:]
    if not saved:
        return ""
    items = []
    for ep in saved:
        imgs = "".join(
            f'<img src="../renders/{_e(i["file"])}" alt="{_e(i["description"][:200])}" '
            f'title="{_e(i["description"])}" style="max-width:48%;margin-right:4px">'
            for i in ep["images"]
        )
        caption = f"step {ep['step']}, {ep['task']}: reward {ep['reward']:.3f}, success {ep['success']}, {ep['turns']} turn(s)"
        items.append(f"<figure>{imgs}<figcaption>{_e(caption)}</figcaption></figure>")
    return (
        '<section id="renders"><h2>Renders of sampled episodes</h2>\n' + "\n".join(items) + "\n</section>\n"
    )


def write_report(run_dir: str | Path) -> Path:
    """Write `report/index.html` and its PNGs; returns the HTML path."""
    run = RunDir.open(run_dir)
    rows = read_metrics(run.metrics) if run.metrics.exists() else []
    cfg = _load_config(run.config)
    out = run.report
    out.mkdir(exist_ok=True)
    eval_path = run.path / "eval.json"
    result = json.loads(eval_path.read_text()) if eval_path.exists() else None

    charts: list[Chart] = []

    def add(file: str, title: str, series: list[str]) -> None:
        if series:
            charts.append(Chart(file, title, series))

    if result is not None:
        add("eval.png", "Held-out strict accuracy (posttrain eval)", _eval_plot(result, out / "eval.png"))
        add("pass_at.png", "Held-out pass@k", _pass_at_plot(result, out / "pass_at.png"))
    reward_keys = [k for k in _keys(rows, "reward/") if k != "reward/mean"] + ["reward/mean"]
    add(
        "heldout.png",
        "Held-out accuracy during training (probes)",
        _line_plot(
            rows,
            accuracy_keys(rows),
            "held-out accuracy (probes)",
            "accuracy",
            out / "heldout.png",
            ylim=(0, 1.05),
        ),
    )
    add(
        "reward.png",
        "Training reward per domain (shaped)",
        _line_plot(rows, reward_keys, "training reward (shaped)", "mean reward", out / "reward.png"),
    )
    add("domain_shares.png", "Domain shares (curriculum)", _shares_plot(rows, out / "domain_shares.png"))
    add(
        "tokens.png",
        "Generated tokens per step",
        _line_plot(
            rows, list(TOKEN_SERIES), "generated tokens per step", "tokens", out / "tokens.png", TOKEN_SERIES
        ),
    )
    add(
        "length.png",
        "Response length",
        _line_plot(
            rows, _keys(rows, "response_tokens/"), "mean response length", "tokens", out / "length.png"
        ),
    )
    add(
        "retention.png",
        "Retention suites outside the training mix (change from the initial policy)",
        _retention_plot(rows, out / "retention.png"),
    )
    add("kl.png", "KL to the reference", _line_plot(rows, ["train/kl"], "KL", "nats/token", out / "kl.png"))
    add(
        "drift.png",
        "Drift probe: KL(initial || policy) on general prompts",
        _line_plot(
            rows,
            ["drift/kl_k3", "drift/kl_k1"],
            "drift on general prompts",
            "nats/token",
            out / "drift.png",
            {"drift/kl_k3": "k3", "drift/kl_k1": "k1"},
        ),
    )
    add(
        "entropy.png",
        "Entropy",
        _line_plot(
            rows,
            ["train/entropy", "drift/entropy", "drift/ref_entropy"],
            "policy entropy",
            "nats/token",
            out / "entropy.png",
            {
                "train/entropy": "training batch",
                "drift/entropy": "general prompts",
                "drift/ref_entropy": "general prompts, initial policy",
            },
        ),
    )
    add("timeline.png", "Time per phase", _timeline_plot(rows, out / "timeline.png"))
    add(
        "sandbox.png",
        "Sandbox outcomes",
        _line_plot(rows, _keys(rows, "sandbox/"), "sandbox outcomes per step", "count", out / "sandbox.png"),
    )

    heldout = _eval_summary(result) + _shaped_table(result) if result is not None else _probe_summary(rows)
    figures = "\n".join(
        f'<figure data-series="{_e(json.dumps(c.series))}"><img src="{c.file}" alt="{_e(c.title)}">'
        f"<figcaption>{_e(c.title)}: {_e(', '.join(c.series))}</figcaption></figure>"
        for c in charts
    )
    name = _e(run.path.name)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>posttrain report: {name}</title><style>{CSS}</style></head>
<body><h1>posttrain run <code>{name}</code></h1>
<section id="summary"><h2>Summary</h2>
{_facts(cfg, rows, result)}
<h2>Held-out evaluation</h2>
{heldout}
</section>
<section id="charts"><h2>Charts</h2><div class="charts">
{figures}
</div></section>
<section id="last-step"><h2>Last step</h2>
{_last_step_table(rows)}
</section>
{_renders_section(run)}</body></html>
"""
    index = out / "index.html"
    index.write_text(page)
    return index
