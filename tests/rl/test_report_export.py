"""The run report renders in a real browser with its plots; export gives a folder transformers loads
with the same logits as the trained policy."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from posttrain.config import load_config, save_config
from posttrain.telemetry import MetricsLogger, RunDir
from posttrain.telemetry.report import write_report


def _fake_run(tmp_path) -> RunDir:
    run = RunDir.create(tmp_path, "r")
    save_config(load_config(None, ["model.spec=tiny:llama", "orchestrator.steps=12"]), run.config)
    with MetricsLogger(run.metrics) as log:
        for step in range(1, 9):
            log.log(
                step,
                {
                    "reward/mean": step / 10,
                    "reward/math": step / 12,
                    "reward/code.unit_tests": step / 9,
                    "heldout/math": 0.3 + step / 40,
                    "heldout/math:0": 0.3 + step / 40,
                    "heldout/generated_tokens": 400.0 + 60 * step,  # 460 .. 880: tokens, not accuracy
                    "rollout/generated_tokens": 1000.0 + step,
                    "train/kl": 0.01 * step,
                    "train/entropy": 1.0 - step / 20,
                    "response_tokens/math": 30 + step,
                    "timeline/generate_s": 2.0,
                    "timeline/update_s": 1.0,
                    "timeline/weight_sync_s": 0.1,
                    "timeline/step_s": 3.5,
                    "sandbox/timeout": float(step % 2),
                    "curriculum/weight/math:0": 0.5 + step / 40,
                    "curriculum/weight/code.unit_tests:0": 0.5 - step / 40,
                    "counters/rollout_tokens": 1000.0 * step,
                    "counters/probe_tokens": 500.0 * step,
                },
            )
    # 8 steps logged 10 s apart, the first taking 3.5 s: wall time 73.5 s
    rows = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    for i, r in enumerate(rows):
        r["time"] = 1_700_000_000.0 + 10 * i
    run.metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


EVAL = {
    "model": "runs/r/policy",
    "accuracy_definition": "strict success per task: rewards['success'], else reward >= 1; mean over samples",
    "n_per_arm": 64,
    "temperature": 1.0,
    "samples_per_task": 4,
    "pass_at_k": [1, 4],
    "per_domain": {
        "math": {
            "accuracy": 0.4,
            "ci_low": 0.3,
            "ci_high": 0.5,
            "n": 64,
            "infra_failures": 0,
            "mean_reward": 0.61,
            "mean_components": {"correct": 0.4, "format": 0.9},
            "pass_at": {
                "1": {"value": 0.4, "ci_low": 0.3, "ci_high": 0.5, "n": 64},
                "4": {"value": 0.625, "ci_low": 0.5, "ci_high": 0.75, "n": 64},
            },
        },
    },
    "baseline": "smollm2-135m",
    "baseline_per_domain": {
        "math": {
            "accuracy": 0.1,
            "ci_low": 0.05,
            "ci_high": 0.15,
            "n": 64,
            "infra_failures": 0,
            "mean_reward": 0.2,
            "mean_components": {"correct": 0.1, "format": 0.5},
            "pass_at": {
                "1": {"value": 0.1, "ci_low": 0.05, "ci_high": 0.15, "n": 64},
                "4": {"value": 0.3125, "ci_low": 0.2, "ci_high": 0.4, "n": 64},
            },
        },
    },
    "delta_per_domain": {
        "math": {
            "delta": 0.3,
            "ci_low": 0.2,
            "ci_high": 0.4,
            "n_tasks": 64,
            "pass_at": {
                "1": {"delta": 0.3, "ci_low": 0.2, "ci_high": 0.4, "n_tasks": 64},
                "4": {"delta": 0.3125, "ci_low": 0.21, "ci_high": 0.42, "n_tasks": 64},
            },
        }
    },
    "delta": 0.3,
    "ci_low": 0.2,
    "ci_high": 0.4,
    "n_tasks": 64,
    "delta_pass_at": {
        "1": {"delta": 0.3, "ci_low": 0.2, "ci_high": 0.4, "n_tasks": 64},
        "4": {"delta": 0.3125, "ci_low": 0.21, "ci_high": 0.42, "n_tasks": 64},
    },
}


def _figure_series(page: str, png: str) -> list[str]:
    import html as html_mod
    import re

    m = re.search(r'<figure data-series="([^"]*)"><img src="' + re.escape(png) + '"', page)
    assert m, png
    return json.loads(html_mod.unescape(m.group(1)))


def test_report_writes_every_plot_it_has_data_for(tmp_path):
    run = _fake_run(tmp_path)
    index = write_report(run.path)
    assert not (run.report / "eval.png").exists()  # no eval.json yet: no evaluation plot
    page = index.read_text()
    assert "last probe accuracy" in page and "<td>0.500</td><td>8</td>" in page  # 0.3 + 8/40 at step 8
    (run.path / "eval.json").write_text(json.dumps(EVAL))
    index = write_report(run.path)
    page = index.read_text()
    for png in [
        "reward.png",
        "heldout.png",
        "kl.png",
        "entropy.png",
        "length.png",
        "timeline.png",
        "sandbox.png",
        "domain_shares.png",
        "eval.png",
        "pass_at.png",
        "tokens.png",
    ]:
        assert (run.report / png).stat().st_size > 2000, png
        assert f'src="{png}"' in page


def test_report_opens_with_a_summary_and_keeps_tokens_off_accuracy_charts(tmp_path):
    run = _fake_run(tmp_path)
    (run.path / "eval.json").write_text(json.dumps(EVAL))
    page = write_report(run.path).read_text()
    summary = page[page.index('<section id="summary">') : page.index('<section id="charts">')]
    assert "<th>model</th><td>tiny:llama</td>" in summary
    assert "<th>steps</th><td>8 of 12 planned (8 rows in metrics.jsonl)</td>" in summary
    assert "<th>wall time</th><td>1 min 14 s</td>" in summary  # 70 s between rows + the first step's 3.5 s
    assert "math (difficulty 0, 1); code.unit_tests (difficulty 0)" in summary
    assert "8,000 in rollouts, 4,000 in held-out probes" in summary
    # the held-out rows, figures formatted from eval.json: model, baseline, paired delta per figure
    for row in [
        "<td>math</td><td>accuracy (strict)</td><td>64</td><td>0.400 [0.300, 0.500]</td>"
        "<td>0.100 [0.050, 0.150]</td><td>+0.300 [+0.200, +0.400]</td>",
        "<td></td><td>pass@1</td><td></td><td>0.400 [0.300, 0.500]</td><td>0.100 [0.050, 0.150]</td>"
        "<td>+0.300 [+0.200, +0.400]</td>",
        "<td></td><td>pass@4</td><td></td><td>0.625 [0.500, 0.750]</td><td>0.312 [0.200, 0.400]</td>"
        "<td>+0.312 [+0.210, +0.420]</td>",
        "<td><b>all</b></td><td>accuracy (strict)</td><td>64</td><td></td><td></td><td>+0.300 [+0.200, +0.400]</td>",
        "<td></td><td>pass@4</td><td></td><td></td><td></td><td>+0.312 [+0.210, +0.420]</td>",
    ]:
        assert row in summary, row
    assert (
        "<th>model <code>runs/r/policy</code> [95% CI]</th><th>baseline <code>smollm2-135m</code> [95% CI]</th>"
        in summary
    )
    # the shaped reward is reported as such, not as accuracy
    assert "<th>mean shaped reward</th><th>mean correct</th><th>mean format</th>" in summary
    assert "<td>math</td><td>model</td><td>0.610</td><td>0.400</td><td>0.900</td>" in summary
    assert page.index('<section id="summary">') < page.index('src="eval.png"')
    # accuracy charts hold accuracies only; tokens have their own chart
    assert _figure_series(page, "heldout.png") == ["math"]
    assert "generated_tokens" not in json.dumps(
        _figure_series(page, "eval.png") + _figure_series(page, "heldout.png")
    )
    assert _figure_series(page, "tokens.png") == ["training rollouts", "held-out probes"]
    assert _figure_series(page, "domain_shares.png") == ["code.unit_tests", "math"]
    # tables, not raw JSON dumps
    assert (
        "<pre>" not in page
        and '"per_domain"' not in page
        and "{&quot;" not in page.replace('data-series="', "")
    )


def test_domain_shares_come_from_the_metrics_without_the_curriculum_package():
    import subprocess
    import sys

    from posttrain.telemetry.report import domain_shares

    rows = [
        {
            "step": 1,
            "curriculum/weight/math:0": 0.25,
            "curriculum/weight/math:1": 0.25,
            "curriculum/weight/code.unit_tests:0": 0.5,
        },
        {
            "step": 2,
            "curriculum/domain_share/math": 0.7,
            "curriculum/domain_share/code.unit_tests": 0.3,
            "curriculum/weight/math:0": 0.1,
        },
    ]
    assert domain_shares(rows) == ([1, 2], {"code.unit_tests": [0.5, 0.3], "math": [0.5, 0.7]})
    probe = (
        "import sys, posttrain.telemetry.report; "
        "print(sorted(m for m in sys.modules if m.startswith('posttrain.') and not m.startswith('posttrain.telemetry')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.skipif(
    shutil.which("chromium") is None, reason="chromium is installed by `make test` (Debian package)"
)
def test_report_renders_in_headless_chromium(tmp_path):
    from PIL import Image

    run = _fake_run(tmp_path)
    index = write_report(run.path)
    shot = tmp_path / "shot.png"
    proc = subprocess.run(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1000,2400",
            f"--screenshot={shot}",
            index.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shot.is_file(), proc.stderr[-2000:]
    img = Image.open(shot).convert("RGB")
    assert img.size == (1000, 2400)
    # the plots are drawn in colour: a page of only text would be black on white
    colours = {px for px in img.get_flattened_data() if not (px[0] == px[1] == px[2])}
    assert len(colours) > 200


def test_export_loads_in_transformers_with_identical_logits(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.orchestrator.eval.export import export_run
    from posttrain.orchestrator.rl import RLRun

    from .test_loop import DOMAINS, TINY

    cfg = load_config(
        None,
        [
            *TINY,
            *DOMAINS,
            f"telemetry.run_dir={tmp_path}",
            "orchestrator.steps=1",
            "model.lora_rank=4",
            "curriculum.probe_every=0",
        ],
    )
    run = RunDir.create(tmp_path, "lora")
    save_config(cfg, run.config)
    rl = RLRun(cfg, run)
    rl.train()
    # a tiny random policy earns equal rewards in every group (no gradient); give the adapters weights
    # of their own so the export has a LoRA delta to merge, then checkpoint them
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for name, p in rl.learner.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    rl.save()
    out = export_run(run.path, tmp_path / "exported")
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    ids = torch.tensor([tok.encode("The answer is 42")])
    with torch.no_grad():
        exported = model(ids).logits
        rl.learner.model.eval()
        trained = rl.learner.model(input_ids=ids).logits
    assert torch.allclose(exported, trained, atol=1e-5)
    # the LoRA delta was merged: the export differs from the base model
    from posttrain.models import load_policy

    base = load_policy("tiny:llama", seed=cfg.seed)
    with torch.no_grad():
        assert not torch.allclose(base(ids).logits, exported, atol=1e-6)
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    rl.close()
