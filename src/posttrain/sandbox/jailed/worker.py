"""The long-lived jailed worker: pre-imports a profile, then forks one supervised child per job.

Runs inside the jail (stdlib only). Speaks a length-prefixed protocol on the fds it got as stdin/
stdout; each child gets rlimits, the seccomp filter, its own process group, a clean environment, a
fresh job dir and an empty /dev/shm, and no fd but its stdin/stdout/stderr. It does not choose
isolation layers (the pool's bwrap command line does).
"""

from __future__ import annotations

import ctypes
import gc
import io
import json
import os
import resource
import select
import shutil
import signal
import stat
import struct
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import seccomp  # noqa: E402  (sibling module inside the jail)

FRAME = struct.Struct("!II")  # header length, total blob length
PR_SET_CHILD_SUBREAPER = 36
PR_SET_DUMPABLE = 4
PR_SET_PDEATHSIG = 1
MEMORY_ERROR_LINE = b"MemoryError\n"  # what the harness writes last on stderr for a Python MemoryError
CHILD_FDS_LIMIT = 256
MAX_INODES_TO_WIPE = 5000
COMPILE = {
    "c": (["/usr/bin/gcc", "-O2", "-std=gnu17", "-o", "main", "main.c", "-lm"], "main.c"),
    "cpp": (["/usr/bin/g++", "-O2", "-std=gnu++17", "-o", "main", "main.cpp"], "main.cpp"),
}


