"""Metric sinks: one JSON object per line (the source of truth) and TensorBoard scalars."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class MetricsLogger:
    """Append-only metrics: `log(step, {"reward/math": 0.4, ...})` writes JSONL and TensorBoard."""

    def __init__(self, jsonl_path: str | Path | None, tb_dir: str | Path | None = None) -> None:
        self.jsonl_path = Path(jsonl_path) if jsonl_path else None
        self._fh = open(self.jsonl_path, "a") if self.jsonl_path else None
        self._tb = None
        if tb_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(tb_dir))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        if self._fh is not None:
            self._fh.write(json.dumps(record, default=_jsonable) + "\n")
            self._fh.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read a metrics JSONL file, skipping a torn last line (a run killed mid-write)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
