"""The report draws the retention suites (paired change with its interval) and the drift probe beside
the training entropy, from the metrics a run with curriculum.retention and drift_every logs."""

from __future__ import annotations

import html
import json
import re

from posttrain.config import load_config, save_config
from posttrain.telemetry import MetricsLogger, RunDir
from posttrain.telemetry.report import retention_suites, write_report


def _series(page: str, png: str) -> list[str] | None:
    m = re.search(r'<figure data-series="([^"]*)"><img src="' + re.escape(png) + '"', page)
    return json.loads(html.unescape(m.group(1))) if m else None


def test_retention_and_drift_plots(tmp_path):
    run = RunDir.create(tmp_path, "r")
    save_config(load_config(None, ["model.spec=tiny:llama", "orchestrator.steps=4"]), run.config)
    with MetricsLogger(run.metrics) as log:
        for step in range(1, 5):
            row = {"reward/mean": 0.1 * step, "train/entropy": 1.0 - step / 10}
            if step % 2 == 0:  # retention_every=2
                for suite, d in (("math:3", -0.1 * step), ("rg.word:0", 0.0)):
                    row |= {
                        f"retention/{suite}": 0.5 + d,
                        f"retention_delta/{suite}": d,
                        f"retention_delta/{suite}_lo": d - 0.1,
                        f"retention_delta/{suite}_hi": d + 0.1,
                        f"retention_delta/{suite}_se": 0.05,
                    }
            row |= {"drift/kl_k3": 0.01 * step, "drift/kl_k1": 0.012 * step, "drift/entropy": 1.5}
            row["drift/ref_entropy"] = 1.6
            log.log(step, row)
    rows = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    assert retention_suites(rows) == ["math:3", "rg.word:0"]  # not their _lo/_hi/_se
    page = write_report(run.path).read_text()
    assert _series(page, "retention.png") == ["math:3", "rg.word:0"]
    assert _series(page, "drift.png") == ["k3", "k1"]
    assert _series(page, "entropy.png") == [
        "training batch",
        "general prompts",
        "general prompts, initial policy",
    ]
    for png in ("retention.png", "drift.png", "entropy.png"):
        assert (run.report / png).stat().st_size > 2000, png


def test_no_retention_plot_without_suites(tmp_path):
    run = RunDir.create(tmp_path, "r")
    save_config(load_config(None, ["model.spec=tiny:llama"]), run.config)
    with MetricsLogger(run.metrics) as log:
        log.log(1, {"reward/mean": 0.1, "train/entropy": 1.0})
    page = write_report(run.path).read_text()
    assert _series(page, "retention.png") is None and _series(page, "drift.png") is None
    assert not (run.report / "retention.png").exists()
    assert _series(page, "entropy.png") == ["training batch"]
