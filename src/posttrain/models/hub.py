"""Hub ids: `org/name` or `org/name@revision` (a branch, a tag or a commit) resolved to a snapshot folder
in huggingface_hub's own cache, downloaded there when the Hub is reachable and `HF_HUB_OFFLINE` is unset.

The environment is read at each call, as huggingface_hub reads it at its import: `HF_HUB_CACHE` (else
`HF_HOME/hub`, else `~/.cache/huggingface/hub`), `HF_HUB_OFFLINE`, `HF_ENDPOINT`. Errors name the repository
and say what to do: the pre-download command, the gated repository's terms, a missing repo or revision.
Does not load weights (`loading.py` does, from the folder this returns).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from posttrain.models.text import ModelNotFoundError

# org/name as the Hub spells them, then an optional @revision (branch and tag names may hold slashes)
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w.][\w./-]*))?")
_TRUE = {"1", "ON", "YES", "TRUE"}
# files no transformers load of ours reads: other frameworks' weights, exports, the GGUF and original checkpoints
IGNORE_PATTERNS = [
    "*.onnx",
    "onnx/*",
    "*.msgpack",
    "*.h5",
    "*.ot",
    "*.tflite",
    "*.gguf",
    "*.mlmodel",
    "coreml/*",
    "openvino/*",
    "original/*",
]


@dataclass(frozen=True)
class HubId:
    repo: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo if self.revision is None else f"{self.repo}@{self.revision}"

    @property
    def pull_command(self) -> str:
        """The command that pre-downloads this model into the cache."""
        rev = f" --revision {self.revision}" if self.revision is not None else ""
        return f"posttrain models pull {self.repo}{rev}"


class HubError(ModelNotFoundError):
    """A Hub id that cannot be had: not cached and the Hub unreachable, gated, missing, or a bad revision."""


def parse_hub_id(spec: str) -> HubId | None:
    """`org/name[@revision]` -> HubId; None for anything else (a local path is the caller's to try first)."""
    m = _HUB_ID.fullmatch(spec.strip())
    if m is None or ".." in m["repo"] or (m["revision"] is not None and ".." in m["revision"]):
        return None
    return HubId(m["repo"], m["revision"])


def hub_cache_dir() -> Path:
    """huggingface_hub's cache folder as the environment says now (its `constants` froze it at import)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = os.environ.get("HF_HOME")
    if not home:
        home = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def hub_offline() -> bool:
    """`HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) set to a true value: the cache only, no request."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


def snapshot(hub_id: HubId) -> Path:
    """The snapshot folder of `hub_id` in the cache: downloaded (missing files only) when the Hub is
    reachable, else the cached one. Raises HubError naming the repo and what to do."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = hub_offline()
    cache = hub_cache_dir()
    try:
        folder = snapshot_download(
            hub_id.repo,
            revision=hub_id.revision,
            cache_dir=cache,
            local_files_only=offline,
            ignore_patterns=IGNORE_PATTERNS,
            endpoint=os.environ.get("HF_ENDPOINT") or None,
        )
    except GatedRepoError:
        raise HubError(
            f"'{hub_id.repo}' is a gated repository on the Hub: accept its terms on its page, log in "
            f"(`hf auth login` or HF_TOKEN), then run `{hub_id.pull_command}`"
        ) from None
    except RevisionNotFoundError:
        raise HubError(
            f"'{hub_id.repo}' has no revision '{hub_id.revision}' on the Hub (give a branch, a tag or a commit)"
        ) from None
    except RepositoryNotFoundError:
        raise HubError(
            f"no repository '{hub_id.repo}' on the Hub (check the name; a private one needs "
            "`hf auth login` or HF_TOKEN)"
        ) from None
    except LocalEntryNotFoundError as err:  # also IncompleteSnapshotError: a download cut short
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub could not be reached"
        incomplete = " (its cached snapshot is incomplete)" if "incomplete" in str(err) else ""
        raise HubError(
            f"model '{hub_id}' is not in the Hugging Face cache {cache}{incomplete} and {why}: run "
            f"`{hub_id.pull_command}` on a machine that reaches the Hub, with the same HF_HOME or HF_HUB_CACHE "
            "(or copy that cache here), or give a local folder"
        ) from None
    return Path(folder)


def pull(hub_id: HubId) -> Path:
    """Download `hub_id` into the cache (what `posttrain models pull` runs); refuses under HF_HUB_OFFLINE."""
    if hub_offline():
        raise HubError(f"cannot pull '{hub_id}': HF_HUB_OFFLINE is set (unset it where the Hub is reachable)")
    return snapshot(hub_id)


def cached_models() -> list[tuple[str, str, Path]]:
    """(repo, ref or commit, snapshot folder) of every model in the cache, as huggingface_hub scans it: one
    row per ref (`main`, a tag), a commit that no ref names by its hash."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(hub_cache_dir())
    except CacheNotFound:
        return []
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: r.commit_hash):
            for name in sorted(rev.refs) or [rev.commit_hash]:
                out.append((repo.repo_id, name, Path(rev.snapshot_path)))
    return out
