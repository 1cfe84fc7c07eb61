"""Isolation layers: detect what this machine offers, build the jail command line, manage cgroups.

Owns the bubblewrap argv (namespaces, read-only binds, private job tmpfs, uid drop), cgroup memory/
pids groups per worker slot (v1, or v2 under a delegated subtree), profiles (what a warm worker pre-imports and which packages it
may see) and the doctor report. It does not run jobs (`pool`) or filter syscalls (`jailed.seccomp`).
"""

from __future__ import annotations

import errno
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
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

JAILED_DIR = Path(__file__).resolve().parent / "jailed"
JAIL_ROOT = "/opt/ptsb"
JAIL_JOB_ROOT = "/job"
JAIL_SHM_DIR = "/dev/shm"
JAIL_UID_BASE = 61000  # one unprivileged uid per worker slot when we start as root
CGROUP_V1_ROOT = Path("/sys/fs/cgroup")
CGROUP_V2_CONTROLLERS = ("memory", "pids")
CGROUP_V2_MAIN_PREFIX = "posttrain-main-"  # the leaf this process moves into to free its cgroup (v2)
CGROUP_PARENT_PREFIX = "posttrain-sandbox-"
ETC_FILES = (
    "/etc/alternatives",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
)
ETC_NETWORK_FILES = (
    "/etc/resolv.conf",
    "/etc/hosts",
    "/etc/nsswitch.conf",
    "/etc/ssl",
    "/etc/ca-certificates",
)

# Imported once per worker: a job that imports them pays nothing (measured: 2.8 ms of CPU per job
# with them preloaded against 17 ms for a job importing a dozen of them cold), and forking a worker
# that holds them costs no more than forking a bare one.
STDLIB_PRELOAD = [
    "math",
    "cmath",
    "re",
    "json",
    "collections",
    "itertools",
    "functools",
    "heapq",
    "bisect",
    "string",
    "random",
    "typing",
    "dataclasses",
    "fractions",
    "decimal",
    "statistics",
    "copy",
    "operator",
    "array",
    "datetime",
    "time",
    "traceback",
    "io",
    "unittest",
    "enum",
    "abc",
    "contextlib",
    "inspect",
    "textwrap",
    "hashlib",
    "base64",
    "struct",
    "numbers",
    "pathlib",
    "ast",
]


# What `import cadquery` loads from site-packages (OCP's shared libraries sit beside it, in
# cadquery_ocp.libs): all the `cad` profile's jail sees of the installation.
CAD_PACKAGES = (
    "cadquery",
    "OCP",
    "cadquery_ocp",
    "vtkmodules",
    "vtk",
    "casadi",
    "nlopt",
    "ezdxf",
    "fontTools",
    "multimethod",
    "pyparsing",
    "runtype",
    "typing_extensions",
    "numpy",
)


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
    # CadQuery on OpenCASCADE (the cad extra): importing it costs seconds, forking a worker that holds
    # it tens of milliseconds (cad.modeling's scripts)
    "cad": Profile("cad", (*STDLIB_PRELOAD, "numpy", "cadquery"), CAD_PACKAGES),
}


def register_profile(profile: Profile) -> None:
    """Add a profile (e.g. one pre-importing a CAD kernel); packages must be importable here."""
    PROFILES[profile.name] = profile


def package_dirs(packages: tuple[str, ...]) -> list[Path]:
    """Paths to expose for `packages`: the package directory and its bundled `<name>.libs`, or the file
    of a single-file module."""
    dirs: list[Path] = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is not None and not spec.submodule_search_locations and spec.origin:
            dirs.append(Path(spec.origin).resolve())  # a single-file module (e.g. pytest's py.py)
            continue
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
    cgroups: str | None = None  # "v1" or "v2" when memory+pids groups are writable
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
        spec = JailSpec(
            python=python_install(),
            slot_uid=JAIL_UID_BASE if iso.uid_drop else None,
            binds=[],
            network=False,
            job_disk_bytes=1 << 20,
        )
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
    """v1 first: on a hybrid host the memory controller sits on v1 and the v2 tree has none."""
    mem, pids = own_cgroup_dir("memory"), own_cgroup_dir("pids")
    if (mem / "memory.limit_in_bytes").exists() and (pids / "cgroup.procs").exists():
        probe = mem / f"posttrain-probe-{os.getpid()}"
        try:
            probe.mkdir(exist_ok=True)
            probe.rmdir()
            return "v1", f"v1 under {mem} and {pids}: memory.limit_in_bytes, pids.max per worker"
        except OSError as err:
            return None, f"cgroup v1 present but not writable ({err.strerror})"
    base = cgroup_v2_base()
    if base is not None:
        why = probe_cgroup_v2(base, os.getpid())
        return (
            ("v2", f"v2 at {base}: memory.max, memory.swap.max, pids.max per worker")
            if why is None
            else (None, why)
        )
    return None, "no cgroup memory/pids controller mounted"


