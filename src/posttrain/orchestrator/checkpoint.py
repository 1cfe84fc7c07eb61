"""Atomic run checkpoints: write into a temp dir, fsync, rename to a fresh name, then move the `latest` pointer.

Each checkpoint holds a manifest of sha256 digests; a corrupt or partial checkpoint is detected on
load and the previous good one is used. What goes inside is the caller's (learner state, run state);
`keep_metrics_until` trims a resumed run's metrics back to its checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from posttrain.telemetry import read_metrics

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


def fsync_dir(path: Path) -> None:
    """fsync a directory itself: its entries (a rename into it, a new file) reach the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(top: Path) -> None:
    """fsync every file under `top`, then every directory bottom-up (so each entry is durable)."""
    for dirpath, _, filenames in os.walk(top, topdown=False):
        for name in filenames:
            with open(Path(dirpath) / name, "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(Path(dirpath))


_NAME = re.compile(r"step-(\d+)(?:\.r(\d+))?")


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def _parse(name: str) -> tuple[int, int] | None:
    """(step, revision) of a checkpoint directory name: step-000010 is revision 0, step-000010.r001 is 1."""
    m = _NAME.fullmatch(name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def checkpoint_step(path: Path) -> int:
    """The step of a checkpoint directory (step-000010 or a revision of it)."""
    parsed = _parse(path.name)
    if parsed is None:
        raise ValueError(f"{path.name!r} is not a checkpoint directory name (step-NNNNNN[.rNNN])")
    return parsed[0]


def save_checkpoint(root: Path, step: int, write: Callable[[Path], None], keep: int = 2) -> Path:
    """Call `write(tmpdir)` to fill a checkpoint, then publish it as `root/step-N` (atomically).

    The temp dir is fsynced (files and directories) and renamed to a name nothing holds yet: `step-N`,
    or `step-N.rK` when a checkpoint of step N exists already (a resumed run saving that step again);
    then the `latest` pointer is swapped by rename, and only after that are older revisions of step N
    and checkpoints beyond `keep` removed. A reader never finds no valid checkpoint of step N."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        write(tmp)
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {"step": step, "files": {str(p.relative_to(tmp)): _sha256(p) for p in files}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        _fsync_tree(tmp)
        revisions = [
            parsed[1] for p in root.iterdir() if (parsed := _parse(p.name)) is not None and parsed[0] == step
        ]
        name = step_name(step) if not revisions else f"{step_name(step)}.r{max(revisions) + 1:03d}"
        final = root / name
        os.rename(tmp, final)  # a fresh name: nothing is replaced, so nothing is ever missing
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    pointer_tmp = root / f".{LATEST}.tmp"
    with open(pointer_tmp, "w") as fh:
        fh.write(final.name)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(pointer_tmp, root / LATEST)
    fsync_dir(root)
    for old in list_checkpoints(root):
        if old != final and _parse(old.name)[0] == step:  # type: ignore[index]
            shutil.rmtree(old, ignore_errors=True)  # superseded revisions of this step
    for old in list_checkpoints(root)[:-keep]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories, oldest first (by step, then revision)."""
    if not root.is_dir():
        return []
    found = [(parsed, p) for p in root.iterdir() if p.is_dir() and (parsed := _parse(p.name)) is not None]
    return [p for _, p in sorted(found)]


def verify(path: Path) -> bool:
    """True when the manifest exists and every file's digest matches."""
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        return all(
            (path / rel).is_file() and _sha256(path / rel) == digest
            for rel, digest in manifest["files"].items()
        )
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
    raise CheckpointError(
        f"no usable checkpoint under {root}" + ("; " + "; ".join(warnings) if warnings else "")
    )


def keep_metrics_until(metrics: Path, step: int) -> None:
    """Drop the rows of `metrics` (a JSONL file, if it exists) logged after `step`: they belong to the
    interrupted tail of a run resumed at `step`, which logs them again."""
    if metrics.exists():
        kept = [r for r in read_metrics(metrics) if r.get("step", 0) <= step]
        metrics.write_text("".join(json.dumps(r) + "\n" for r in kept))
