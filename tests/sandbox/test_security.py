"""Each attack runs for real inside the jail and must end with the exact outcome asserted; after
each, the same one-worker pool must still serve the next job correctly."""

import os
import socket

import pytest

from posttrain.sandbox import ExecStatus, Job, Limits, LocalSandbox

SECRET_NAME, SECRET_VALUE = "POSTTRAIN_FAKE_SECRET", "s3cr3t-token-from-the-test-process"
EPERM, ENOENT, EROFS, ENOSPC, EFBIG, EAGAIN, EACCES = 1, 2, 30, 28, 27, 11, 13


@pytest.fixture(scope="module")
def jail():
    os.environ[SECRET_NAME] = SECRET_VALUE  # set before any worker starts: it must not leak in
    sb = LocalSandbox(pool_size=1)
    if not sb.isolation.isolated or not sb.isolation.seccomp:
        pytest.skip(f"isolation layers missing: {sb.isolation.missing}")
    yield sb
    sb.close_blocking()
    del os.environ[SECRET_NAME]


def run(sb, code, **limits):
    return sb.run_blocking(Job(code=code, limits=Limits(**limits)))


def worker_pid(sb):
    res = run(sb, "import os; print(os.getppid())")
    assert res.status == ExecStatus.OK
    return int(res.stdout)


def assert_serves_next(sb):
    res = run(sb, "import os\nprint(sum(range(10)), sorted(os.listdir('.')))")
    assert res.status == ExecStatus.OK and res.stdout == b"45 ['.tmp', 'solution.py']\n", res


CONNECT = """
import socket
try:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(1)
    s.connect(({host!r}, {port}))
    print("connected")
except OSError as e:
    print("blocked", e.errno)
"""


def test_network_connect_to_localhost_is_blocked(jail):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    try:
        res = run(jail, CONNECT.format(host="127.0.0.1", port=listener.getsockname()[1]))
        assert res.stdout == f"blocked {EPERM}\n".encode()
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever reached the host's listener
    finally:
        listener.close()
    assert_serves_next(jail)


def test_network_connect_outside_is_blocked(jail):
    assert run(jail, CONNECT.format(host="1.1.1.1", port=53)).stdout == f"blocked {EPERM}\n".encode()
    assert_serves_next(jail)


def test_dns_fails(jail):
    code = "import socket\ntry:\n    socket.getaddrinfo('example.com', 80)\nexcept OSError as e:\n    print(type(e).__name__)"
    assert run(jail, code).stdout == b"gaierror\n"
    assert_serves_next(jail)


@pytest.mark.parametrize(
    "path",
    ["/work/main/pyproject.toml", "/work", "/root", "/root/.bashrc", "/etc/shadow", "/etc/passwd", "/home"],
)
def test_host_files_are_invisible(jail, path):
    assert os.path.exists(path) or path in ("/root/.bashrc", "/home")  # the attack targets real host files
    code = f"import os\ntry:\n    print(os.listdir({path!r}) if os.path.isdir({path!r}) else open({path!r}).read())\nexcept OSError as e:\n    print('denied', e.errno)"
    assert run(jail, code).stdout == f"denied {ENOENT}\n".encode()
    assert_serves_next(jail)


def test_parent_environment_does_not_leak(jail):
    code = f"""
import os
seen = [k for k in os.environ if {SECRET_VALUE!r} in os.environ[k]]
for pid in os.listdir('/proc'):
    try:
        if {SECRET_VALUE!r}.encode() in open(f'/proc/{{pid}}/environ', 'rb').read():
            seen.append(pid)
    except OSError:
        pass
print(sorted(os.environ), seen)
"""
    res = run(jail, code)
    assert SECRET_VALUE not in res.stdout_text
    assert res.stdout == (
        b"['HOME', 'LANG', 'LC_ALL', 'OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'PATH', "
        b"'PYTHONHASHSEED', 'PYTHONIOENCODING', 'TMPDIR'] []\n"
    )
    assert_serves_next(jail)


def test_writes_outside_the_job_dir_fail(jail):
    code = """
import os
for p in ["/x", "/usr/x", "/etc/x", "/opt/ptsb/jailed/worker.py", "/bin/sh"]:
    try:
        open(p, "a").write("a")
        print(p, "written")
    except OSError as e:
        print(p, e.errno)
"""
    # new files: read-only mounts (EROFS); existing root-owned files: the jail uid may not write (EACCES)
    expected = (
        f"/x {EROFS}\n/usr/x {EROFS}\n/etc/x {EROFS}\n/opt/ptsb/jailed/worker.py {EACCES}\n/bin/sh {EACCES}\n"
    )
    assert run(jail, code).stdout == expected.encode()
    assert (
        run(jail, "open('/tmp/left', 'w').write('x'); open('left2', 'w').write('y')").status == ExecStatus.OK
    )
    assert_serves_next(jail)  # nothing the previous job wrote is left


