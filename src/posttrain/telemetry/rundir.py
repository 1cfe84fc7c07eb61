"""The run directory layout: `runs/<name>/{config.yaml, metrics.jsonl, tb/, checkpoints/, report/}`."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class RunDir:
    path: Path

    @classmethod
    def create(cls, root: str | Path, name: str | None = None, overwrite: bool = False) -> RunDir:
        name = name or time.strftime("run-%Y%m%d-%H%M%S")
        path = Path(root) / name
        if path.exists():
            if not overwrite:
                raise FileExistsError(
                    f"run directory {path} already exists: pass --resume {path} to continue it, "
                    "--overwrite to replace it, or choose another --name"
                )
            shutil.rmtree(path)
        path.mkdir(parents=True)
        run = cls(path)
        for sub in (run.checkpoints, run.tb, run.report):
            sub.mkdir(exist_ok=True)
        return run

    @classmethod
    def open(cls, path: str | Path) -> RunDir:
        p = Path(path)
        if not (p / "config.yaml").is_file():
            raise FileNotFoundError(f"{p} is not a run directory (no config.yaml in it)")
        return cls(p)

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def tb(self) -> Path:
        return self.path / "tb"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def report(self) -> Path:
        return self.path / "report"
