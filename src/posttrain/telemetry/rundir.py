"""The run directory layout: `runs/<name>/{config.yaml, metrics.jsonl, tb/, checkpoints/, report/}`."""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=@-]{0,127}")


def check_run_name(name: str) -> str:
    """`name` if it can name a run directory: one path component (no '/', '\\', '..'), no leading dot,
    1-128 characters of letters, digits and _ . + = @ -; else ValueError saying what is allowed. A name
    like '..' would make `--overwrite` delete the directory above the run root."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise ValueError(
            f"run name {name!r} is not allowed: use one path component of 1-128 letters, digits and _ . + = @ - "
            "that does not start with '.' or contain '..' (e.g. --name grpo-math-1)"
        )
    return name


@dataclass
class RunDir:
    path: Path

    @classmethod
    def create(cls, root: str | Path, name: str | None = None, overwrite: bool = False) -> RunDir:
        name = check_run_name(name or time.strftime("run-%Y%m%d-%H%M%S"))
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

    @property
    def renders(self) -> Path:
        return self.path / "renders"
