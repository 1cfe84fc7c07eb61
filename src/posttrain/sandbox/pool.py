"""`LocalSandbox`: warm pools of jailed workers, one pool per (profile, network), one worker per slot.

Owns worker lifecycle (spawn, ready handshake, recycle after K jobs or any anomaly, kill), the job
queue, the backstop timeout and the conversion of worker replies into `ExecResult`. Each slot is a
thread that owns one worker, so `run` is safe from any number of asyncio tasks, from any event loop
and from plain threads (`run_blocking`). It does not build jails (`isolation`) or grade (`grading`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import os
import queue
import select
import shutil
import signal
import struct
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.sandbox import isolation as iso_mod
from posttrain.sandbox.api import POSITIVE_LIMITS, ExecResult, ExecStatus, Job, validate_job

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 60.0
BACKSTOP_GRACE_S = 5.0
COMPILE_ALLOWANCE_S = 30.0
_STOP = object()
FRAME = struct.Struct("!II")  # same framing as jailed/worker.py: header length, blob length
_INSTANCES = itertools.count()
_UID_COUNTER = itertools.count()  # process-wide: two sandboxes must never share a jail uid


class WorkerError(RuntimeError):
    """The worker died, hung or broke the protocol: an infrastructure failure."""


@dataclass
class PoolSettings:
    pool_size: int
    recycle_after: int
    allow_unisolated: bool
    allow_network: bool
    job_disk_bytes: int
    memory_backstop_bytes: int
    max_pids: int


class _WorkerProc:
    """One live worker process (jailed or not) and its framed pipes."""

    def __init__(
        self, argv: list[str], cgroup: iso_mod.CgroupSlot | iso_mod.CgroupV2Slot | None, job_root: str | None
    ) -> None:
        if cgroup is not None:  # join the group(s) first, then become the jail: nothing runs outside them
            files = cgroup.procs_files
            script = " && ".join(
                [
                    *(f'echo $$ >"${i}"' for i in range(len(files))),
                    *([f"shift {len(files) - 1}"] if len(files) > 1 else []),
                    'exec "$@"',
                ]
            )
            argv = ["/bin/sh", "-c", script, *files, *argv]
        self.job_root = job_root
        self.cgroup = cgroup
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            close_fds=True,
            start_new_session=True,
            env=_minimal_env(),
        )
        assert self.proc.stdin and self.proc.stdout and self.proc.stderr
        self.wfd = self.proc.stdin.fileno()
        self.rfd = self.proc.stdout.fileno()
        self.poller = select.poll()
        self.poller.register(self.rfd, select.POLLIN)
        os.set_blocking(self.proc.stderr.fileno(), False)
        self.jobs_done = 0
        self.info: dict = {}
        try:
            header, _ = self._read_frame(time.monotonic() + READY_TIMEOUT_S)
        except WorkerError as err:
            self.kill()
            raise WorkerError(f"worker did not start: {err}") from None
        if not header.get("ready"):
            self.kill()
            raise WorkerError(f"worker sent {header!r} instead of ready")
        self.info = header

    def stderr_tail(self) -> str:
        try:
            data = self.proc.stderr.read() or b""  # type: ignore[union-attr]
        except (OSError, ValueError):
            data = b""
        return data[-2000:].decode("utf-8", errors="replace").strip()

    def _read_exact(self, n: int, deadline: float) -> bytes:
        chunks, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError("no reply before the backstop timeout")
            # poll, not select: a trainer process may well hold more than 1024 file descriptors
            if not self.poller.poll(left * 1000):
                continue
            chunk = os.read(self.rfd, min(n - got, 1 << 20))
            if not chunk:
                raise WorkerError(f"worker exited (code {self.proc.poll()}): {self.stderr_tail()}")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _read_frame(self, deadline: float) -> tuple[dict, list[bytes]]:
        hlen, blen = FRAME.unpack(self._read_exact(FRAME.size, deadline))
        header = json.loads(self._read_exact(hlen, deadline))
        data = self._read_exact(blen, deadline) if blen else b""
        blobs, pos = [], 0
        for size in header.get("blobs", []):
            blobs.append(data[pos : pos + size])
            pos += size
        return header, blobs

    def execute(self, job: Job) -> tuple[dict, list[bytes]]:
        files = list(job.files.items())
        header = {
            "language": job.language,
            "argv": list(job.argv),
            "files": [name for name, _ in files],
            "limits": {k: getattr(job.limits, k) for k in POSITIVE_LIMITS},
            "max_files_bytes": job.limits.max_returned_files_bytes,
        }
        blobs = [job.code.encode("utf-8", errors="surrogateescape"), job.stdin, *(data for _, data in files)]
        header["blobs"] = [len(b) for b in blobs]
        hbytes = json.dumps(header).encode()
        payload = FRAME.pack(len(hbytes), sum(len(b) for b in blobs)) + hbytes + b"".join(blobs)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(self.wfd, view) :]
        except OSError as err:
            raise WorkerError(f"worker pipe broken: {err}; {self.stderr_tail()}") from None
        backstop = job.limits.wall_time_s + BACKSTOP_GRACE_S
        if job.language in ("c", "cpp"):
            backstop += COMPILE_ALLOWANCE_S
        reply = self._read_frame(time.monotonic() + backstop)
        self.jobs_done += 1
        return reply

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """Kill the worker's session (the jail's PID namespace dies with its init) and reap it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.error("sandbox worker %d did not die after SIGKILL", self.proc.pid)
        if self.cgroup is not None and not self.cgroup.kill_all():
            log.error("sandbox cgroup still has processes after SIGKILL: %s", self.cgroup.dirs[-1])
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                stream.close()  # type: ignore[union-attr]
            except (OSError, ValueError):
                pass
        if self.job_root:
            shutil.rmtree(self.job_root, ignore_errors=True)


