"""Isolation layers: detect what this machine offers, build the jail command line, manage cgroups.

Owns the bubblewrap argv (namespaces, read-only binds, private job tmpfs, uid drop), cgroup v1
memory/pids groups per worker slot, profiles (what a warm worker pre-imports and which packages it
may see) and the doctor report. It does not run jobs (`pool`) or filter syscalls (`jailed.seccomp`).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

JAILED_DIR = Path(__file__).resolve().parent / "jailed"
JAIL_ROOT = "/opt/ptsb"
JAIL_JOB_ROOT = "/job"
JAIL_SHM_DIR = "/dev/shm"
JAIL_UID_BASE = 61000  # one unprivileged uid per worker slot when we start as root
CGROUP_V1_ROOT = Path("/sys/fs/cgroup")
ETC_FILES = ("/etc/alternatives", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime")
ETC_NETWORK_FILES = ("/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf", "/etc/ssl", "/etc/ca-certificates")

# Imported once per worker: a job that imports them pays nothing (measured: 2.8 ms of CPU per job
# with them preloaded against 17 ms for a job importing a dozen of them cold), and forking a worker
# that holds them costs no more than forking a bare one.
STDLIB_PRELOAD = [
    "math", "cmath", "re", "json", "collections", "itertools", "functools", "heapq", "bisect", "string",
    "random", "typing", "dataclasses", "fractions", "decimal", "statistics", "copy", "operator", "array",
    "datetime", "time", "traceback", "io", "unittest", "enum", "abc", "contextlib", "inspect", "textwrap",
    "hashlib", "base64", "struct", "numbers", "pathlib", "ast",
]


class SandboxUnavailable(RuntimeError):
    """No usable isolation (or a requested profile cannot start); the message says what to do."""


@dataclass(frozen=True)
class Profile:
    """A warm-pool flavour: modules imported before forking and site packages made visible."""

    name: str
    preload: tuple[str, ...]
    packages: tuple[str, ...] = ()


PROFILES: dict[str, Profile] = {
    "default": Profile("default", tuple(STDLIB_PRELOAD)),
    "numpy": Profile("numpy", (*STDLIB_PRELOAD, "numpy"), ("numpy",)),
}


def register_profile(profile: Profile) -> None:
    """Add a profile (e.g. one pre-importing a CAD kernel); packages must be importable here."""
    PROFILES[profile.name] = profile


def package_dirs(packages: tuple[str, ...]) -> list[Path]:
    """Directories to expose for `packages`: the package itself and its bundled `<name>.libs`."""
    dirs: list[Path] = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise SandboxUnavailable(f"profile package '{name}' is not installed in {sys.prefix}")
        pkg = Path(next(iter(spec.submodule_search_locations))).resolve()
        dirs.append(pkg)
        libs = pkg.parent / f"{name}.libs"
        if libs.is_dir():
            dirs.append(libs)
    return dirs


@dataclass
class Isolation:
    """What was detected. `layers` lists the active ones; `missing` says loudly what is not."""

    bwrap: str | None = None
    namespaces: bool = False
    seccomp: bool = False
    cgroups: str | None = None  # "v1" when memory+pids groups are writable
    uid_drop: bool = False
    details: dict[str, str] = field(default_factory=dict)

    @property
    def layers(self) -> list[str]:
        out = []
        if self.namespaces:
            out.append("namespaces(bwrap: user-visible fs ro, net, pid, ipc, uts, private /job and /dev/shm)")
        out.append("rlimits")
        if self.seccomp:
            out.append("seccomp")
        if self.cgroups:
            out.append(f"cgroups-{self.cgroups}(memory,pids)")
        if self.uid_drop:
            out.append("uid-drop")
        out.append("clean-env")
        return out

    @property
    def missing(self) -> list[str]:
        out = []
        if not self.namespaces:
            out.append(f"namespaces: {self.details.get('namespaces', 'bwrap not found')}")
            out.append("rlimit NPROC: off without a jail (it would count every process of this user)")
        if not self.seccomp:
            out.append(f"seccomp: {self.details.get('seccomp', 'unavailable')}")
        if not self.cgroups:
            out.append(f"cgroups: {self.details.get('cgroups', 'not writable')}")
        return out

    @property
    def isolated(self) -> bool:
        return self.namespaces


@functools.cache
def detect() -> Isolation:
    """Probe each layer once per process (bwrap by really starting a jail)."""
    iso = Isolation()
    iso.bwrap = shutil.which("bwrap")
    root = os.geteuid() == 0
    iso.uid_drop = iso.bwrap is not None and root and shutil.which("setpriv") is not None
    if iso.bwrap is None:
        iso.details["namespaces"] = "bubblewrap (bwrap) is not installed: apt-get install bubblewrap"
    else:
        spec = JailSpec(python=python_install(), slot_uid=JAIL_UID_BASE if iso.uid_drop else None, binds=[],
                        network=False, job_disk_bytes=1 << 20)
        argv = spec.bwrap_argv(iso.bwrap) + ["/bin/true"]
        try:
            proc = subprocess.run(argv, capture_output=True, timeout=30)
            iso.namespaces = proc.returncode == 0
            if not iso.namespaces:
                iso.details["namespaces"] = f"bwrap failed: {proc.stderr.decode(errors='replace').strip()}"
        except (OSError, subprocess.TimeoutExpired) as err:
            iso.details["namespaces"] = f"bwrap failed: {err}"
    iso.uid_drop = iso.uid_drop and iso.namespaces
    if platform.machine() in ("x86_64", "AMD64"):
        iso.seccomp = True  # confirmed per worker by a self-test; the pool downgrades on failure
    else:
        iso.details["seccomp"] = f"filter only built for x86_64 (this is {platform.machine()})"
    iso.cgroups, iso.details["cgroups"] = _probe_cgroups()
    if iso.namespaces and root and not iso.uid_drop:
        iso.details["uid_drop"] = "running as root without setpriv: jobs keep uid 0 mapped in the jail"
    return iso


def own_cgroup_dir(controller: str) -> Path:
    """This process's cgroup v1 directory for `controller`: our groups nest under it, so the limits
    and accounting of whoever runs us still apply to the sandbox."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controller in controllers.split(","):
                return CGROUP_V1_ROOT / controller / path.lstrip("/")
    except OSError:
        pass
    return CGROUP_V1_ROOT / controller


