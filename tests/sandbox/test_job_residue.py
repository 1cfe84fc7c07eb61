"""Nothing one job leaves behind reaches the next job served by the same warm worker: no SysV IPC or
POSIX message queue (denied), no /dev or /dev/shm file, no fd into the worker to fake a status, and
no leftover memory that would get an innocent later job killed."""

import pytest

from posttrain.sandbox import ExecStatus, Job, Limits, LocalSandbox

ENOSYS, EROFS, EBADF = 38, 30, 9


@pytest.fixture(scope="module")
def jail():
    sb = LocalSandbox(pool_size=1)
    if not sb.isolation.isolated or not sb.isolation.seccomp:
        pytest.skip(f"isolation layers missing: {sb.isolation.missing}")
    yield sb
    sb.close_blocking()


def run(sb, code, **limits):
    res = sb.run_blocking(Job(code=code, limits=Limits(**limits)))
    assert res.status != ExecStatus.SANDBOX_ERROR, res
    return res


def worker_pid(sb):
    return int(run(sb, "import os; print(os.getppid())").stdout)


SYSV = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
rt = ctypes.CDLL("librt.so.1", use_errno=True)
IPC_PRIVATE, IPC_CREAT = 0, 0o1000
def call(name, *args):
    ctypes.set_errno(0)
    got = getattr(libc if hasattr(libc, name) else rt, name)(*args)
    print(name, got, ctypes.get_errno())
call("shmget", IPC_PRIVATE, 1 << 20, IPC_CREAT | 0o600)
call("shmget", 0x5EED, 1 << 20, IPC_CREAT | 0o666)
call("shmat", 0, None, 0)
call("shmctl", 0, 0, None)
call("msgget", 0x5EED, IPC_CREAT | 0o666)
call("msgsnd", 0, b"xxxxxxxxhello", 5, 0)
call("semget", 0x5EED, 1, IPC_CREAT | 0o666)
call("semctl", 0, 0, 0)
call("mq_open", b"/leak", os.O_CREAT | os.O_RDWR, 0o600, None)
"""


def test_sysv_ipc_and_message_queues_are_denied(jail):
    res = run(jail, SYSV)
    lines = res.stdout.decode().splitlines()
    assert lines == [
        f"{name} -1 {ENOSYS}"
        for name in ("shmget", "shmget", "shmat", "shmctl", "msgget", "msgsnd", "semget", "semctl", "mq_open")
    ]
    # /proc/sysvipc shows the jail's IPC namespace: nothing was created there, for this job or the next
    after = run(
        jail, "print(sum(len(open(f'/proc/sysvipc/{k}').readlines()) - 1 for k in ('shm', 'msg', 'sem')))"
    )
    assert after.stdout == b"0\n"


POSIX_SHM_LEAVE = """
import _posixshmem, mmap, os
fd = _posixshmem.shm_open("/leak", os.O_CREAT | os.O_RDWR, 0o666)
os.ftruncate(fd, 1 << 20)
mmap.mmap(fd, 1 << 20)[:6] = b"secret"
open("/dev/shm/plain-file", "w").write("secret")
print(sorted(os.listdir("/dev/shm")))
"""
POSIX_SHM_LOOK = """
import _posixshmem, os
print(os.listdir("/dev/shm"))
try:
    _posixshmem.shm_open("/leak", os.O_RDWR, 0)
    print("found")
except FileNotFoundError:
    print("gone")
"""


def test_posix_shm_works_within_a_job_and_is_gone_for_the_next(jail):
    before = worker_pid(jail)
    assert run(jail, POSIX_SHM_LEAVE).stdout == b"['leak', 'plain-file']\n"
    assert run(jail, POSIX_SHM_LOOK).stdout == b"[]\ngone\n"
    assert worker_pid(jail) == before  # wiped by the same worker, not hidden by a recycle


DEV_WRITE = """
import os
for p in ("/dev/planted", "/dev/null.d", "/dev/pts/planted"):
    try:
        open(p, "w").write("x")
        print(p, "written")
    except OSError as e:
        print(p, e.errno)
os.makedirs("/dev/shm/d/e")
open("/dev/shm/d/e/f", "w").write("x")
os.chmod("/dev/shm/d", 0)  # a dir the job locked: the wipe must still get through
print(sorted(os.listdir("/dev")))
"""


def test_dev_is_read_only_and_dev_shm_is_emptied(jail):
    before = worker_pid(jail)
    res = run(jail, DEV_WRITE)
    lines = res.stdout.decode().splitlines()
    # read-only /dev (EROFS); /dev/pts is devpts, where nothing but ptmx creates entries
    assert lines[:2] == [f"/dev/planted {EROFS}", f"/dev/null.d {EROFS}"]
    assert lines[2].startswith("/dev/pts/planted ") and "written" not in lines[2]
    listing = lines[3]
    assert "planted" not in listing
    again = run(jail, "import os; print(sorted(os.listdir('/dev'))); print(os.listdir('/dev/shm'))")
    assert again.stdout.decode().splitlines() == [listing, "[]"]
    assert worker_pid(jail) == before


def test_dev_shm_is_capped_like_the_job_disk(jail):
    code = """