# ---- cgroup v2 -------------------------------------------------------------------------------
def cgroup2_mount(mountinfo: str = "/proc/self/mountinfo") -> Path | None:
    """Where the cgroup2 hierarchy is mounted (/sys/fs/cgroup, or /sys/fs/cgroup/unified on a hybrid host)."""
    try:
        for line in Path(mountinfo).read_text().splitlines():
            fields = line.split()
            sep = fields.index("-")
            if fields[sep + 1] == "cgroup2":
                return Path(fields[4])
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_v2_base(mount: Path | None = None, proc_cgroup: str = "/proc/self/cgroup") -> Path | None:
    """The v2 cgroup our groups nest under: our own, or, once we moved into our `posttrain-main-*` leaf
    (or were started inside another posttrain's), that leaf's parent."""
    mount = mount if mount is not None else cgroup2_mount()
    if mount is None:
        return None
    try:
        rel = next(
            line.split(":", 2)[2]
            for line in Path(proc_cgroup).read_text().splitlines()
            if line.startswith("0::")
        )
    except (OSError, StopIteration):
        return None
    own = mount / rel.strip().lstrip("/")
    return own.parent if own.name.startswith(CGROUP_V2_MAIN_PREFIX) else own


def _cg_read(path: Path) -> list[str]:
    return path.read_text().split()


def _cg_write(path: Path, text: str) -> None:
    with open(path, "w") as fh:  # one write(2): the kernel parses each write as one command
        fh.write(text)


def _cg_mkdir(path: Path) -> None:
    path.mkdir(exist_ok=True)  # the kernel fills in the interface files


def probe_cgroup_v2(base: Path, pid: int) -> str | None:
    """None when per-worker groups with memory and pids limits can be made under `base`, else why not."""
    try:
        available = _cg_read(base / "cgroup.controllers")
        enabled = _cg_read(base / "cgroup.subtree_control")
        procs = _cg_read(base / "cgroup.procs")
    except OSError as err:
        return f"cgroup v2 at {base} unreadable ({err.strerror})"
    missing = [c for c in CGROUP_V2_CONTROLLERS if c not in available]
    if missing:
        verb = "controllers are" if len(missing) > 1 else "controller is"
        return (
            f"cgroup v2 at {base}: the {' and '.join(missing)} {verb} not delegated here "
            f"(cgroup.controllers: {' '.join(available) or 'none'})"
        )
    if any(c not in enabled for c in CGROUP_V2_CONTROLLERS) and set(procs) - {str(pid)}:
        return (
            f"cgroup v2 at {base} holds {len(set(procs) - {str(pid)})} other process(es), so its memory and "
            "pids controllers cannot be handed to child groups; start posttrain in a delegated cgroup "
            "of its own (e.g. systemd-run --scope -p Delegate=yes ...)"
        )
    probe = base / f"posttrain-probe-{pid}"
    try:
        probe.mkdir(exist_ok=True)
        probe.rmdir()
    except OSError as err:
        return f"cgroup v2 at {base} not writable ({err.strerror})"
    return None


