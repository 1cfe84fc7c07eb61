"""Weight sync: how the learner's weights reach an engine, behind one interface.

A `WeightUpdate` is what crosses: a policy version and either full HF-named tensors or, for a LoRA
learner, only the adapters (A, B and the scaling per module: a few MB instead of the model), merged
into the engine's base weights on the receiving side. Transports:

- `InProcess`: the engine lives in this process; the tensors are handed over as they are.
- `SharedFile`: a directory (``/dev/shm`` by default: shared memory) that engines in other processes on
  this host read. A push writes the raw tensor bytes (64-byte aligned) into bucket files of at most
  `bucket_bytes`, hashing each tensor's bytes with XXH3-64 while they are still in cache, fsyncs them,
  writes a manifest (each tensor's dtype, shape and offset; each bucket's size and XXH3-64) into a
  temporary directory, renames it to ``v{version}`` and only then points ``LATEST`` at it (atomic
  rename). The reader maps each bucket (`mmap`), checks its size and hash, and hands zero-copy views
  (`torch.frombuffer`) to the engine, whose `load_weights` copies them into its own tensors: one copy
  on each side. A push interrupted half-way is never referenced; a bucket whose size or hash does not
  match the manifest (a truncated, rewritten or bit-flipped file) is refused by name and nothing of
  that version is applied.
- `Broadcast`: torch.distributed from the learner's rank to engine workers (NCCL on GPUs, gloo on
  CPUs): a header, then one flat buffer per bucket and dtype. A sender that fails mid-push makes the
  collective fail on the receivers, which apply nothing.

Every receiver checks versions: an update older than what it holds raises `StaleUpdate`, one equal to
it is not applied twice. `apply()` is the single place an update enters an engine.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.orchestrator.checkpoint import fsync_dir

# the pure weight helpers live with the Learner (train/weights.py); re-exported for this module's callers
from posttrain.train.weights import (  # noqa: F401
    LORA_A,
    LORA_B,
    WeightUpdate,
    _whole,
    dedupe,
    full_update,
    lora_base,
    lora_update,
)


class StaleUpdate(RuntimeError):
    """An update older than the weights the receiver already holds."""


class PartialUpdate(RuntimeError):
    """An update that did not arrive whole (a missing or corrupt bucket); nothing of it was applied."""


# -- the receiving side --------------------------------------------------------------------------------


class Receiver:
    """What an engine-side process holds: the version it has and, for LoRA updates, the base weights
    of the adapted modules (copied once, from the engine's first full load or the model files)."""

    def __init__(self, engine: Any, base: dict[str, torch.Tensor] | None = None) -> None:
        self.engine = engine
        self.version: int | None = None
        self.base = base  # module.weight -> base tensor; needed only for LoRA updates
        self.last_bytes = 0

    def check(self, version: int) -> bool:
        """True if `version` is new; False if already held; raises StaleUpdate if older."""
        if self.version is not None and version < self.version:
            raise StaleUpdate(f"weight update v{version} is older than the v{self.version} already loaded")
        return self.version is None or version > self.version

    def apply(self, update: WeightUpdate) -> bool:
        """Load `update` into the engine unless it is not new; True if it was loaded."""
        if not self.check(update.version):
            return False
        if update.kind == "full":
            self.engine.load_weights(update.tensors, version=update.version)
        else:
            self.engine.load_weights(self._merged(update), version=update.version)
        self.version = update.version
        self.last_bytes = update.nbytes
        return True

    def _merged(self, update: WeightUpdate) -> dict[str, torch.Tensor]:
        if self.base is None:
            raise ValueError("a LoRA weight update needs the base weights: give the Receiver `base`")
        out: dict[str, torch.Tensor] = {}
        for module, scale in update.scaling.items():
            key = module + ".weight"
            if key not in self.base:
                raise ValueError(f"LoRA update for '{module}', which has no base weight '{key}'")
            a = update.tensors[module + LORA_A].float()
            b = update.tensors[module + LORA_B].float()
            delta = b @ a
            if module in update.transposed:
                delta = delta.T
            w = self.base[key]
            out[key] = (w.float() + scale * delta).to(w.dtype)
        return out


# -- transports ----------------------------------------------------------------------------------------


@dataclass
class PushStats:
    version: int
    nbytes: int
    seconds: float


class InProcess:
    """The engine is in this process: `push` hands the update to the receiver directly."""

    name = "in_process"

    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver

    def push(self, update: WeightUpdate) -> PushStats:
        t0 = time.perf_counter()
        self.receiver.apply(update)
        return PushStats(update.version, update.nbytes, time.perf_counter() - t0)


def _buckets(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most `bucket_bytes` each (a bigger tensor alone)."""
    group: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if group and size + n > bucket_bytes:
            yield group
            group, size = {}, 0
        group[name] = t
        size += n
    if group:
        yield group


FORMAT = "posttrain-raw-1"  # the manifest's "format": raw aligned tensor bytes, XXH3-64 per bucket
_ALIGN = 64
_HASH_CHUNK = 4 << 20  # hashed right after it is written, while it is still in cache


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of `t` on the CPU, C-contiguous (a view when it already is)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def write_bucket(path: Path, group: dict[str, torch.Tensor]) -> dict:
    """Write `group`'s tensors into `path` (rewritten in place if it exists), each at a 64-byte aligned
    offset, hashing them as they are written; fsync it. Returns its manifest entry: file, bytes, xxh3_64 and the tensors' layout."""
    import xxhash

    digest = xxhash.xxh3_64()
    layout = []
    offset = 0
    with open(path, "r+b" if path.exists() else "wb", buffering=0) as f:
        for name, t in group.items():
            pad = -offset % _ALIGN
            if pad:
                f.write(bytes(pad))
                digest.update(bytes(pad))
                offset += pad
            raw = _raw_bytes(t)
            layout.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset])
            for i in range(0, len(raw), _HASH_CHUNK):
                chunk = raw[i : i + _HASH_CHUNK]
                f.write(chunk)
                digest.update(chunk)
            offset += len(raw)
        f.truncate(offset)
        os.fsync(f.fileno())
    return {"file": path.name, "bytes": offset, "xxh3_64": digest.intdigest(), "tensors": layout}