def _probe_cgroups() -> tuple[str | None, str]:
    mem, pids = own_cgroup_dir("memory"), own_cgroup_dir("pids")
    if (mem / "memory.limit_in_bytes").exists() and (pids / "cgroup.procs").exists():
        probe = mem / f"posttrain-probe-{os.getpid()}"
        try:
            probe.mkdir(exist_ok=True)
            probe.rmdir()
            return "v1", "memory and pids controllers writable"
        except OSError as err:
            return None, f"cgroup v1 present but not writable ({err.strerror})"
    if (CGROUP_V1_ROOT / "cgroup.controllers").exists():
        return None, "cgroup v2 detected; this version only drives cgroup v1"
    return None, "no cgroup memory/pids controller mounted"


@dataclass(frozen=True)
class PythonInstall:
    prefix: Path  # real base prefix outside the jail
    version: str  # "3.11"

    @property
    def under_usr(self) -> bool:
        return str(self.prefix).startswith("/usr")

    @property
    def jail_prefix(self) -> str:
        return str(self.prefix) if self.under_usr else f"{JAIL_ROOT}/python"

    @property
    def jail_executable(self) -> str:
        return f"{self.jail_prefix}/bin/python{self.version}"

    @property
    def host_executable(self) -> str:
        return str(self.prefix / "bin" / f"python{self.version}")


@functools.cache
def python_install() -> PythonInstall:
    return PythonInstall(Path(sys.base_prefix).resolve(), f"{sys.version_info[0]}.{sys.version_info[1]}")