def ensure_cgroup_v2_parent(base: Path, pid: int) -> Path:
    """Enable memory+pids for children of `base` and return our per-process parent group under it.

    A v2 group with processes of its own cannot hand controllers to children ("no internal
    processes"): when `base` holds only this process, we first move into a leaf of our own."""
    want = "".join(f" +{c}" for c in CGROUP_V2_CONTROLLERS).strip()
    if any(c not in _cg_read(base / "cgroup.subtree_control") for c in CGROUP_V2_CONTROLLERS):
        try:
            _cg_write(base / "cgroup.subtree_control", want)
        except OSError as err:
            if err.errno != errno.EBUSY:
                raise
            leaf = base / f"{CGROUP_V2_MAIN_PREFIX}{pid}"
            _cg_mkdir(leaf)
            _cg_write(leaf / "cgroup.procs", str(pid))
            _cg_write(base / "cgroup.subtree_control", want)
    parent = base / f"{CGROUP_PARENT_PREFIX}{pid}"
    _cg_mkdir(parent)
    if any(c not in _cg_read(parent / "cgroup.subtree_control") for c in CGROUP_V2_CONTROLLERS):
        _cg_write(parent / "cgroup.subtree_control", want)
    return parent


def cgroup_v2_limits(memory_bytes: int, max_pids: int) -> dict[str, str]:
    """The files a v2 worker group gets: no swap, so memory.max is the whole story."""
    return {"memory.max": str(memory_bytes), "memory.swap.max": "0", "pids.max": str(max_pids)}


def _kill_procs(procs: Path, deadline: float) -> bool:
    """SIGKILL every pid listed in `procs` until it is empty (True) or the deadline passes (False)."""
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


class CgroupV2Slot:
    """A cgroup v2 group for one worker slot, a leaf under this process's `posttrain-sandbox-<pid>`."""

    OPTIONAL = ("memory.swap.max",)  # absent when the kernel does not account swap

    def __init__(self, parent: Path, name: str, limits: dict[str, str]) -> None:
        self.dir = parent / name
        _cg_mkdir(self.dir)
        for key, value in limits.items():
            if key in self.OPTIONAL and not (self.dir / key).exists():
                continue  # (writing a file cgroupfs lacks fails with EACCES, not ENOENT)
            _cg_write(self.dir / key, value)

    @property
    def dirs(self) -> list[Path]:
        return [self.dir]

    @property
    def procs_files(self) -> list[str]:
        return [str(self.dir / "cgroup.procs")]

    def oom_kills(self) -> int:
        try:
            for line in (self.dir / "memory.events").read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    def kill_all(self, timeout_s: float = 5.0) -> bool:
        """Kill everything in the group (cgroup.kill where the kernel has it) and wait until it is empty."""
        try:
            _cg_write(self.dir / "cgroup.kill", "1")
        except OSError:
            pass
        return _kill_procs(self.dir / "cgroup.procs", time.monotonic() + timeout_s)

    def remove(self) -> None:
        self.kill_all()
        for d in (self.dir, self.dir.parent):  # the parent goes once its last slot is gone
            try:
                d.rmdir()
            except OSError:
                pass


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


def setpriv_argv(uid: int) -> list[str]:
    """The command prefix that drops to `uid` (same gid) with no supplementary groups or capabilities."""
    return [
        "/usr/bin/setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
    ]


@dataclass
class JailSpec:
    """Everything that varies between worker jails."""

    python: PythonInstall
    slot_uid: int | None  # drop to this uid inside (root only)
    binds: list[Path]  # package dirs exposed read-only under /opt/ptsb/site
    network: bool
    job_disk_bytes: int

    def bwrap_argv(self, bwrap: str) -> list[str]:
        argv = [
            bwrap,
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--die-with-parent",
            "--new-session",
        ]
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
        argv += [
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--perms",
            "01777",
            "--size",
            str(self.job_disk_bytes),
            "--tmpfs",
            JAIL_SHM_DIR,
            "--remount-ro",
            "/dev",
            "--perms",
            "01777",
            "--size",
            str(self.job_disk_bytes),
            "--tmpfs",
            JAIL_JOB_ROOT,
            "--symlink",
            f"{JAIL_JOB_ROOT}/.tmp",
            "/tmp",
            "--remount-ro",
            "/",
            "--chdir",
            JAIL_JOB_ROOT,
            "--clearenv",
            "--setenv",
            "PATH",
            "/usr/bin:/bin",
            "--setenv",
            "LANG",
            "C.UTF-8",
            "--setenv",
            "OPENBLAS_NUM_THREADS",
            "1",
            "--setenv",
            "OMP_NUM_THREADS",
            "1",
        ]
        if not self.python.under_usr:
            argv += ["--setenv", "LD_LIBRARY_PATH", f"{self.python.jail_prefix}/lib"]
        return argv

    def worker_argv(self, bwrap: str, cfg: dict) -> list[str]:
        argv = self.bwrap_argv(bwrap)
        if self.slot_uid is not None:
            argv += setpriv_argv(self.slot_uid)
        # RLIMIT_NPROC counts the jail uid's processes: the worker, plus bwrap's init when it shares the uid
        cfg = dict(
            cfg,
            job_root=JAIL_JOB_ROOT,
            shm_dir=JAIL_SHM_DIR,
            pidns=True,
            nproc_extra=1 if self.slot_uid is not None else 2,
            sys_path=[f"{JAIL_ROOT}/site"] if self.binds else [],
        )
        return argv + [
            self.python.jail_executable,
            "-I",
            "-S",
            "-B",
            f"{JAIL_ROOT}/jailed/worker.py",
            json.dumps(cfg),
        ]


