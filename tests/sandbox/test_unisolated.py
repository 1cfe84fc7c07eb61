"""Without namespaces the sandbox refuses to start unless allow_unisolated; with it, jobs still run
under rlimits + seccomp and the temp job dir is cleaned up."""

import glob
import os
import tempfile

import pytest

from posttrain.sandbox import ExecStatus, Job, Limits, LocalSandbox, SandboxUnavailable
from posttrain.sandbox import isolation as iso_mod


def job_dirs() -> str:
    """The glob of the sandbox's job folders: under this process's TMPDIR (per test worker)."""
    return os.path.join(tempfile.gettempdir(), "posttrain-sbx-*")


@pytest.fixture
def no_namespaces(monkeypatch):
    fake = iso_mod.Isolation(
        bwrap=None,
        namespaces=False,
        seccomp=True,
        cgroups=None,
        details={"namespaces": "bubblewrap (bwrap) is not installed"},
    )
    monkeypatch.setattr(iso_mod, "detect", lambda: fake)
    return fake


def test_refuses_without_isolation(no_namespaces):
    with pytest.raises(
        SandboxUnavailable,
        match="refusing to run untrusted code without isolation.*"
        "bwrap\\) is not installed.*allow_unisolated=true",
    ):
        LocalSandbox()


def test_allow_unisolated_runs_with_seccomp_and_rlimits(no_namespaces):
    before = set(glob.glob(job_dirs()))
    with LocalSandbox(pool_size=1, allow_unisolated=True) as sb:
        assert "namespaces" not in " ".join(sb.layers) and "seccomp" in sb.layers
        res = sb.run_blocking(
            Job(
                code=f"import os, socket\nprint(os.getcwd().startswith({job_dirs()[:-1]!r}))\n"
                "try:\n    socket.socket()\nexcept OSError as e:\n    print(e.errno)"
            )
        )
        assert (res.status, res.stdout) == (ExecStatus.OK, b"True\n1\n")
        mem = sb.run_blocking(Job(code="x = bytearray(1 << 30)", limits=Limits(memory_bytes=128 << 20)))
        assert mem.status == ExecStatus.MEMORY_EXCEEDED
    assert set(glob.glob(job_dirs())) == before