class _Pool:
    """The workers of one (profile, network) pair and the queue they pull jobs from."""

    def __init__(self, owner: LocalSandbox, profile: iso_mod.Profile, network: bool, size: int) -> None:
        self.owner = owner
        self.profile = profile
        self.network = network
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.binds = iso_mod.package_dirs(profile.packages)
        self.startup_error: str | None = None
        self.threads = [
            threading.Thread(target=self._slot, args=(i,), daemon=True, name=f"sandbox-{profile.name}-{i}")
            for i in range(size)
        ]
        for t in self.threads:
            t.start()

    def _spawn(self, slot: int) -> _WorkerProc:
        owner, iso = self.owner, self.owner.isolation
        cfg = {"preload": list(self.profile.preload), "network": self.network, "seccomp": iso.seccomp}
        cgroup = None
        if iso.cgroups:
            name = f"i{owner.instance}-{self.profile.name}-{'net' if self.network else 'nonet'}-{slot}"
            cgroup = iso_mod.make_cgroup_slot(
                iso.cgroups, name, owner.settings.memory_backstop_bytes, owner.settings.max_pids
            )
        if iso.namespaces:
            uid = iso_mod.JAIL_UID_BASE + owner.slot_uid_index() if iso.uid_drop else None
            spec = iso_mod.JailSpec(
                iso_mod.python_install(), uid, self.binds, self.network, owner.settings.job_disk_bytes
            )
            worker = _WorkerProc(spec.worker_argv(iso.bwrap or "bwrap", cfg), cgroup, None)
        else:
            job_root = iso_mod.make_job_root()
            worker = _WorkerProc(iso_mod.unisolated_worker_argv(job_root, self.binds, cfg), cgroup, job_root)
        if worker.info.get("preload_failed"):
            worker.kill()
            raise iso_mod.SandboxUnavailable(
                f"profile '{self.profile.name}' cannot import {worker.info['preload_failed']} inside the jail"
            )
        owner.note_worker(worker.info)
        return worker

    def _slot(self, slot: int) -> None:
        worker: _WorkerProc | None = None
        try:
            worker = self._spawn(slot)
        except Exception as err:  # reported per job below, and the slot retries on the next job
            self.startup_error = str(err)
            log.error("sandbox worker failed to start: %s", err)
        while True:
            item = self.queue.get()
            if item is _STOP:
                break
            job, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                if worker is None or not worker.alive():
                    if worker is not None:
                        worker.kill()
                    worker = None
                    worker = self._spawn(slot)
                ooms_before = worker.cgroup.oom_kills() if worker.cgroup is not None else 0
                header, blobs = worker.execute(job)
                result = _to_result(header, blobs)
                recycle = bool(header.get("recycle")) or worker.jobs_done >= self.owner.settings.recycle_after
                if worker.cgroup is not None and worker.cgroup.oom_kills() > ooms_before:
                    if result.signal == signal.SIGKILL:  # the kernel's OOM killer, not a limit of ours
                        result.status = ExecStatus.MEMORY_EXCEEDED
                    recycle = True
                if result.status == ExecStatus.SANDBOX_ERROR:
                    self.owner.count("sandbox_errors")
            except Exception as err:
                self.owner.count("sandbox_errors")
                result = ExecResult(status=ExecStatus.SANDBOX_ERROR, error=f"{type(err).__name__}: {err}")
                recycle = False
                if worker is not None:
                    worker.kill()
                    worker = None
            self.owner.count("jobs")
            recycle = recycle and worker is not None
            if recycle:
                self.owner.count("recycles")
            fut.set_result(result)
            if recycle:  # after answering: the replacement starts off the job's clock
                assert worker is not None
                worker.kill()
                worker = None
                try:
                    worker = self._spawn(slot)
                except Exception as err:  # the next job retries and reports it
                    log.error("sandbox worker failed to restart: %s", err)
        if worker is not None:
            worker.kill()
            if worker.cgroup is not None:
                worker.cgroup.remove()

    def stop(self) -> None:
        for _ in self.threads:
            self.queue.put(_STOP)
        for t in self.threads:
            t.join(timeout=30)