def unisolated_worker_argv(job_root: str, binds: list[Path], cfg: dict) -> list[str]:
    """The worker without a jail (allow_unisolated): rlimits, seccomp and a clean env only."""
    cfg = dict(
        cfg, job_root=job_root, pidns=False, nproc_extra=None, sys_path=sorted({str(p.parent) for p in binds})
    )
    return [
        python_install().host_executable,
        "-I",
        "-S",
        "-B",
        str(JAILED_DIR / "worker.py"),
        json.dumps(cfg),
    ]


class CgroupSlot:
    """A cgroup v1 memory+pids group for one worker slot, created under a per-process parent."""

    def __init__(self, name: str, memory_bytes: int, max_pids: int) -> None:
        base = f"{CGROUP_PARENT_PREFIX}{os.getpid()}"
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
        return _kill_procs(self.dirs[1] / "cgroup.procs", time.monotonic() + timeout_s)

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


def make_cgroup_slot(version: str, name: str, memory_bytes: int, max_pids: int) -> CgroupSlot | CgroupV2Slot:
    """The worker slot's group for the detected cgroup version ("v1" or "v2")."""
    if version == "v1":
        return CgroupSlot(name, memory_bytes, max_pids)
    base = cgroup_v2_base()
    if base is None:
        raise SandboxUnavailable("cgroup v2 was detected but its mount is gone")
    with _V2_SETUP:
        parent = ensure_cgroup_v2_parent(base, os.getpid())
    return CgroupV2Slot(parent, name, cgroup_v2_limits(memory_bytes, max_pids))


_V2_SETUP = threading.Lock()


def sandbox_cgroup_dirs(version: str | None, instance: int) -> list[Path]:
    """The worker groups of `LocalSandbox` number `instance` in this process (v1: memory and pids)."""
    pattern = f"{CGROUP_PARENT_PREFIX}{os.getpid()}/i{instance}-*"
    if version == "v1":
        return [d for ctl in ("memory", "pids") for d in sorted(own_cgroup_dir(ctl).glob(pattern))]
    base = cgroup_v2_base() if version == "v2" else None
    return sorted(base.glob(pattern)) if base is not None else []


def _stale(name: str, prefix: str) -> bool:
    pid = name[len(prefix) :]
    return name.startswith(prefix) and pid.isdigit() and not Path(f"/proc/{pid}").exists()


def sweep_stale_cgroups(version: str = "v1", v2_base: Path | None = None) -> None:
    """Remove empty groups left by sandbox processes that died without cleaning up."""
    if version == "v1":
        roots = [own_cgroup_dir(ctl) for ctl in ("memory", "pids")]
    else:
        base = v2_base if v2_base is not None else cgroup_v2_base()
        roots = [base] if base is not None else []
    for root in roots:
        if not root.is_dir():
            continue
        for parent in root.iterdir():
            if _stale(parent.name, CGROUP_PARENT_PREFIX):
                for child in parent.iterdir():
                    if child.is_dir():
                        try:
                            child.rmdir()
                        except OSError:
                            pass
            elif not _stale(parent.name, CGROUP_V2_MAIN_PREFIX):
                continue
            try:
                parent.rmdir()
            except OSError:
                pass


def make_job_root() -> str:
    return tempfile.mkdtemp(prefix="posttrain-sbx-")