def read_bucket(
    path: Path,
    entry: dict,
    version: int,
    maps: dict[tuple[int, int], Any] | None = None,
    used: set[tuple[int, int]] | None = None,
) -> dict[str, torch.Tensor]:
    """Map the bucket `entry` describes, check its size and XXH3-64 (PartialUpdate naming the file if
    either differs) and return read-only tensor views of it. `maps` ((device, inode) -> mapping) keeps
    the mappings of files the writer rewrites in place, so their page tables are built once; the key
    of the one used goes into `used`."""
    import xxhash

    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise PartialUpdate(f"weight update v{version}: bucket {entry['file']} is missing") from None
    with f:
        st = os.fstat(f.fileno())
        size, key = st.st_size, (st.st_dev, st.st_ino)
        mapped: Any = maps.get(key) if maps is not None else None
        if mapped is None or len(mapped) != size:
            mapped = (
                mmap.mmap(
                    f.fileno(),
                    0,
                    flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                    prot=mmap.PROT_READ,
                )
                if size
                else b""
            )
        if maps is not None:
            maps[key] = mapped
        if used is not None:
            used.add(key)
    digest = xxhash.xxh3_64_intdigest(mapped)
    if size != entry["bytes"] or digest != entry["xxh3_64"]:
        raise PartialUpdate(
            f"weight update v{version}: bucket {entry['file']} has {size} bytes and XXH3-64 {digest}, "
            f"the manifest says {entry['bytes']} and {entry['xxh3_64']}"
        )
    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for name, dtype, shape, offset in entry["tensors"]:
            dt = getattr(torch, dtype)
            count = int(torch.Size(shape).numel())
            if count == 0:
                out[name] = torch.empty(shape, dtype=dt)
                continue
            out[name] = torch.frombuffer(mapped, dtype=dt, count=count, offset=offset).view(shape)
    return out


