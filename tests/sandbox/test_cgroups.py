"""cgroup backstops: the v2 path and limit logic against a fake cgroupfs that keeps the kernel's rules
(no internal processes, controllers only from the parent), the real v2 hierarchy where this host has
one, and the pids cap of whichever version is in use."""

import errno
import os
import subprocess
import time
from pathlib import Path

import pytest

from posttrain.sandbox import ExecStatus, Job, Limits, LocalSandbox
from posttrain.sandbox import isolation as iso_mod


class FakeCgroupFs:
    """A directory tree that answers writes the way cgroup2 does, for the rules the code relies on."""

    def __init__(self, root: Path, controllers: str, procs: str) -> None:
        self.root = root
        for name, text in (
            ("cgroup.controllers", controllers),
            ("cgroup.subtree_control", ""),
            ("cgroup.procs", procs),
        ):
            (root / name).write_text(text)

    def mkdir(self, path: Path) -> None:
        if path.exists():
            return
        path.mkdir()
        available = (path.parent / "cgroup.subtree_control").read_text().split()
        files = {
            "cgroup.controllers": " ".join(available),
            "cgroup.subtree_control": "",
            "cgroup.procs": "",
            "cgroup.kill": "",
        }
        if "memory" in available:
            files.update({"memory.max": "max", "memory.events": "oom 0\noom_kill 0\n"})
            if self.swap:
                files["memory.swap.max"] = "max"
        if "pids" in available:
            files["pids.max"] = "max"
        for name, text in files.items():
            (path / name).write_text(text)

    swap = True

    def write(self, path: Path, text: str) -> None:
        group = path.parent
        if not path.exists():
            raise FileNotFoundError(errno.ENOENT, "no such cgroup file", str(path))
        if path.name == "cgroup.subtree_control":
            if (group / "cgroup.procs").read_text().split():  # the tree's root stands for a delegated group
                raise OSError(errno.EBUSY, "Device or resource busy")  # no internal processes
            available = (group / "cgroup.controllers").read_text().split()
            enabled = set(path.read_text().split())
            for word in text.split():
                if word[1:] not in available:
                    raise OSError(errno.ENOENT, "controller not available")
                enabled.add(word[1:])
            path.write_text(" ".join(sorted(enabled)))
        elif path.name == "cgroup.procs":
            if (group / "cgroup.subtree_control").read_text().split():
                raise OSError(errno.EBUSY, "Device or resource busy")
            for other in self.root.rglob("cgroup.procs"):
                other.write_text(" ".join(p for p in other.read_text().split() if p != text.strip()))
            path.write_text(" ".join([*path.read_text().split(), text.strip()]))
        else:
            path.write_text(text)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    def make(controllers="cpu io memory pids", procs="4242"):
        fs = FakeCgroupFs(tmp_path, controllers, procs)
        monkeypatch.setattr(iso_mod, "_cg_write", fs.write)
        monkeypatch.setattr(iso_mod, "_cg_mkdir", fs.mkdir)
        return fs

    return make


def test_v2_refuses_a_subtree_without_the_memory_controller(fake):
    fs = fake(controllers="cpu pids")
    assert iso_mod.probe_cgroup_v2(fs.root, 4242) == (
        f"cgroup v2 at {fs.root}: the memory controller is not delegated here (cgroup.controllers: cpu pids)"
    )


def test_v2_refuses_a_group_shared_with_other_processes(fake):
    fs = fake(procs="17 4242 99")
    why = iso_mod.probe_cgroup_v2(fs.root, 4242)
    assert why is not None and "holds 2 other process(es)" in why and "Delegate=yes" in why


