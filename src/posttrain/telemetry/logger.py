"""Metric sinks: one JSON object per line (the source of truth), TensorBoard scalars, and optionally
Weights & Biases (`WandbSink`: online, or offline into the run directory for a later `wandb sync`)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        k: v
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


class WandbSink:
    """Scalars to a Weights & Biases run. `mode` is "online", "offline" (files under `directory`/wandb,
    uploaded later with `wandb sync`) or "disabled". `wandb` is an optional dependency."""

    def __init__(
        self,
        project: str,
        name: str,
        directory: str | Path,
        mode: str = "offline",
        config: dict[str, Any] | None = None,
        resume_id: str | None = None,
    ) -> None:
        if mode not in ("online", "offline", "disabled"):
            raise ValueError(f"wandb mode must be online, offline or disabled, got {mode!r}")
        try:
            import wandb
        except ImportError:
            raise RuntimeError(
                "telemetry.wandb needs the wandb package: pip install 'posttrain[wandb]'"
            ) from None
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project,
            name=name,
            dir=str(directory),
            mode=mode,
            config=config or {},
            id=resume_id,
            resume="allow" if resume_id else None,
            reinit="create_new",
        )
        self.id = self.run.id

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(_scalars(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class MetricsLogger:
    """Append-only metrics: `log(step, {"reward/math": 0.4, ...})` writes JSONL, TensorBoard and, when
    given a `WandbSink`, W&B."""

    def __init__(
        self, jsonl_path: str | Path | None, tb_dir: str | Path | None = None, wandb: WandbSink | None = None
    ) -> None:
        self.jsonl_path = Path(jsonl_path) if jsonl_path else None
        self._fh = open(self.jsonl_path, "a") if self.jsonl_path else None
        self._tb = None
        self._wandb = wandb
        if tb_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(tb_dir))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        if self._fh is not None:
            self._fh.write(json.dumps(record, default=_jsonable) + "\n")
            self._fh.flush()
        if self._tb is not None:
            for key, value in _scalars(metrics).items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(step, metrics)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None

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
