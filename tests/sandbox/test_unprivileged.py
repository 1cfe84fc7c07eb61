"""The sandbox as an ordinary user (no root: bwrap makes a user namespace, no cgroups): the same jail
facts hold. Runs when we are root and a system Python >= 3.11 can host the package as uid 65534."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
SYSTEM_PYTHON = "/usr/bin/python3"

SCRIPT = r"""
from types import SimpleNamespace
from posttrain.sandbox import Job, Limits, LocalSandbox
cfg = SimpleNamespace(pool_size=1, recycle_after=500, allow_unisolated=False, allow_network=False, job_disk_mb=64,
                      memory_backstop_mb=2048, max_pids=128)
sb = LocalSandbox(cfg)
print(sb.isolation.namespaces, sb.isolation.seccomp, sb.isolation.cgroups, sb.isolation.uid_drop)
codes = [
    "import os; print(os.getuid(), os.path.exists('/work'), os.path.exists('/root'))",
    "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(60)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print('stopped', n, e.errno)",
    "import os\nfor t in (os.getppid(), -1, 1):\n    try:\n        os.kill(t, 9)\n    except OSError as e:\n        print(e.errno)",
    "import socket\ntry:\n    socket.socket()\nexcept OSError as e:\n    print(e.errno)",
    "for p in ('/dev/x', '/dev/shm/x'):\n    try:\n        open(p, 'w').write('x')\n        print('written')\n    except OSError as e:\n        print(e.errno)",
    "import os; print(os.listdir('/dev/shm'), 'x' in os.listdir('/dev'))",
    "import ctypes; libc = ctypes.CDLL(None, use_errno=True); print(libc.shmget(0, 4096, 0o1600), ctypes.get_errno())",
]
for code in codes:
    r = sb.run_blocking(Job(code=code, limits=Limits(max_processes=8)))
    print(r.status.value, r.stdout.decode().strip().replace(chr(10), ' '))
sb.close_blocking()
"""


def _system_python_ok() -> bool:
    if not os.path.exists(SYSTEM_PYTHON):
        return False
    out = subprocess.run(
        [SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info >= (3, 11))"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() == "True"


@pytest.mark.skipif(
    os.geteuid() != 0
    or shutil.which("setpriv") is None
    or shutil.which("bwrap") is None
    or not _system_python_ok(),
    reason="needs root (to become uid 65534), setpriv, bwrap and a system python >= 3.11",
)
def test_unprivileged_user_gets_the_same_jail(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(SRC)}
    os.chmod(tmp_path, 0o777)
    out = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", SYSTEM_PYTHON, "-c", SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "True True None False",  # namespaces + seccomp; cgroups not writable; no uid drop needed
        "ok 65534 False False",
        "ok stopped 7 11",  # RLIMIT_NPROC: the job + 7 children = max_processes
        "ok 1 1 1",  # EPERM for the worker, everyone (-1) and the jail's init
        "ok 1",
        "ok 30 written",  # /dev is read-only (in a user namespace bwrap's /dev would be ours to write)
        "ok [] False",  # /dev/shm was emptied after the job; nothing was planted in /dev
        "ok -1 38",  # SysV IPC: ENOSYS
    ]