class LocalSandbox:
    """Warm jailed worker pools on this machine; implements `Sandbox`.

    `LocalSandbox(cfg)` detects the isolation layers and refuses to start without namespaces unless
    `cfg.allow_unisolated`. Pools start lazily per profile (call `warm(...)` to start them early).
    """

    def __init__(self, config: Any = None, **overrides: Any) -> None:
        if config is None:
            from posttrain.config import SandboxConfig

            config = SandboxConfig()
        cfg = config
        if overrides:  # validated like the config file would be (unknown keys and bad values raise)
            cfg = type(cfg).model_validate({**cfg.model_dump(), **overrides})
        self.config = cfg
        self.isolation = iso_mod.detect()
        if not self.isolation.isolated and not cfg.allow_unisolated:
            raise iso_mod.SandboxUnavailable(
                "refusing to run untrusted code without isolation: "
                + "; ".join(self.isolation.missing)
                + ". Install bubblewrap, or set sandbox.allow_unisolated=true to accept the risk."
            )
        if not self.isolation.isolated:
            log.warning(
                "SANDBOX RUNNING WITHOUT ISOLATION (allow_unisolated=true): %s",
                "; ".join(self.isolation.missing),
            )
        if self.isolation.cgroups:
            iso_mod.sweep_stale_cgroups(self.isolation.cgroups)
        self.settings = PoolSettings(
            pool_size=cfg.pool_size or (os.cpu_count() or 1),
            recycle_after=cfg.recycle_after,
            allow_unisolated=cfg.allow_unisolated,
            allow_network=cfg.allow_network,
            job_disk_bytes=cfg.job_disk_mb << 20,
            memory_backstop_bytes=(cfg.memory_backstop_mb << 20),
            max_pids=cfg.max_pids,
        )
        self._pools: dict[tuple[str, bool], _Pool] = {}
        self._lock = threading.Lock()
        self.instance = next(_INSTANCES)
        self._closed = False
        self.stats: dict[str, int] = {"jobs": 0, "sandbox_errors": 0, "recycles": 0}
        self.worker_info: dict = {}

    # ---- bookkeeping used by pools -----------------------------------------------------------
    def slot_uid_index(self) -> int:
        with self._lock:
            # distinct per process and per live worker, so RLIMIT_NPROC counts one jail only
            return (os.getpid() % 900) * 64 + next(_UID_COUNTER) % 64

    def count(self, key: str) -> None:
        with self._lock:
            self.stats[key] = self.stats.get(key, 0) + 1

    def note_worker(self, info: dict) -> None:
        with self._lock:
            self.worker_info = info
            if info.get("seccomp") != "on" and self.isolation.seccomp:
                self.isolation.seccomp = False
                self.isolation.details["seccomp"] = str(info.get("seccomp"))
                log.warning("sandbox seccomp layer is OFF: %s", info.get("seccomp"))

    @property
    def layers(self) -> list[str]:
        return self.isolation.layers

    # ---- the Sandbox interface ---------------------------------------------------------------
    def _pool(self, profile: str, network: bool) -> _Pool:
        key = (profile, network)
        with self._lock:
            if self._closed:
                raise RuntimeError("this LocalSandbox is closed")
            pool = self._pools.get(key)
            if pool is None:
                pool = _Pool(self, iso_mod.PROFILES[profile], network, self.settings.pool_size)
                self._pools[key] = pool
            return pool

    def warm(self, *profiles: str) -> None:
        """Start the pools of these profiles now (default: "default") instead of on first use."""
        for name in profiles or ("default",):
            if name not in iso_mod.PROFILES:
                raise ValueError(f"unknown sandbox profile '{name}'; known: {', '.join(iso_mod.PROFILES)}")
            self._pool(name, False)

    def check(self, job: Job) -> None:
        """Raise ValueError naming what this sandbox would refuse about `job` (without queueing it)."""
        validate_job(job, profiles=iso_mod.PROFILES, gcc=shutil.which("gcc") is not None)
        if job.limits.network and not self.settings.allow_network:
            raise ValueError("job asks for network but sandbox.allow_network is false")

    def submit(self, job: Job) -> concurrent.futures.Future:
        """Queue `job`; the future resolves to its ExecResult. Raises ValueError for a bad job."""
        self.check(job)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._pool(job.profile, job.limits.network).queue.put((job, fut))
        return fut

    async def run(self, job: Job) -> ExecResult:
        return await asyncio.wrap_future(self.submit(job))

    async def run_batch(self, jobs: Sequence[Job]) -> list[ExecResult]:
        futures = [self.submit(job) for job in jobs]
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

    def run_blocking(self, job: Job) -> ExecResult:
        return self.submit(job).result()

    def close_blocking(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pools = list(self._pools.values())
        for pool in pools:
            pool.stop()

    async def close(self) -> None:
        await asyncio.to_thread(self.close_blocking)

    async def __aenter__(self) -> LocalSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __enter__(self) -> LocalSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_blocking()


def _to_result(header: dict, blobs: list[bytes]) -> ExecResult:
    files = {}
    for (name, complete), data in zip(header.get("files", []), blobs[2:], strict=False):
        if complete:
            files[name] = data
    return ExecResult(
        status=ExecStatus(header.get("status", "sandbox_error")),
        exit_code=header.get("exit_code"),
        signal=header.get("signal"),
        stdout=blobs[0] if blobs else b"",
        stderr=blobs[1] if len(blobs) > 1 else b"",
        stdout_truncated=bool(header.get("stdout_truncated")),
        stderr_truncated=bool(header.get("stderr_truncated")),
        wall_ms=float(header.get("wall_ms", 0.0)),
        cpu_ms=float(header.get("cpu_ms", 0.0)),
        max_rss_bytes=int(header.get("max_rss_bytes", 0)),
        compile_ms=float(header.get("compile_ms", 0.0)),
        files=files,
        error=str(header.get("error", "")),
    )


def _minimal_env() -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
