"""Weights & Biases as a metric sink beside JSONL and TensorBoard, checked by reading back the offline run
file that `wandb sync` would upload."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from posttrain.telemetry import MetricsLogger, WandbSink, read_metrics

wandb = pytest.importorskip("wandb")


def offline_history(directory: Path, expect: int = 1, timeout_s: float = 20.0) -> list[dict[str, float]]:
    """The history rows of the offline runs under `directory`, oldest first (a .wandb file is a LevelDB-style
    log of 32 KiB blocks of framed protobuf records after a 7-byte header). wandb's service may still be
    writing the file when `finish()` returns, so it is read again until `expect` rows are there or
    `timeout_s` has passed."""
    end = time.monotonic() + timeout_s
    while True:
        rows = []
        for path in sorted(directory.glob("wandb/offline-run-*/run-*.wandb")):
            rows += _history(path.read_bytes())
        if len(rows) >= expect or time.monotonic() > end:
            return rows
        time.sleep(0.25)


def _history(data: bytes) -> list[dict[str, float]]:
    from wandb.proto import wandb_internal_pb2 as pb

    pos, records, partial = 7, [], b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):
            pos += left
            continue
        frag, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            records.append(frag)
        elif kind in (2, 3):
            partial += frag
        elif kind == 4:
            records.append(partial + frag)
            partial = b""
    rows = []
    for blob in records:
        rec = pb.Record()
        rec.ParseFromString(blob)
        if rec.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            rows.append({k: v for k, v in items.items() if not k.startswith("_")})
    return rows


def test_offline_wandb_gets_the_same_scalars_as_jsonl(tmp_path):
    sink = WandbSink("posttrain-test", "run-a", tmp_path, mode="offline", config={"seed": 3})
    with MetricsLogger(tmp_path / "metrics.jsonl", None, wandb=sink) as log:
        log.log(1, {"reward/mean": 0.25, "train/loss": 1.5, "note": "text is not a scalar", "flag": True})
        log.log(2, {"reward/mean": 0.5, "train/loss": float("nan")})
    assert offline_history(tmp_path, expect=2) == [
        {"reward/mean": 0.25, "train/loss": 1.5},
        {"reward/mean": 0.5},
    ]
    assert [r["reward/mean"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0.25, 0.5]


def test_bad_wandb_mode_is_named():
    with pytest.raises(ValueError, match="wandb mode must be online, offline or disabled, got 'local'"):
        WandbSink("p", "n", ".", mode="local")


def test_a_training_run_logs_to_wandb_and_its_resume_continues_the_same_wandb_run(tmp_path):
    from posttrain.config import load_config, save_config
    from posttrain.orchestrator.rl import RLRun
    from posttrain.telemetry import RunDir

    settings = [
        "model.spec=tiny:llama",
        "engine.num_kv_blocks=256",
        "engine.max_new_tokens=8",
        "batch.samples_per_prompt=2",
        "batch.prompts_per_step=2",
        "orchestrator.checkpoint_every=1",
        "curriculum.probe_every=0",
        "envs.domains=[{name: math, difficulties: [0]}]",
        "telemetry.progress=false",
        "telemetry.tensorboard=false",
        "telemetry.wandb=offline",
        f"telemetry.run_dir={tmp_path}",
    ]
    cfg = load_config(None, [*settings, "orchestrator.steps=2"])
    run_dir = RunDir.create(tmp_path, "wb")
    save_config(cfg, run_dir.config)
    first = RLRun(cfg, run_dir, show_progress=False)
    first.train()
    first.close()
    run_id = (run_dir.path / "wandb_id").read_text().strip()
    resumed = RLRun(
        load_config(None, [*settings, "orchestrator.steps=3"]), RunDir.open(run_dir.path), show_progress=False
    )
    resumed.load()
    resumed.train()
    resumed.close()
    assert (run_dir.path / "wandb_id").read_text().strip() == run_id
    assert {p.name.split("-")[-1] for p in run_dir.path.glob("wandb/offline-run-*")} == {run_id}
    history = offline_history(run_dir.path, expect=3)
    rows = read_metrics(run_dir.metrics)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [h["train/loss"] for h in history] == [r["train/loss"] for r in rows]