n = 0
try:
    with open("/dev/shm/fill", "wb") as fh:
        while True:
            fh.write(b"x" * (1 << 20))
            fh.flush()
            n += 1
except OSError as e:
    print(e.errno, n <= 64)
"""
    assert run(jail, code, max_file_bytes=1 << 30).stdout == b"28 True\n"  # ENOSPC within job_disk_mb
    assert run(jail, "import os; print(os.listdir('/dev/shm'))").stdout == b"[]\n"


FDS = """
import os
mine = sorted(int(f) for f in os.listdir("/proc/self/fd"))
probe = mine[-1]  # the listdir fd itself, closed again by now
print(mine[:-1], probe)
for fd in range(3, 256):
    try:
        os.write(fd, b"M" * 16)
        print("wrote", fd)
    except OSError as e:
        assert e.errno == EBADF_, e
print("done")
""".replace("EBADF_", str(EBADF))


def test_python_job_has_only_stdio_and_cannot_fake_a_memory_status(jail):
    res = run(jail, FDS)
    assert res.stdout == b"[0, 1, 2] 3\ndone\n"
    assert res.status == ExecStatus.OK  # the old status pipe on fd 3 turned this into memory_exceeded


def test_exec_job_has_only_stdio(jail):
    res = jail.run_blocking(Job(code="ls /proc/self/fd", language="bash"))
    assert res.stdout == b"0\n1\n2\n3\n"  # 3: the directory ls is reading


def test_memory_error_is_still_reported(jail):
    res = run(jail, "x = bytearray(1 << 30)", memory_bytes=128 << 20)
    assert res.status == ExecStatus.MEMORY_EXCEEDED and res.stderr.endswith(b"MemoryError\n")
    printed = run(jail, "import sys\nprint('MemoryError', file=sys.stderr)")  # exit 0: not a MemoryError
    assert printed.status == ExecStatus.OK


HOARD = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmget.restype = ctypes.c_int
libc.shmat.restype = ctypes.c_void_p
size = 512 << 20
shmid = libc.shmget(0, ctypes.c_size_t(size), 0o1000 | 0o600)
if shmid >= 0:
    addr = libc.shmat(shmid, None, 0)
    ctypes.memset(addr, 1, size)
    print("sysv kept")
else:
    print("sysv", ctypes.get_errno())
try:
    with open("/dev/shm/hoard", "wb") as fh:
        for _ in range(512):
            fh.write(b"x" * (1 << 20))
    print("posix kept")
except OSError as e:
    print("posix", e.errno)
fd = os.memfd_create("hoard")
chunk = b"x" * (1 << 20)
for _ in range(512):
    os.write(fd, chunk)
if os.fork() == 0:  # a daemon holding the memfd open past the job
    os.setsid()
    import time
    time.sleep(60)
print("memfd held", flush=True)
"""


def test_four_hoarders_do_not_get_an_innocent_job_killed():
    """Each hoarder tries to leave 512 MiB behind (SysV shm, a /dev/shm file, a memfd held by a daemon)
    in a worker whose cgroup backstop is 1 GiB; the fifth, innocent job needs 400 MiB and must pass."""
    with LocalSandbox(pool_size=1, memory_backstop_mb=1024) as sb:
        if not sb.isolation.isolated or not sb.isolation.seccomp:
            pytest.skip(f"isolation layers missing: {sb.isolation.missing}")
        before = worker_pid(sb)
        for _ in range(4):
            res = sb.run_blocking(
                Job(
                    code=HOARD,
                    limits=Limits(
                        memory_bytes=1200 << 20, max_file_bytes=1 << 30, wall_time_s=20, cpu_time_s=20
                    ),
                )
            )
            assert res.stdout == f"sysv {ENOSYS}\nposix 28\nmemfd held\n".encode(), res
        innocent = sb.run_blocking(
            Job(
                code="b = bytearray(400 << 20)\nb[::4096] = b'y' * len(b[::4096])\nprint('fine')",
                limits=Limits(memory_bytes=600 << 20),
            )
        )
        assert (innocent.status, innocent.stdout) == (ExecStatus.OK, b"fine\n"), innocent
        assert worker_pid(sb) == before and sb.stats["recycles"] == 0
