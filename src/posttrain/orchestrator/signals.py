"""SIGINT/SIGTERM during a run: while `stop_on_signals` is active they only record the signal, which the
loop checks between steps, so the run stops checkpointed rather than dying mid-write. Owns installing
and restoring the handlers (main thread only); what stopping means is the loop's business."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def stop_on_signals(record: Callable[[int], None]) -> Iterator[None]:
    """Route SIGINT/SIGTERM to `record(signum)` inside the block; restore the previous handlers after.
    Off the main thread (where Python cannot install handlers) it does nothing."""
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():

        def handler(signum: int, frame: Any) -> None:
            record(signum)

        for sig in STOP_SIGNALS:
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