class SharedFile:
    """Pushes into `directory` (writer) and reads from it (reader): see the module docstring.
    `keep` versions are kept so that a reader still loading the previous one is not cut off. The
    folder of a version pruned that way becomes the spare that the next push rewrites in place
    (`reuse_files`): rewriting pages /dev/shm already holds costs half of allocating fresh ones. Its
    files are renamed away before they are rewritten, so a reader more than `keep` versions behind
    finds them missing, unless it had mapped them already (the Ray placement has no such reader: it
    waits until every engine has loaded a push before it makes the next)."""

    name = "shared_file"

    def __init__(
        self, directory: str | Path, bucket_bytes: int = 256 << 20, keep: int = 2, reuse_files: bool = True
    ) -> None:
        if bucket_bytes < 1 or keep < 1:
            raise ValueError("bucket_bytes and keep must be >= 1")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.bucket_bytes = bucket_bytes
        self.keep = keep
        self.reuse_files = reuse_files
        self.spare = self.dir / ".spare"
        self._maps: dict[tuple[int, int], Any] = {}  # the reader's mappings, by (device, inode)
        self._last_read: dict[tuple[int, int], int] = {}
        self._reads = 0

    # writer ------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Remove every published and partial version (a run's pushes start afresh, a resumed one too)."""
        (self.dir / "LATEST").unlink(missing_ok=True)
        shutil.rmtree(self.spare, ignore_errors=True)
        for path in self.dir.glob("*v*"):
            if path.is_dir() and (path.name.startswith("v") or path.name.startswith(".v")):
                shutil.rmtree(path, ignore_errors=True)

    def push(self, update: WeightUpdate) -> PushStats:
        t0 = time.perf_counter()
        latest = self.latest()
        if latest is not None and update.version <= latest:
            raise StaleUpdate(f"push of v{update.version}: v{latest} is already published in {self.dir}")
        tmp = self.dir / f".v{update.version}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        if self.spare.is_dir():
            self.spare.rename(tmp)
            (tmp / "manifest.json").unlink(missing_ok=True)
        else:
            tmp.mkdir()
        unique, aliases = dedupe(update.tensors)
        buckets = [
            write_bucket(tmp / f"bucket-{i:05d}.bin", group)
            for i, group in enumerate(_buckets(unique, self.bucket_bytes))
        ]
        written = {b["file"] for b in buckets}
        for old in tmp.glob("bucket-*"):
            if old.name not in written:
                old.unlink()
        manifest = {
            "format": FORMAT,
            "version": update.version,
            "kind": update.kind,
            "scaling": update.scaling,
            "transposed": update.transposed,
            "aliases": aliases,
            "buckets": buckets,
            "nbytes": update.nbytes,
        }
        with open(tmp / "manifest.json", "w") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        final = self.dir / f"v{update.version}"
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        pointer = self.dir / ".LATEST.tmp"
        pointer.write_text(str(update.version))
        pointer.rename(self.dir / "LATEST")
        fsync_dir(self.dir)
        self._prune(update.version)
        return PushStats(update.version, update.nbytes, time.perf_counter() - t0)

    def _prune(self, newest: int) -> None:
        versions = sorted(int(p.name[1:]) for p in self.dir.glob("v*") if p.name[1:].isdigit())
        for v in versions:
            if v > newest - self.keep:
                continue
            if self.reuse_files and not self.spare.exists():
                (self.dir / f"v{v}").rename(self.spare)
            else:
                shutil.rmtree(self.dir / f"v{v}", ignore_errors=True)

    # reader ------------------------------------------------------------------------------------------

    def latest(self) -> int | None:
        try:
            return int((self.dir / "LATEST").read_text())
        except FileNotFoundError:
            return None

    def read(self, version: int | None = None) -> WeightUpdate:
        """The published update `version` (default: the latest), every bucket's size and hash checked
        before it is returned. Its tensors are read-only views of the mapped files: copy, never write."""
        version = self.latest() if version is None else version
        if version is None:
            raise FileNotFoundError(f"no weight update published in {self.dir}")
        folder = self.dir / f"v{version}"
        try:
            manifest = json.loads((folder / "manifest.json").read_text())
        except FileNotFoundError:
            raise PartialUpdate(f"weight update v{version} in {self.dir} has no manifest") from None
        if manifest.get("format") != FORMAT:
            raise PartialUpdate(
                f"weight update v{version} in {self.dir} has format {manifest.get('format')!r}, "
                f"this reader reads {FORMAT!r}"
            )
        tensors: dict[str, torch.Tensor] = {}
        used: set[tuple[int, int]] = set()
        for b in manifest["buckets"]:
            tensors.update(read_bucket(folder / b["file"], b, version, self._maps, used))
        self._reads += 1
        for key in used:
            self._last_read[key] = self._reads
        for key, n in list(self._last_read.items()):
            if n <= self._reads - self.keep - 1:  # not one of this reader's recent files
                del self._maps[key], self._last_read[key]
        for alias, name in manifest["aliases"].items():
            tensors[alias] = tensors[name]
        return WeightUpdate(
            version=int(manifest["version"]),
            kind=manifest["kind"],
            tensors=tensors,
            scaling={k: float(v) for k, v in manifest["scaling"].items()},
            transposed=list(manifest["transposed"]),
        )

    def pull(self, receiver: Receiver) -> bool:
        """Apply the latest published update if it is newer than the receiver's; True if applied."""
        latest = self.latest()
        if latest is None or not receiver.check(latest):
            return False
        return receiver.apply(self.read(latest))


