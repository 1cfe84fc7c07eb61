"""Many jobs (with worker recycling) leave no zombie, no leaked fd or thread, no temp dir, no cgroup."""

import asyncio
import gc
import glob
import os
import tempfile
import threading

import pytest

from posttrain.sandbox import ExecStatus, Job, Limits, LocalSandbox
from posttrain.sandbox.isolation import sandbox_cgroup_dirs

CODES = [
    "print(1)",
    "raise ValueError('x')",
    "import os\nif os.fork() == 0:\n    os._exit(0)\nprint(2)",  # a child the job never waits for
    "open('f.txt', 'w').write('x' * 100)\nprint(3)",
]
EXPECTED = [ExecStatus.OK, ExecStatus.RUNTIME_ERROR, ExecStatus.OK, ExecStatus.OK]


def _zombie_children() -> list[int]:
    me, zombies = os.getpid(), []
    for stat_path in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat_path).read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == me:
            zombies.append(int(stat_path.split("/")[2]))
    return zombies


def _check_no_leaks(n_jobs: int) -> None:
    gc.collect()  # earlier tests' garbage (a Popen's pipes) must not close inside the measured span
    fds_before = len(os.listdir("/proc/self/fd"))
    threads_before = threading.active_count()
    tmp_before = set(glob.glob(os.path.join(tempfile.gettempdir(), "posttrain-sbx-*")))
    sb = LocalSandbox(pool_size=2, recycle_after=max(10, n_jobs // 10))
    try:
        jobs = [Job(code=CODES[i % len(CODES)], limits=Limits(wall_time_s=5)) for i in range(n_jobs)]

        async def go():
            return await sb.run_batch(jobs)

        results = asyncio.run(go())
        assert [r.status for r in results] == [EXPECTED[i % len(CODES)] for i in range(n_jobs)]
        assert results[3].files == {"f.txt": b"x" * 100}
        assert sb.stats["recycles"] >= n_jobs // max(10, n_jobs // 10) - 2
        last = sb.run_blocking(
            Job(
                code="import os\nprint(sorted(os.listdir('/job')), len([p for p in os.listdir('/proc') if p.isdigit()]))"
            )
        )
        assert last.stdout == b"['.tmp', 'solution.py'] 3\n"
        cgroup_dirs = sandbox_cgroup_dirs(sb.isolation.cgroups, sb.instance)
        # 2 slots, each with a memory and a pids group on v1 and one group on v2
        assert len(cgroup_dirs) == {"v1": 4, "v2": 2, None: 0}[sb.isolation.cgroups]
    finally:
        sb.close_blocking()
    assert _zombie_children() == []
    assert len(os.listdir("/proc/self/fd")) == fds_before
    assert threading.active_count() == threads_before
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "posttrain-sbx-*"))) == tmp_before
    assert all(not os.path.exists(d) for d in cgroup_dirs)


def test_1000_jobs_leave_nothing_behind():
    _check_no_leaks(1000)


@pytest.mark.slow
def test_10000_jobs_leave_nothing_behind():
    _check_no_leaks(10_000)
