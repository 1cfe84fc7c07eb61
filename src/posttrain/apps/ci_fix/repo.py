"""The repository on disk: reading a git work tree into memory (tracked and untracked-but-not-ignored
files as they are in the work tree; text files for the tools, the rest as bytes for the check), which
paths git ignores, and committing a patch on a new branch without touching the work tree, the index or
the checked-out branch. Never pushes.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

MAX_REPO_FILES = 5000
MAX_REPO_BYTES = 32 << 20


class RepoError(ValueError):
    """The --repo path is not a usable git work tree; the message says why."""


@dataclass
class Repo:
    root: Path
    files: dict[str, str]  # text files (UTF-8)
    binary: dict[str, bytes] = field(default_factory=dict)
    head: str = ""  # the commit checked out ("" in a repository without commits)


def _git(root: Path, *args: str, input_: bytes | None = None, env: dict[str, str] | None = None) -> bytes:
    proc = subprocess.run(
        ["git", "-C", str(root), *args],
        input=input_,
        capture_output=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )
    if proc.returncode != 0:
        raise RepoError(
            f"git {' '.join(args[:2])} failed in {root}: {proc.stderr.decode(errors='replace').strip()}"
        )
    return proc.stdout


def load_repo(path: str | Path) -> Repo:
    """Read the work tree at `path` (RepoError when it is not one, or is too large)."""
    root = Path(path)
    if not root.is_dir():
        raise RepoError(f"--repo {path}: no such folder")
    try:
        top = _git(root, "rev-parse", "--show-toplevel").decode().strip()
    except RepoError:
        raise RepoError(
            f"--repo {path}: not a git work tree (run `git init` there, or pass the repository's folder)"
        ) from None
    root = Path(top)
    names = [n for n in _git(root, "ls-files", "-z", "-co", "--exclude-standard").decode().split("\0") if n]
    if len(names) > MAX_REPO_FILES:
        raise RepoError(f"--repo {path}: {len(names)} files, more than the {MAX_REPO_FILES} the agent takes")
    files: dict[str, str] = {}
    binary: dict[str, bytes] = {}
    total = 0
    for name in sorted(set(names)):
        p = root / name
        if p.is_symlink() or not p.is_file():
            continue  # deleted in the work tree, a submodule, or a link that could point outside
        data = p.read_bytes()
        total += len(data)
        if total > MAX_REPO_BYTES:
            raise RepoError(f"--repo {path}: more than {MAX_REPO_BYTES >> 20} MiB of files")
        try:
            files[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            binary[name] = data
    try:
        head = _git(root, "rev-parse", "--verify", "-q", "HEAD").decode().strip()
    except RepoError:
        head = ""
    return Repo(root, files, binary, head)


def ignored(repo: Repo, paths: list[str]) -> set[str]:
    """The subset of `paths` that the repository's ignore rules exclude."""
    if not paths:
        return set()
    proc = subprocess.run(
        ["git", "-C", str(repo.root), "check-ignore", "--no-index", "--stdin", "-z"],
        input="\0".join(paths).encode(),
        capture_output=True,
        timeout=60,
    )
    return {p for p in proc.stdout.decode().split("\0") if p}


def commit_patch(repo: Repo, patch: str, branch: str, message: str) -> str:
    """Commit `patch` on top of HEAD as the new branch `branch` (RepoError when it exists or the patch
    does not apply to HEAD); returns the commit id. The work tree, the index and HEAD stay as they are."""
    if not repo.head:
        raise RepoError("--commit needs a repository with at least one commit")
    try:
        _git(repo.root, "check-ref-format", "--branch", branch)
    except RepoError:
        raise RepoError(f"--branch {branch!r} is not a valid branch name") from None
    if (
        subprocess.run(
            ["git", "-C", str(repo.root), "rev-parse", "--verify", "-q", f"refs/heads/{branch}"],
            capture_output=True,
        ).returncode
        == 0
    ):
        raise RepoError(f"branch {branch!r} already exists; pass another --branch")
    with tempfile.TemporaryDirectory(prefix="posttrain-ci-fix-") as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        _git(repo.root, "read-tree", repo.head, env=env)
        patch_file = Path(tmp) / "fix.patch"
        patch_file.write_text(patch)
        _git(repo.root, "apply", "--cached", str(patch_file), env=env)
        tree = _git(repo.root, "write-tree", env=env).decode().strip()
        ident = {
            "GIT_AUTHOR_NAME": os.environ.get("GIT_AUTHOR_NAME", "posttrain ci-fix"),
            "GIT_AUTHOR_EMAIL": os.environ.get("GIT_AUTHOR_EMAIL", "ci-fix@posttrain.invalid"),
        }
        ident["GIT_COMMITTER_NAME"] = os.environ.get("GIT_COMMITTER_NAME", ident["GIT_AUTHOR_NAME"])
        ident["GIT_COMMITTER_EMAIL"] = os.environ.get("GIT_COMMITTER_EMAIL", ident["GIT_AUTHOR_EMAIL"])
        commit = (
            _git(repo.root, "commit-tree", tree, "-p", repo.head, "-m", message, env={**env, **ident})
            .decode()
            .strip()
        )
    _git(repo.root, "branch", branch, commit)
    return commit
