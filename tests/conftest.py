"""Isolation every test session gets, so that sessions run side by side (pytest-xdist workers, or two
checkouts on one machine) never see each other's files: each pytest process gets its own temporary
folder as TMPDIR (inherited by the subprocesses it starts: sandboxes, redis, postgres, ray), removed
at the end; parallel workers split the cores between them instead of each running one torch thread
per core."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_ORIGINAL_TMPDIR = os.environ.get("TMPDIR")
_SESSION_TMP: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    """Give this process its own TMPDIR, world-traversable (postgres runs as its own user, the sandbox's
    jobs may too) and short (unix sockets of postgres and ray live under it: 107 bytes at most)."""
    global _SESSION_TMP
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    _SESSION_TMP = tempfile.mkdtemp(prefix=f"pt-{worker}-", dir=_ORIGINAL_TMPDIR or "/tmp")
    os.chmod(_SESSION_TMP, 0o1777)
    os.environ["TMPDIR"] = _SESSION_TMP
    tempfile.tempdir = None  # tempfile caches gettempdir(); re-read TMPDIR
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        # torch reads this when first imported (after this hook): N workers share the cores, not N x cores
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SESSION_TMP is None:
        return
    if _ORIGINAL_TMPDIR is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = _ORIGINAL_TMPDIR
    tempfile.tempdir = None
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)
