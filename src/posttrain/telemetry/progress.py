"""A progress display for long work: a rich bar (step, throughput, ETA and a few live figures) on a
terminal, or one plain line per step on stdout for logs (nohup, SLURM, `| tee`), where a live bar shows
nothing until the end."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress


class Progress:
    """`with Progress(total, "train") as p: p.advance(figures={"reward": 0.5})`; silent when disabled.

    With `lines` (None: when stdout is not a terminal) and enabled, each `advance` prints one line to
    stdout instead (its `line`, or the description, the count and the figures) and no bar is drawn."""

    def __init__(
        self,
        total: int,
        description: str,
        enabled: bool = True,
        console: Console | None = None,
        lines: bool | None = False,
    ) -> None:
        self.enabled = enabled
        self.lines = enabled and (not sys.stdout.isatty() if lines is None else lines)
        self.total, self.description, self.done = total, description, 0
        self._progress = RichProgress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[figures]}"),
            console=console or Console(stderr=True),
            disable=not enabled or self.lines,
            transient=False,
        )
        self._task = self._progress.add_task(description, total=total, figures="")

    def __enter__(self) -> Progress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def advance(self, n: int = 1, figures: dict[str, Any] | None = None, line: str | None = None) -> None:
        text = "  ".join(f"{k}={_fmt(v)}" for k, v in (figures or {}).items())
        self._progress.update(self._task, advance=n, figures=text)
        self.done += n
        if self.lines:
            print(line or f"{self.description} {self.done}/{self.total}  {text}", flush=True)

    def set_completed(self, n: int) -> None:
        self._progress.update(self._task, completed=n)
        self.done = n


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)
