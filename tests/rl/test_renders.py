"""The images environments feed back reach the trajectory, the run directory and the report."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from posttrain.config import load_config, save_config
from posttrain.orchestrator.rl import RLRun
from posttrain.telemetry import RunDir
from posttrain.telemetry.renders import read_renders
from posttrain.telemetry.report import write_report

from .test_loop import TINY, FixedTextEngine

# valid JSON scene that leaves the room: scored, answered with feedback and a render, never solved
WRONG = json.dumps({"objects": [{"id": "x", "type": "chair", "position": [100, 1, 0]}]})


def test_scene_renders_are_saved_and_reported(tmp_path):
    cfg = load_config(
        None,
        [
            *TINY,
            "envs.domains=[{name: scene.layout, difficulties: [0], options: {turns: 2}}]",
            "envs.max_episode_tokens=2048",
            f"telemetry.run_dir={tmp_path}",
            "orchestrator.steps=2",
            "orchestrator.checkpoint_every=0",
            "curriculum.probe_every=0",
            "telemetry.renders_every=1",
            "telemetry.renders_per_step=1",
        ],
    )
    run_dir = RunDir.create(cfg.telemetry.run_dir, "renders")
    save_config(cfg, run_dir.config)
    rl = RLRun(cfg, run_dir)
    rl.build()
    rl.engine = FixedTextEngine(rl.engine, rl.tokenizer, WRONG)
    seen = []
    real = rl.collect_step

    def spy(step, spent=None):
        out = real(step, spent)
        seen.extend(out.trajectories)
        return out

    rl.collect_step = spy
    rl.train()
    # every episode: two turns, one render fed back after the first (the prompt has no image)
    assert seen and all(t.turns == 2 and len(t.images) == 1 for t in seen)
    assert all("x (chair) at (100.00, 1.00, 0.00)" in t.images[0].description for t in seen)
    saved = read_renders(run_dir.renders)
    assert [e["step"] for e in saved] == sorted({e["step"] for e in saved}) and len(saved) == 2
    for ep in saved:
        assert ep["domain"] == "scene.layout" and ep["success"] == 0.0 and len(ep["images"]) == 1
        png = Path(run_dir.renders) / ep["images"][0]["file"]
        assert Image.open(png).size == (256, 256)
    page = write_report(run_dir.path).read_text()
    assert '<section id="renders">' in page and f'src="../renders/{saved[-1]["images"][0]["file"]}"' in page
