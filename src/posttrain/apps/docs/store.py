"""The object store the pipeline reads documents from: fsspec URLs, `file://` (or a plain path) and
`s3://bucket/prefix` through s3fs (any S3-compatible endpoint with `s3_endpoint`).

Owns URL validation (a bad URL is a `UsageError`), listing with a prefix, reading an object's bytes and
its content hash. Knows nothing of queues or databases.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

SCHEMES = ("file", "s3")


class UsageError(ValueError):
    """Bad input from the user (URL, schema, option): the CLI exits 2 with this message."""


@dataclass(frozen=True)
class StoredObject:
    url: str  # full URL, e.g. file:///data/a.pdf or s3://bucket/reports/a.pdf
    size: int
    version: str = ""  # what changes when the object does: S3's ETag, a file's mtime and inode; "" = unknown


def object_version(info: dict[str, Any]) -> str:
    """The version tag of a listed object (fsspec `find(detail=True)` info)."""
    etag = info.get("ETag") or info.get("etag")
    if etag:
        return f"etag:{str(etag).strip(chr(34))}"
    if info.get("mtime") is not None:
        return f"mtime:{info['mtime']!r}:ino:{info.get('ino', '')}"
    return ""


def content_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ObjectStore:
    """One root URL (a folder or bucket prefix) and its fsspec filesystem."""

    def __init__(self, url: str, s3_endpoint: str | None = None) -> None:
        if not isinstance(url, str) or not url.strip():
            raise UsageError("store URL is empty: give file:///path, a local path or s3://bucket/prefix")
        parsed = urlparse(url)
        scheme = parsed.scheme or "file"
        if len(scheme) == 1:  # a Windows drive letter is not a scheme; treat as a path
            scheme = "file"
        if scheme not in SCHEMES:
            raise UsageError(
                f"store URL '{url}' has scheme '{scheme}://'; supported: file:// (or a plain path) and s3://"
            )
        self.scheme = scheme
        if scheme == "file":
            root = Path(parsed.path if parsed.scheme else url).expanduser()
            if not root.exists():
                raise UsageError(f"store URL '{url}': no such folder '{root}'")
            import fsspec

            self.fs = fsspec.filesystem("file")
            self.root = str(root.resolve())
        else:
            if not parsed.netloc:
                raise UsageError(f"store URL '{url}' names no bucket (e.g. s3://my-bucket/reports)")
            try:
                import s3fs
            except ImportError:
                raise UsageError("s3:// needs s3fs: pip install 'posttrain[docs]'") from None
            kwargs: dict[str, Any] = {}
            if s3_endpoint:
                if urlparse(s3_endpoint).scheme not in ("http", "https"):
                    raise UsageError(f"--s3-endpoint '{s3_endpoint}' is not an http(s):// URL")
                kwargs["client_kwargs"] = {"endpoint_url": s3_endpoint}
            self.fs = s3fs.S3FileSystem(**kwargs)
            self.root = f"{parsed.netloc}{parsed.path}".rstrip("/")
            self.s3_endpoint = s3_endpoint
        self.url = url

    def _url(self, path: str) -> str:
        return f"file://{path}" if self.scheme == "file" else f"s3://{path}"

    def _path(self, url: str) -> str:
        prefix = "file://" if self.scheme == "file" else "s3://"
        return url[len(prefix) :] if url.startswith(prefix) else url

    def list(self, prefix: str = "") -> list[StoredObject]:
        """Every object under root/prefix (recursively), sorted by URL. A missing root lists nothing on S3
        and is a UsageError on disk (checked at construction)."""
        base = f"{self.root}/{prefix}".rstrip("/") if prefix else self.root
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return []
        except Exception as err:  # noqa: BLE001 - connection/credential errors name the store
            raise RuntimeError(f"cannot list {self._url(base)}: {type(err).__name__}: {err}") from None
        out = [
            StoredObject(self._url(p), int(info.get("size") or 0), object_version(info))
            for p, info in found.items()
            if info.get("type") == "file" and not Path(p).name.startswith(".")
        ]
        return sorted(out, key=lambda o: o.url)

    def read(self, url: str) -> bytes:
        with self.fs.open(self._path(url), "rb") as f:
            return f.read()

    def write(self, name: str, data: bytes) -> str:
        """Put `data` at root/name (used by the demo and the tests); returns its URL."""
        path = f"{self.root}/{name}"
        if self.scheme == "file":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        with self.fs.open(path, "wb") as f:
            f.write(data)
        return self._url(path)


def read_url(url: str, s3_endpoint: str | None = None) -> bytes:
    """The bytes of one object by its full URL (what a worker does with a job's URL)."""
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        return ObjectStore(f"s3://{parsed.netloc}", s3_endpoint).read(url)
    if parsed.scheme != "file":
        raise UsageError(f"object URL '{url}': supported schemes are file:// and s3://")
    return Path(parsed.path).read_bytes()