class Broadcast:
    """torch.distributed broadcast from rank `src` of `group` (already initialised) to the others.
    Every rank calls `push` (the source with the update, the others with None) in the same order."""

    name = "broadcast"

    def __init__(
        self, src: int = 0, group: Any = None, device: str = "cpu", bucket_bytes: int = 256 << 20
    ) -> None:
        self.src = src
        self.group = group
        self.device = torch.device(device)
        self.bucket_bytes = bucket_bytes

    def push(self, update: WeightUpdate | None, receiver: Receiver | None = None) -> PushStats:
        import torch.distributed as dist

        t0 = time.perf_counter()
        is_src = (
            dist.get_rank(self.group) == self.src if self.group is not None else dist.get_rank() == self.src
        )
        header: list[Any] = [None]
        if is_src:
            if update is None:
                raise ValueError("the source rank must push an update")
            unique, aliases = dedupe(update.tensors)
            header = [
                {
                    "version": update.version,
                    "kind": update.kind,
                    "scaling": update.scaling,
                    "transposed": update.transposed,
                    "aliases": aliases,
                    "layout": [
                        [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in g.items()]
                        for g in _buckets(unique, self.bucket_bytes)
                    ],
                }
            ]
        dist.broadcast_object_list(header, src=self.src, group=self.group)
        meta = header[0]
        if receiver is not None and not is_src:
            receiver.check(meta["version"])  # a stale push is refused before its bytes are read
        tensors: dict[str, torch.Tensor] = {}
        for bucket in meta["layout"]:
            by_dtype: dict[str, list[tuple[str, list[int]]]] = {}
            for name, dtype, shape in bucket:
                by_dtype.setdefault(dtype, []).append((name, shape))
            for dtype, entries in by_dtype.items():
                dt = getattr(torch, dtype)
                sizes = [int(torch.Size(s).numel()) for _, s in entries]
                if is_src:
                    flat = torch.cat(
                        [update.tensors[n].detach().reshape(-1).to(self.device) for n, _ in entries]
                    )
                else:
                    flat = torch.empty(sum(sizes), dtype=dt, device=self.device)
                dist.broadcast(flat, src=self.src, group=self.group)
                if not is_src:
                    for (name, shape), part in zip(entries, flat.split(sizes), strict=True):
                        tensors[name] = part.view(shape)
        nbytes = sum(
            int(torch.Size(s).numel()) * getattr(torch, d).itemsize for b in meta["layout"] for _, d, s in b
        )
        for alias, name in meta.get("aliases", {}).items():
            if name in tensors:
                tensors[alias] = tensors[name]
        if not is_src and receiver is not None:
            receiver.apply(
                WeightUpdate(meta["version"], meta["kind"], tensors, meta["scaling"], meta["transposed"])
            )
        return PushStats(meta["version"], nbytes, time.perf_counter() - t0)