def test_fork_bomb_is_capped_at_max_processes(jail):
    counting = """
import os, time
n = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        n += 1
except OSError as e:
    print("stopped", n, e.errno)
"""
    res = run(jail, counting, max_processes=8)
    assert res.stdout == f"stopped 7 {EAGAIN}\n".encode()  # 7 children + the job itself = 8
    res = run(jail, "import os\nwhile True:\n    os.fork()", max_processes=8, wall_time_s=2)
    assert res.status == ExecStatus.RUNTIME_ERROR and b"BlockingIOError" in res.stderr
    leftover = run(jail, "import os; print(len([p for p in os.listdir('/proc') if p.isdigit()]))")
    assert leftover.stdout == b"3\n"  # the jail's init, the worker, this job: all sleepers are gone
    assert_serves_next(jail)


@pytest.mark.parametrize(
    "bomb", ["x = bytearray(2 << 30)", "a = []\nwhile True:\n    a.append(b'x' * 10**6)"]
)
def test_memory_bomb(jail, bomb):
    res = run(jail, bomb, memory_bytes=256 << 20)
    assert res.status == ExecStatus.MEMORY_EXCEEDED and res.max_rss_bytes < 400 << 20
    assert_serves_next(jail)


def test_infinite_loop(jail):
    res = run(jail, "while True:\n    pass", wall_time_s=0.5, cpu_time_s=10)
    assert res.status == ExecStatus.TIMEOUT and res.signal == 9 and 450 < res.wall_ms < 2000
    assert_serves_next(jail)


def test_cpu_busy_threads_hit_the_cpu_limit(jail):
    code = "import threading\ndef spin():\n    while True:\n        pass\nfor _ in range(4):\n    threading.Thread(target=spin).start()\nspin()"
    res = run(jail, code, cpu_time_s=1, wall_time_s=10)
    assert (
        res.status == ExecStatus.TIMEOUT and res.signal == 24 and res.cpu_ms >= 900
    )  # SIGXCPU at 1 s of CPU
    assert_serves_next(jail)


def test_output_flood_is_capped(jail):
    res = run(jail, "while True:\n    print('x' * 1000)", max_output_bytes=64 * 1024)
    assert res.status == ExecStatus.OUTPUT_TRUNCATED and res.stdout_truncated
    assert len(res.stdout) == 64 * 1024 and set(res.stdout) <= set(b"x\n")
    assert_serves_next(jail)


def test_double_fork_daemon_does_not_outlive_the_job(jail):
    code = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        while True:
            time.sleep(0.01)
    os._exit(0)
os.wait()
time.sleep(0.2)
print(len([p for p in os.listdir('/proc') if p.isdigit()]))
"""
    assert run(jail, code).stdout == b"4\n"  # init, worker, job, daemon were all alive during the job
    res = run(
        jail,
        "import os; print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()) == sorted({1, os.getppid(), os.getpid()}))",
    )
    assert res.stdout == b"True\n"
    assert_serves_next(jail)


def test_signals_to_the_worker_and_everyone_are_refused(jail):
    before = worker_pid(jail)
    code = """
import os, signal
for target in (os.getppid(), -os.getppid(), -1, 1):
    try:
        os.kill(target, signal.SIGKILL)
        print(target, "sent")
    except OSError as e:
        print("refused", e.errno)
"""
    assert run(jail, code).stdout == f"refused {EPERM}\n".encode() * 4
    assert worker_pid(jail) == before  # the same worker survived
    assert_serves_next(jail)


def test_killing_the_worker_via_proc_and_ptrace_fails(jail):
    before = worker_pid(jail)
    code = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
print("ptrace", libc.ptrace(16, os.getppid(), 0, 0), ctypes.get_errno())
try:
    open(f"/proc/{os.getppid()}/mem", "wb")
    print("mem opened")
except OSError as e:
    print("mem", e.errno)
"""
    assert run(jail, code).stdout == f"ptrace -1 {EPERM}\nmem 13\n".encode()
    assert worker_pid(jail) == before
    assert_serves_next(jail)


