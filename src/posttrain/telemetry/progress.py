"""A rich progress display for long work: step, throughput, ETA and a few live figures."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress


class Progress:
    """`with Progress(total, "train") as p: p.advance(figures={"reward": 0.5})`; silent when disabled."""

    def __init__(
        self, total: int, description: str, enabled: bool = True, console: Console | None = None
    ) -> None:
        self.enabled = enabled
        self._progress = RichProgress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[figures]}"),
            console=console or Console(stderr=True),
            disable=not enabled,
            transient=False,
        )
        self._task = self._progress.add_task(description, total=total, figures="")

    def __enter__(self) -> Progress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def advance(self, n: int = 1, figures: dict[str, Any] | None = None) -> None:
        text = "  ".join(f"{k}={_fmt(v)}" for k, v in (figures or {}).items())
        self._progress.update(self._task, advance=n, figures=text)

    def set_completed(self, n: int) -> None:
        self._progress.update(self._task, completed=n)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)