def read_exact(fd: int, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(fd: int) -> tuple[dict, list[bytes]] | None:
    head = read_exact(fd, FRAME.size)
    if head is None:
        return None
    hlen, blen = FRAME.unpack(head)
    header = json.loads(read_exact(fd, hlen) or b"{}")
    data = read_exact(fd, blen) if blen else b""
    blobs, pos = [], 0
    for size in header.get("blobs", []):
        blobs.append(data[pos : pos + size])
        pos += size
    return header, blobs


def write_frame(fd: int, header: dict, blobs: list[bytes]) -> None:
    header = dict(header, blobs=[len(b) for b in blobs])
    hbytes = json.dumps(header).encode()
    payload = FRAME.pack(len(hbytes), sum(len(b) for b in blobs)) + hbytes + b"".join(blobs)
    view = memoryview(payload)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class Worker:
    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.job_root = cfg["job_root"]
        self.jobdir = self.job_root  # the job owns the whole private tmpfs; it is emptied after each job
        self.shm_dir = cfg.get("shm_dir")  # the jail's private /dev/shm tmpfs, emptied after each job too
        self.in_pidns = bool(cfg.get("pidns"))
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.seccomp: seccomp.Installer | None = None
        self.seccomp_status = "off"
        self.base_vm_bytes = 0
        self.recycle_hint = False
        self.job_env: dict[str, str] = {}

    # ---- setup -------------------------------------------------------------------------------
    def setup(self) -> dict:
        self.libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        self.libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        for path in self.cfg.get("sys_path", []):
            sys.path.insert(0, path)
        # The worker's own environment becomes the jobs' (set once here, inherited by every fork). It is
        # set before the preload: some packages read HOME or thread counts at import (ezdxf, under
        # cadquery, fails to import without a home directory; the jail has no passwd entry).
        self.job_env = {
            "PATH": "/usr/bin:/bin",
            "HOME": self.jobdir,
            "TMPDIR": os.path.join(self.jobdir, ".tmp"),
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
            "PYTHONIOENCODING": "utf-8",
            "PYTHONHASHSEED": "0",
        }
        os.environ.clear()
        os.environ.update(self.job_env)
        imported, failed = [], {}
        for name in self.cfg.get("preload", []):
            try:
                __import__(name)
                imported.append(name)
            except Exception as err:  # reported to the pool, which refuses the profile
                failed[name] = f"{type(err).__name__}: {err}"
        self._wipe_dir(self.jobdir)  # what an import left in HOME (ezdxf writes a font cache) is not a job's
        if self.cfg.get("seccomp", True):
            try:
                program = seccomp.build_filter((os.getpid(),), bool(self.cfg.get("network")))
                self.seccomp = seccomp.Installer(program)
                self.seccomp_status = self._verify_seccomp()
            except seccomp.SeccompUnsupported as err:
                self.seccomp_status = f"unavailable: {err}"
            if self.seccomp_status == "on":
                # The worker runs under the filter itself, so each job child inherits it for free. The
                # filter forbids signalling this pid, so the worker sweeps by walking its process tree.
                self.seccomp.install()  # type: ignore[union-attr]
            else:
                self.seccomp = None
        gc.collect()
        gc.freeze()  # keeps forked children from copying the worker's heap on the first GC
        self.base_vm_bytes = _vm_size()
        return {
            "ready": True,
            "pid": os.getpid(),
            "uid": os.getuid(),
            "seccomp": self.seccomp_status,
            "preloaded": imported,
            "preload_failed": failed,
            "python": sys.version.split()[0],
        }

    def _verify_seccomp(self) -> str:
        """Install the filter in a throwaway child and check that a denied call really fails."""
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                self.seccomp.install()  # type: ignore[union-attr]
                try:
                    os.kill(os.getppid(), 0)
                    code = 1
                except PermissionError:
                    code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        return "on" if code == 0 else f"unavailable: self-test exit {code}"

    # ---- one job -----------------------------------------------------------------------------
    def handle(self, header: dict, blobs: list[bytes]) -> tuple[dict, list[bytes]]:
        t0 = time.monotonic()
        try:
            self._fresh_jobdir()
            code, stdin = blobs[0], blobs[1]
            for name, data in zip(header.get("files", []), blobs[2:], strict=True):
                self._write_input(name, data)
            lang = header["language"]
            limits = header["limits"]
            stdin_fd = os.memfd_create("stdin", 0) if stdin else os.open("/dev/null", os.O_RDONLY)
            try:
                if stdin:
                    os.write(stdin_fd, stdin)
                    os.lseek(stdin_fd, 0, os.SEEK_SET)
                compile_ms = 0.0
                if lang in COMPILE:
                    argv, src = COMPILE[lang]
                    with open(os.path.join(self.jobdir, src), "wb") as fh:
                        fh.write(code)
                    climits = dict(
                        limits,
                        wall_time_s=max(30.0, limits["wall_time_s"]),
                        cpu_time_s=max(20.0, limits["cpu_time_s"]),
                        memory_bytes=max(1 << 30, limits["memory_bytes"]),
                        max_processes=max(8, limits["max_processes"]),
                        max_file_bytes=max(64 << 20, limits["max_file_bytes"]),
                    )
                    res, out, err = self.supervise(("exec", argv), climits, None)
                    compile_ms = res["wall_ms"]
                    if res["status"] != "ok":
                        failed = res["status"] in ("runtime_error", "output_truncated")
                        status = "compile_error" if failed else res["status"]
                        res.update(status=status, compile_ms=compile_ms)
                        return res, [out, err]
                    target = ("exec", ["./main", *header.get("argv", [])])
                elif lang == "bash":
                    with open(os.path.join(self.jobdir, "main.sh"), "wb") as fh:
                        fh.write(code)
                    target = ("exec", ["/bin/bash", "main.sh", *header.get("argv", [])])
                elif lang == "python":
                    with open(os.path.join(self.jobdir, "solution.py"), "wb") as fh:
                        fh.write(code)  # so tracebacks can quote the job's source lines
                    target = ("python", code)
                else:
                    return {"status": "sandbox_error", "error": f"unknown language {lang!r}"}, [b"", b""]
                before = self._snapshot()
                res, out, err = self.supervise(target, limits, stdin_fd, argv=header.get("argv", []))
                res["compile_ms"] = compile_ms
            finally:
                os.close(stdin_fd)
            files, fblobs = self._collect(before, int(header.get("max_files_bytes", 0)))
            res["files"] = files
            return res, [out, err, *fblobs]
        except Exception as err:
            return {
                "status": "sandbox_error",
                "error": f"worker: {type(err).__name__}: {err}",
                "wall_ms": (time.monotonic() - t0) * 1000,
                "recycle": True,
            }, [b"", b""]
        finally:
            # Millions of empty files cost kernel memory and a slow wipe: let the jail die instead.
            # /dev/shm is wiped like the job dir: POSIX shm (and anything else a job leaves there)
            # would otherwise outlive the job, readable by the next one and charged to its memory.
            dirs = [self.jobdir, *([self.shm_dir] if self.shm_dir else [])]
            if sum(self._used_inodes(d) for d in dirs) > MAX_INODES_TO_WIPE or not all(
                map(self._wipe_dir, dirs)
            ):
                self.recycle_hint = True

    def _fresh_jobdir(self) -> None:
        if os.listdir(self.jobdir):
            raise RuntimeError("job dir not empty at job start")
        if self.shm_dir and os.listdir(self.shm_dir):
            raise RuntimeError(f"{self.shm_dir} not empty at job start")
        os.mkdir(os.path.join(self.jobdir, ".tmp"), 0o700)

    def _write_input(self, name: str, data: bytes) -> None:
        if name.startswith("/") or ".." in name.split("/") or not name:
            raise ValueError(f"bad file name {name!r}")
        path = os.path.join(self.jobdir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data)

    def _snapshot(self) -> dict[str, tuple[int, int]]:
        snap = {}
        for rel, st in _walk_files(self.jobdir):
            snap[rel] = (st.st_size, st.st_mtime_ns)
        return snap

    def _collect(self, before: dict, cap: int) -> tuple[list, list[bytes]]:
        names, blobs, total = [], [], 0
        if cap <= 0:
            return names, blobs
        for rel, st in _walk_files(self.jobdir):
            if rel.startswith(".tmp/") or before.get(rel) == (st.st_size, st.st_mtime_ns):
                continue
            if total + st.st_size > cap:
                names.append([rel, False])
                blobs.append(b"")
                continue
            try:
                fd = os.open(os.path.join(self.jobdir, rel), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                try:
                    data = os.read(fd, st.st_size + 1)[: st.st_size]
                finally:
                    os.close(fd)
            except OSError:
                continue
            total += len(data)
            names.append([rel, True])
            blobs.append(data)
        return names, blobs

    def _used_inodes(self, path: str) -> int:
        try:
            st = os.statvfs(path)
        except OSError:
            return 0
        return st.f_files - st.f_ffree if self.in_pidns else 0  # only meaningful on the jail's own tmpfs

    def _wipe_dir(self, root: str) -> bool:
        """Empty `root`; a job may have chmod-ed its own dirs to 000, so fix modes as we go."""

        def fix(func, path, _exc):
            try:
                os.chmod(os.path.dirname(path), 0o700)
                if os.path.isdir(path) and not os.path.islink(path):
                    os.chmod(path, 0o700)
                func(path)
            except OSError:
                pass

        if not self.in_pidns:  # our own temp dir (the jail's /job is root-owned and 1777)
            try:
                os.chmod(root, 0o700)
            except OSError:
                pass
        try:
            entries = os.listdir(root)
        except OSError:
            return False
        for name in entries:
            path = os.path.join(root, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, onerror=fix)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        try:
            return not os.listdir(root)
        except OSError:
            return False

    def _watch(self, pid: int, t0: float, limits: dict, out_r: int, err_r: int, python: bool):
        cap = int(limits["max_output_bytes"])
        deadline = t0 + float(limits["wall_time_s"])
        bufs = {out_r: bytearray(), err_r: bytearray()}
        truncated = {out_r: False, err_r: False}
        open_fds = {out_r, err_r}
        reason = None
        pidfd = os.pidfd_open(pid)
        try:
            while True:
                now = time.monotonic()
                if now >= deadline:
                    reason = "timeout"
                    break
                ready, _, _ = select.select([*open_fds, pidfd], [], [], deadline - now)
                exited = pidfd in ready
                for fd in ready:
                    if fd != pidfd and self._read_capped(fd, bufs, truncated, cap, open_fds):
                        reason = "output"
                if reason or exited:
                    break
        finally:
            os.close(pidfd)
        _kill_quiet(pid)
        _kill_quiet(-pid)  # the job's process group
        _, wstatus, ru = os.wait4(pid, 0)
        recycle = not self._kill_descendants()
        wall_ms = (time.monotonic() - t0) * 1000
        drain_deadline = time.monotonic() + 0.5
        while open_fds and time.monotonic() < drain_deadline:
            ready, _, _ = select.select(list(open_fds), [], [], 0.05)
            for fd in ready:
                if self._read_capped(fd, bufs, truncated, cap, open_fds) and reason is None:
                    reason = "output"
        recycle = recycle or bool(open_fds)
        cpu_ms = (ru.ru_utime + ru.ru_stime) * 1000
        exit_code, sig = None, None
        if os.WIFSIGNALED(wstatus):
            sig = os.WTERMSIG(wstatus)
        else:
            exit_code = os.WEXITSTATUS(wstatus)
        stderr = bytes(bufs[err_r])
        # A Python MemoryError ends stderr with the harness's line (the job holds no private channel to
        # us: it could only claim one by raising it); C++ aborts with bad_alloc; C usually segfaults on
        # a NULL malloc, which we only attribute to memory when the job really was near its limit.
        near_limit = ru.ru_maxrss * 1024 >= 0.8 * limits["memory_bytes"]
        python_oom = python and exit_code == 1 and stderr.endswith(MEMORY_ERROR_LINE)
        memory = python_oom or b"std::bad_alloc" in stderr[-4096:] or (sig == signal.SIGSEGV and near_limit)
        if reason == "timeout":
            status = "timeout"
        elif reason == "output":
            status = "output_truncated"
        elif sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_ms >= limits["cpu_time_s"] * 1000):
            status = "timeout"
        elif memory:
            status = "memory_exceeded"
        elif sig == signal.SIGKILL:
            status = "killed"
        elif sig is not None or exit_code != 0:
            status = "runtime_error"
        else:
            status = "ok"
        res = {
            "status": status,
            "exit_code": exit_code,
            "signal": sig,
            "wall_ms": wall_ms,
            "cpu_ms": cpu_ms,
            "max_rss_bytes": ru.ru_maxrss * 1024,
            "stdout_truncated": truncated[out_r],
            "stderr_truncated": truncated[err_r],
            "recycle": recycle,
        }
        return res, bytes(bufs[out_r]), stderr

    @staticmethod
    def _read_capped(fd: int, bufs: dict, truncated: dict, cap: int, open_fds: set) -> bool:
        """Read what is there; returns True when the stream went over its cap."""
        try:
            data = os.read(fd, 1 << 16)
        except OSError:
            data = b""
        if not data:
            open_fds.discard(fd)
            return False
        room = cap - len(bufs[fd])
        if len(data) > room:
            bufs[fd] += data[: max(room, 0)]
            truncated[fd] = True
            open_fds.discard(fd)
            return True
        bufs[fd] += data
        return False

    def _kill_descendants(self) -> bool:
        """SIGKILL and reap every process the job left behind (daemons too); True when none remain.

        We are a subreaper, so orphans come back to us; the PID namespace holds nothing else."""
        deadline = time.monotonic() + 1.0
        while True:
            for pid in _descendants():
                _kill_quiet(pid)
            while True:
                try:
                    got, _ = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    return True
                if got == 0:
                    break
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)

    # ---- the child ---------------------------------------------------------------------------
    def supervise(self, target: tuple, limits: dict, stdin_fd: int | None, argv: list | None = None):
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:  # child: never returns
            try:
                self._child(target, limits, stdin_fd, out_w, err_w, argv or [])
            finally:
                os._exit(127)
        os.close(out_w)
        os.close(err_w)
        try:
            return self._watch(pid, t0, limits, out_r, err_r, target[0] == "python")
        finally:
            for fd in (out_r, err_r):
                _close_quiet(fd)

    def _child(self, target, limits, stdin_fd, out_w, err_w, argv) -> None:
        os.setpgid(0, 0)
        if stdin_fd is None:
            stdin_fd = os.open("/dev/null", os.O_RDONLY)
        os.dup2(stdin_fd, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        # Nothing but stdio survives: a Python job runs in this very process, so any fd left open here
        # (the protocol pipes, a status pipe) would be the job's to write.
        os.closerange(3, 1 << 16)
        os.chdir(self.jobdir)
        if not self.in_pidns:  # no PID namespace to take the job down with the worker
            self.libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if target[0] == "exec":  # Python jobs keep Python's own handlers (SIGPIPE, SIGXFSZ ignored)
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        mem = int(limits["memory_bytes"])
        as_limit = mem + (self.base_vm_bytes if target[0] == "python" else 0)
        cpu = max(1, int(limits["cpu_time_s"] + 0.999))
        rl = [
            (resource.RLIMIT_AS, as_limit),
            (resource.RLIMIT_DATA, as_limit),
            (resource.RLIMIT_CPU, (cpu, cpu + 1)),
            (resource.RLIMIT_FSIZE, int(limits["max_file_bytes"])),
            (resource.RLIMIT_NOFILE, CHILD_FDS_LIMIT),
            (resource.RLIMIT_CORE, 0),
            (resource.RLIMIT_STACK, 64 << 20),
        ]
        nproc_extra = self.cfg.get("nproc_extra", 1)
        if nproc_extra is not None:  # None without a jail: the count would include all our user's processes
            rl.append((resource.RLIMIT_NPROC, int(limits["max_processes"]) + int(nproc_extra)))
        for res, val in rl:
            soft, hard = val if isinstance(val, tuple) else (val, val)
            try:
                resource.setrlimit(res, (soft, hard))
            except (ValueError, OSError):  # cannot raise above an inherited hard limit: clamp to it
                cur_hard = resource.getrlimit(res)[1]
                resource.setrlimit(res, (min(soft, cur_hard), min(hard, cur_hard)))
        if target[0] == "exec":
            os.execve(target[1][0], target[1], self.job_env)
        _run_python(target[1], argv)


def _run_python(code: bytes, argv: list) -> None:
    """Execute user code in this (freshly forked, pre-warmed) interpreter, then exit like python."""
    sys.argv = ["solution.py", *argv]
    if _STDIO_REUSABLE:  # the interpreter's own (never used) stdio objects now sit on the job's fds
        sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__
    else:
        sys.stdin = io.TextIOWrapper(
            io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8", errors="surrogateescape"
        )
        sys.stdout = io.TextIOWrapper(
            io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8", errors="surrogateescape"
        )
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", write_through=True
        )
    sys.path[0] = os.getcwd()
    status = 0
    try:
        glob = {"__name__": "__main__", "__builtins__": __builtins__, "__file__": "solution.py"}
        exec(compile(code, "solution.py", "exec"), glob)
    except SystemExit as exc:
        if exc.code is None:
            status = 0
        elif isinstance(exc.code, int):
            status = exc.code & 0xFF
        else:
            _write_quiet(2, f"{exc.code}\n".encode())
            status = 1
    except MemoryError:
        _write_quiet(2, MEMORY_ERROR_LINE)
        status = 1
    except BaseException as exc:
        try:  # hide the harness frame: the traceback starts in the job's code
            traceback.print_exception(
                type(exc), exc, exc.__traceback__.tb_next if exc.__traceback__ else None
            )
        except MemoryError:
            _write_quiet(2, b"\n" + MEMORY_ERROR_LINE)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # the job closed its own stdout
            pass
    os._exit(status)


