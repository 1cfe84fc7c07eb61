"""Atomic run checkpoints: write into a temp dir, fsync, rename, then move the `latest` pointer.

Each checkpoint holds a manifest of sha256 digests; a corrupt or partial checkpoint is detected on
load and the previous good one is used. What goes inside is the caller's (learner state, run state).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

MANIFEST = "manifest.json"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """No usable checkpoint (all missing or corrupt)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def save_checkpoint(root: Path, step: int, write: Callable[[Path], None], keep: int = 2) -> Path:
    """Call `write(tmpdir)` to fill a checkpoint, then publish it atomically as `root/step-N`."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        write(tmp)
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {"step": step, "files": {str(p.relative_to(tmp)): _sha256(p) for p in files}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        for p in [*files, tmp / MANIFEST]:
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(tmp)
        final = root / step_name(step)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    pointer_tmp = root / f".{LATEST}.tmp"
    pointer_tmp.write_text(final.name)
    with open(pointer_tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(pointer_tmp, root / LATEST)
    _fsync_dir(root)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))


def verify(path: Path) -> bool:
    """True when the manifest exists and every file's digest matches."""
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        return all((path / rel).is_file() and _sha256(path / rel) == digest for rel, digest in manifest["files"].items())
    except (OSError, ValueError, KeyError):
        return False


def latest_valid(root: Path) -> tuple[Path, list[str]]:
    """The newest checkpoint that verifies, preferring the `latest` pointer; with warnings for skipped ones."""
    warnings: list[str] = []
    candidates = list_checkpoints(root)
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if named in candidates:
            candidates.remove(named)
            candidates.append(named)
    for path in reversed(candidates):
        if verify(path):
            return path, warnings
        warnings.append(f"checkpoint {path} is corrupt or partial; falling back to an earlier one")
    raise CheckpointError(f"no usable checkpoint under {root}" + ("; " + "; ".join(warnings) if warnings else ""))
