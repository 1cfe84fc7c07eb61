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
    save_config(load_config(), run.config)
    with MetricsLogger(run.metrics) as log:
        for step in range(1, 9):
            log.log(
                step,
                {
                    "reward/mean": step / 10,
                    "reward/math": step / 12,
                    "reward/code.unit_tests": step / 9,
                    "heldout/math": 0.3 + step / 40,
                    "train/kl": 0.01 * step,
                    "train/entropy": 1.0 - step / 20,
                    "response_tokens/math": 30 + step,
                    "timeline/generate_s": 2.0,
                    "timeline/update_s": 1.0,
                    "timeline/weight_sync_s": 0.1,
                    "sandbox/timeout": float(step % 2),
                    "curriculum/weight/math:0": 0.5 + step / 40,
                    "curriculum/weight/code.unit_tests:0": 0.5 - step / 40,
                },
            )
    return run


def test_report_writes_every_plot_it_has_data_for(tmp_path):
    run = _fake_run(tmp_path)
    index = write_report(run.path)
    assert not (run.report / "eval.png").exists()  # no eval.json yet: no evaluation plot
    per = {"math": {"accuracy": 0.4, "ci_low": 0.3, "ci_high": 0.5, "n": 64}}
    base = {"math": {"accuracy": 0.1, "ci_low": 0.05, "ci_high": 0.15, "n": 64}}
    (run.path / "eval.json").write_text(
        json.dumps({"model": "runs/x/policy", "per_domain": per, "baseline": "base", "baseline_per_domain": base,
                    "delta": 0.3, "ci_low": 0.2, "ci_high": 0.4})
    )
    index = write_report(run.path)
    html = index.read_text()
    for png in ["reward.png", "heldout.png", "kl.png", "entropy.png", "length.png", "timeline.png", "sandbox.png",
                "domain_shares.png", "eval.png"]:
        assert (run.report / png).stat().st_size > 2000, png
        assert f'src="{png}"' in html
    assert "8 steps logged" in html


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is installed by `make test` (Debian package)")
def test_report_renders_in_headless_chromium(tmp_path):
    from PIL import Image

    run = _fake_run(tmp_path)
    index = write_report(run.path)
    shot = tmp_path / "shot.png"
    proc = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
         "--window-size=1000,2400", f"--screenshot={shot}", index.as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    assert shot.is_file(), proc.stderr[-2000:]
    img = Image.open(shot).convert("RGB")
    assert img.size == (1000, 2400)
    # the plots are drawn in colour: a page of only text would be black on white
    colours = {px for px in img.get_flattened_data() if not (px[0] == px[1] == px[2])}
    assert len(colours) > 200


def test_export_loads_in_transformers_with_identical_logits(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.orchestrator import RLRun
    from posttrain.orchestrator.export import export_run

    from .test_loop import DOMAINS, TINY

    cfg = load_config(None, [*TINY, *DOMAINS, f"telemetry.run_dir={tmp_path}", "orchestrator.steps=1",
                             "model.lora_rank=4", "curriculum.probe_every=0"])
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