def _stdio_reusable() -> bool:
    """True when the interpreter's startup stdio is UTF-8 with the error handlers jobs expect."""
    want = (("utf-8", "surrogateescape"), ("utf-8", "surrogateescape"), ("utf-8", "backslashreplace"))
    streams = (sys.__stdin__, sys.__stdout__, sys.__stderr__)
    return all(
        s is not None and (s.encoding.lower().replace("_", "-"), s.errors) == w
        for s, w in zip(streams, want, strict=True)
    )


_STDIO_REUSABLE = False


def _write_quiet(fd: int, data: bytes) -> None:
    try:
        os.write(fd, data)
    except OSError:
        pass


def _close_quiet(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _vm_size() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 64 << 20


def _walk_files(root: str, rel: str = ""):
    """(relative path, lstat) of every regular file under root, not following symlinks."""
    try:
        entries = list(os.scandir(os.path.join(root, rel) if rel else root))
    except OSError:
        return
    for entry in entries:
        name = f"{rel}/{entry.name}" if rel else entry.name
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            yield name, st
        elif stat.S_ISDIR(st.st_mode):
            yield from _walk_files(root, name)


def _kill_quiet(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _descendants() -> list[int]:
    """Every live descendant of this process, from /proc/<pid>/task/<tid>/children."""
    found: list[int] = []
    frontier = [os.getpid()]
    while frontier:
        pid = frontier.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as fh:
                    kids = [int(k) for k in fh.read().split()]
            except OSError:
                continue
            found.extend(kids)
            frontier.extend(kids)
    return found


def main() -> None:
    cfg = json.loads(sys.argv[1])
    proto_in, proto_out = os.dup(0), os.dup(1)
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    global _STDIO_REUSABLE
    _STDIO_REUSABLE = _stdio_reusable()
    worker = Worker(cfg)
    write_frame(proto_out, worker.setup(), [])
    while True:
        frame = read_frame(proto_in)
        if frame is None:
            return
        header, blobs = frame
        if header.get("op") == "ping":
            me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
            write_frame(
                proto_out,
                {
                    "pong": True,
                    "cpu_s": me.ru_utime + me.ru_stime,
                    "children_cpu_s": kids.ru_utime + kids.ru_stime,
                },
                [],
            )
            continue
        worker.recycle_hint = False
        res, out = worker.handle(header, blobs)
        res["recycle"] = bool(res.get("recycle")) or worker.recycle_hint
        write_frame(proto_out, res, out)


if __name__ == "__main__":
    main()
