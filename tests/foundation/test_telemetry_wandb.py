"""Weights & Biases as a metric sink beside JSONL and TensorBoard, checked by reading back the offline run
file that `wandb sync` would upload."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from posttrain.telemetry import MetricsLogger, WandbSink, read_metrics

wandb = pytest.importorskip("wandb")


def offline_history(directory: Path) -> list[dict[str, float]]:
    """The history rows of the one offline run under `directory` (the .wandb file is a LevelDB-style log
    of 32 KiB blocks of framed protobuf records after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = directory.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, records, partial = path.read_bytes(), 7, [], b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (kind == 0 and length == 0):
            pos += left
            continue
        frag, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
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
    assert offline_history(tmp_path) == [{"reward/mean": 0.25, "train/loss": 1.5}, {"reward/mean": 0.5}]
    assert [r["reward/mean"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0.25, 0.5]


def test_bad_wandb_mode_is_named():
    with pytest.raises(ValueError, match="wandb mode must be online, offline or disabled, got 'local'"):
        WandbSink("p", "n", ".", mode="local")