def test_v2_setup_moves_us_into_a_leaf_then_limits_each_worker(fake, tmp_path):
    fs = fake(procs="4242")
    assert iso_mod.probe_cgroup_v2(fs.root, 4242) is None
    parent = iso_mod.ensure_cgroup_v2_parent(fs.root, 4242)
    assert parent == fs.root / "posttrain-sandbox-4242"
    assert (fs.root / "cgroup.procs").read_text() == ""  # we left the group so it may delegate
    assert (fs.root / "posttrain-main-4242" / "cgroup.procs").read_text() == "4242"
    assert (fs.root / "cgroup.subtree_control").read_text() == "memory pids"
    assert (parent / "cgroup.subtree_control").read_text() == "memory pids"
    slot = iso_mod.CgroupV2Slot(parent, "i0-default-nonet-0", iso_mod.cgroup_v2_limits(256 << 20, 64))
    assert [(slot.dir / f).read_text() for f in ("memory.max", "memory.swap.max", "pids.max")] == [
        str(256 << 20),
        "0",
        "64",
    ]
    assert slot.procs_files == [str(slot.dir / "cgroup.procs")] and slot.oom_kills() == 0
    (slot.dir / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 2\noom_kill 2\noom_group_kill 0\n")
    assert slot.oom_kills() == 2
    # a second setup (another LocalSandbox, or this process once moved) is a no-op that finds the same parent
    assert iso_mod.ensure_cgroup_v2_parent(fs.root, 4242) == parent
    # our /proc/self/cgroup now names the leaf: the base is still the delegated group above it
    proc_cgroup = tmp_path / "proc-cgroup"
    proc_cgroup.write_text("0::/posttrain-main-4242\n")
    assert iso_mod.cgroup_v2_base(fs.root, str(proc_cgroup)) == fs.root


def test_v2_without_swap_accounting_still_sets_memory_and_pids(fake):
    fs = fake()
    fs.swap = False
    parent = iso_mod.ensure_cgroup_v2_parent(fs.root, 4242)
    slot = iso_mod.CgroupV2Slot(parent, "w", iso_mod.cgroup_v2_limits(1 << 30, 32))
    assert not (slot.dir / "memory.swap.max").exists() and (slot.dir / "memory.max").read_text() == str(
        1 << 30
    )
    fs.mkdir(parent / "nomem")
    (parent / "nomem" / "memory.max").unlink()  # a missing memory.max is an error, never skipped
    with pytest.raises(OSError):
        iso_mod.CgroupV2Slot(parent, "nomem", iso_mod.cgroup_v2_limits(1 << 30, 32))


def test_sweep_removes_only_groups_of_dead_processes(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    for d in (
        f"posttrain-sandbox-{dead.pid}/i0-default-nonet-0",
        f"posttrain-main-{dead.pid}",
        f"posttrain-sandbox-{os.getpid()}/i0-default-nonet-0",
        "unrelated-group",
    ):
        (tmp_path / d).mkdir(parents=True)
    iso_mod.sweep_stale_cgroups("v2", v2_base=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"posttrain-sandbox-{os.getpid()}",
        "unrelated-group",
    ]


def test_cgroup2_mount_from_mountinfo(tmp_path):
    hybrid = tmp_path / "hybrid"
    hybrid.write_text(
        "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
        "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
    )
    pure = tmp_path / "pure"
    pure.write_text(
        "29 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw\n"
    )
    assert iso_mod.cgroup2_mount(str(hybrid)) == Path("/sys/fs/cgroup/unified")
    assert iso_mod.cgroup2_mount(str(pure)) == Path("/sys/fs/cgroup")
    assert iso_mod.cgroup2_mount(str(tmp_path / "absent")) is None


def _real_v2_base() -> Path | None:
    base = iso_mod.cgroup_v2_base()
    if base is None or os.geteuid() != 0 or not os.access(base / "cgroup.procs", os.W_OK):
        return None
    return base


@pytest.mark.skipif(_real_v2_base() is None, reason="no writable cgroup v2 hierarchy here")
def test_real_v2_group_holds_the_worker_then_is_killed_and_removed():
    """On the real hierarchy (controllers or not): a process joins the slot group the way the pool's
    workers do, the group kills it, and removal leaves nothing behind."""
    base = _real_v2_base()
    parent = base / f"posttrain-test-{os.getpid()}"
    parent.mkdir()
    slot = iso_mod.CgroupV2Slot(parent, "slot", {})
    try:
        proc = subprocess.Popen(["/bin/sh", "-c", 'echo $$ >"$0" && exec sleep 60', slot.procs_files[0]])
        deadline = time.monotonic() + 10
        while (
            str(proc.pid) not in Path(slot.procs_files[0]).read_text().split() and time.monotonic() < deadline
        ):
            time.sleep(0.01)
        line = next(
            ln for ln in Path(f"/proc/{proc.pid}/cgroup").read_text().splitlines() if ln.startswith("0::")
        )
        assert line.endswith(f"/posttrain-test-{os.getpid()}/slot")
        assert slot.kill_all(timeout_s=5)
        assert proc.wait(timeout=5) == -9
    finally:
        slot.remove()
    assert not parent.exists()


def test_pids_backstop_caps_a_job_that_rlimits_would_let_through():
    """max_processes 200 lets RLIMIT_NPROC through; the worker group's pids cap (24) stops the job first."""
    code = """
import os, time
n = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError as e:
    print(e.errno, n)
"""
    with LocalSandbox(pool_size=1, max_pids=24) as sb:
        if sb.isolation.cgroups is None or not sb.isolation.isolated:
            pytest.skip(f"no cgroup backstop here: {sb.isolation.details.get('cgroups')}")
        res = sb.run_blocking(Job(code=code, limits=Limits(max_processes=200, wall_time_s=10)))
        err, n = res.stdout.split()
        assert res.status == ExecStatus.OK and int(err) == errno.EAGAIN and 16 <= int(n) < 24, res
        after = sb.run_blocking(
            Job(code="import os; print(len([p for p in os.listdir('/proc') if p.isdigit()]))")
        )
        assert after.stdout == b"3\n"  # the sleepers were reaped and the next job forks freely again