def test_filling_the_disk(jail):
    code = """
n = 0
try:
    while True:
        open(f"f{n}", "wb").write(b"x" * (4 << 20))
        n += 1
except OSError as e:
    print("full", e.errno)
"""
    assert run(jail, code, max_file_bytes=8 << 20).stdout == f"full {ENOSPC}\n".encode()
    again = "open('a', 'wb').write(b'x' * (6 << 20)); open('b', 'wb').write(b'x' * (6 << 20)); print('ok')"
    assert run(jail, again, max_file_bytes=8 << 20).stdout == b"ok\n"  # the space came back
    assert_serves_next(jail)


def test_huge_file_write(jail):
    code = "try:\n    open('big', 'wb').write(b'x' * (16 << 20))\nexcept OSError as e:\n    print('efbig', e.errno)"
    assert run(jail, code, max_file_bytes=8 << 20).stdout == f"efbig {EFBIG}\n".encode()
    res = jail.run_blocking(
        Job(
            code="head -c 20000000 /dev/zero > big; echo $?",
            language="bash",
            limits=Limits(max_file_bytes=8 << 20),
        )
    )
    assert res.stdout == b"1\n" and b"File too large" in res.stderr
    assert_serves_next(jail)


def test_closing_stdout_early(jail):
    code = "import os, sys, time\nprint('a', flush=True)\nos.close(1)\nsys.stderr.write('after\\n')\ntime.sleep(0.1)\nprint('lost')"
    res = run(jail, code)
    assert (res.status, res.stdout, res.stderr) == (ExecStatus.OK, b"a\n", b"after\n")
    assert_serves_next(jail)


def test_non_utf8_output_comes_back_byte_exact(jail):
    res = run(
        jail,
        "import sys\nsys.stdout.buffer.write(b'\\xff\\xfe\\x00\\x80ok')\nsys.stderr.buffer.write(b'\\xc3')",
    )
    assert (res.status, res.stdout, res.stderr) == (ExecStatus.OK, b"\xff\xfe\x00\x80ok", b"\xc3")
    assert res.stdout_text == "\ufffd\ufffd\x00\ufffdok"
    assert_serves_next(jail)


def test_sleeping_past_the_wall_limit(jail):
    res = run(jail, "import time\ntime.sleep(30)", wall_time_s=0.5, cpu_time_s=10)
    assert res.status == ExecStatus.TIMEOUT and 450 < res.wall_ms < 2000 and res.cpu_ms < 200
    assert_serves_next(jail)


@pytest.mark.parametrize(
    "language,code",
    [
        (
            "cpp",
            "#include <vector>\nint main(){std::vector<std::vector<char>> v; while(1) v.emplace_back(1<<24, 1);}",
        ),
        (
            "c",
            "#include <stdlib.h>\n#include <string.h>\nint main(){while(1){char*p=malloc(1<<24); memset(p,1,1<<24);}}",
        ),
    ],
)
def test_native_memory_bomb(jail, language, code):
    res = jail.run_blocking(Job(code=code, language=language, limits=Limits(memory_bytes=256 << 20)))
    assert res.status == ExecStatus.MEMORY_EXCEEDED and res.max_rss_bytes < 300 << 20
    assert_serves_next(jail)


def test_inode_flood_recycles_the_worker_instead_of_wiping(jail):
    before = jail.stats["recycles"]
    code = "import os\nfor i in range(20000):\n    os.close(os.open(f'f{i}', os.O_CREAT | os.O_WRONLY))\nprint('made')"
    assert run(jail, code, wall_time_s=20).stdout == b"made\n"
    assert jail.stats["recycles"] == before + 1  # the jail (and its tmpfs) was thrown away
    assert_serves_next(jail)


def test_memory_spread_over_processes_hits_the_cgroup_backstop():
    """Each process stays under RLIMIT_AS; together they exceed the worker's cgroup memory cap, the
    kernel OOM-kills the biggest (the job itself) and the pool reports MEMORY_EXCEEDED and recycles."""
    code = """
import os, time
for i in range(2):
    if os.fork() == 0:
        b = b'x' * (80 << 20)
        time.sleep(5)
        os._exit(0)
time.sleep(0.5)
a = b'x' * (250 << 20)
print('survived')
"""
    with LocalSandbox(pool_size=1, memory_backstop_mb=256) as sb:
        if sb.isolation.cgroups is None:
            pytest.skip("no writable cgroups here")
        res = sb.run_blocking(Job(code=code, limits=Limits(wall_time_s=10)))
        assert (res.status, res.signal, res.stdout) == (ExecStatus.MEMORY_EXCEEDED, 9, b"")
        assert sb.stats["recycles"] == 1
        assert_serves_next(sb)