@dataclass
class JailSpec:
    """Everything that varies between worker jails."""

    python: PythonInstall
    slot_uid: int | None  # drop to this uid inside (root only)
    binds: list[Path]  # package dirs exposed read-only under /opt/ptsb/site
    network: bool
    job_disk_bytes: int

    def bwrap_argv(self, bwrap: str) -> list[str]:
        argv = [bwrap, "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                "--die-with-parent", "--new-session"]
        if not self.network:
            argv.append("--unshare-net")
        if self.slot_uid is not None:
            argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
        else:
            argv += ["--unshare-user"]
        argv += ["--ro-bind", "/usr", "/usr"]
        for name in ("bin", "lib", "lib64", "lib32", "sbin"):
            host = Path("/") / name
            if host.is_symlink():
                argv += ["--symlink", os.readlink(host), f"/{name}"]
            elif host.is_dir():
                argv += ["--ro-bind", str(host), f"/{name}"]
        argv += ["--perms", "0755", "--dir", "/etc"]
        for path in ETC_FILES + (ETC_NETWORK_FILES if self.network else ()):
            if os.path.exists(path):
                argv += ["--ro-bind", path, path]
        argv += ["--perms", "0755", "--dir", JAIL_ROOT]
        if not self.python.under_usr:
            argv += ["--ro-bind", str(self.python.prefix), self.python.jail_prefix]
        argv += ["--ro-bind", str(JAILED_DIR), f"{JAIL_ROOT}/jailed"]
        if self.binds:
            argv += ["--perms", "0755", "--dir", f"{JAIL_ROOT}/site"]
            for path in self.binds:
                argv += ["--ro-bind", str(path), f"{JAIL_ROOT}/site/{path.name}"]
        # /dev: bwrap's tmpfs would be writable by the job in a user namespace and unbounded; it is
        # made read-only, with a private, sized /dev/shm that the worker empties after every job.
        argv += ["--proc", "/proc", "--dev", "/dev",
                 "--perms", "01777", "--size", str(self.job_disk_bytes), "--tmpfs", JAIL_SHM_DIR,
                 "--remount-ro", "/dev",
                 "--perms", "01777", "--size", str(self.job_disk_bytes), "--tmpfs", JAIL_JOB_ROOT,
                 "--symlink", f"{JAIL_JOB_ROOT}/.tmp", "/tmp",
                 "--remount-ro", "/", "--chdir", JAIL_JOB_ROOT, "--clearenv",
                 "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
                 "--setenv", "OPENBLAS_NUM_THREADS", "1", "--setenv", "OMP_NUM_THREADS", "1"]
        if not self.python.under_usr:
            argv += ["--setenv", "LD_LIBRARY_PATH", f"{self.python.jail_prefix}/lib"]
        return argv

    def worker_argv(self, bwrap: str, cfg: dict) -> list[str]:
        argv = self.bwrap_argv(bwrap)
        if self.slot_uid is not None:
            uid = str(self.slot_uid)
            argv += ["/usr/bin/setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                     "--inh-caps=-all", "--bounding-set=-all", "--"]
        # RLIMIT_NPROC counts the jail uid's processes: the worker, plus bwrap's init when it shares the uid
        cfg = dict(cfg, job_root=JAIL_JOB_ROOT, shm_dir=JAIL_SHM_DIR, pidns=True, nproc_extra=1 if self.slot_uid is not None else 2,
                   sys_path=[f"{JAIL_ROOT}/site"] if self.binds else [])
        return argv + [self.python.jail_executable, "-I", "-S", "-B", f"{JAIL_ROOT}/jailed/worker.py",
                       json.dumps(cfg)]


def unisolated_worker_argv(job_root: str, binds: list[Path], cfg: dict) -> list[str]:
    """The worker without a jail (allow_unisolated): rlimits, seccomp and a clean env only."""
    cfg = dict(cfg, job_root=job_root, pidns=False, nproc_extra=None,
               sys_path=sorted({str(p.parent) for p in binds}))
    return [python_install().host_executable, "-I", "-S", "-B", str(JAILED_DIR / "worker.py"), json.dumps(cfg)]


class CgroupSlot:
    """A cgroup v1 memory+pids group for one worker slot, created under a per-process parent."""

    def __init__(self, name: str, memory_bytes: int, max_pids: int) -> None:
        base = f"posttrain-sandbox-{os.getpid()}"
        self.dirs = [own_cgroup_dir("memory") / base / name, own_cgroup_dir("pids") / base / name]
        for d in self.dirs:
            d.mkdir(parents=True, exist_ok=True)
        (self.dirs[0] / "memory.limit_in_bytes").write_text(str(memory_bytes))
        (self.dirs[1] / "pids.max").write_text(str(max_pids))

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def oom_kills(self) -> int:
        try:
            for line in (self.dirs[0] / "memory.oom_control").read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    def kill_all(self, timeout_s: float = 5.0) -> bool:
        """SIGKILL every process still in the group and wait until it is empty."""
        deadline = time.monotonic() + timeout_s
        procs = self.dirs[1] / "cgroup.procs"
        while True:
            try:
                pids = [int(p) for p in procs.read_text().split()]
            except OSError:
                return True
            if not pids:
                return True
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)

    def remove(self) -> None:
        self.kill_all()
        for d in self.dirs:
            try:
                d.rmdir()
            except OSError:
                pass
            try:
                d.parent.rmdir()  # succeeds once the last slot is gone
            except OSError:
                pass


def sweep_stale_cgroups() -> None:
    """Remove empty groups left by sandbox processes that died without cleaning up."""
    for ctl in ("memory", "pids"):
        root = own_cgroup_dir(ctl)
        if not root.is_dir():
            continue
        for parent in root.glob("posttrain-sandbox-*"):
            pid = parent.name.rsplit("-", 1)[-1]
            if pid.isdigit() and Path(f"/proc/{pid}").exists():
                continue
            for child in parent.iterdir():
                if child.is_dir():
                    try:
                        child.rmdir()
                    except OSError:
                        pass
            try:
                parent.rmdir()
            except OSError:
                pass


def make_job_root() -> str:
    return tempfile.mkdtemp(prefix="posttrain-sbx-")
