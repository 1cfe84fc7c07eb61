"""Isolated execution of untrusted code: the contract (`api`), warm jailed worker pools (`pool`),
isolation layers (`isolation`, `jailed/`), graders (`grading`) and an HTTP service (`remote`).
Must not import torch.
"""

from __future__ import annotations

from typing import Any

from posttrain.sandbox.api import ExecResult, ExecStatus, Job, Limits, Sandbox, run_sync, validate_job
from posttrain.sandbox.isolation import SandboxUnavailable
from posttrain.sandbox.pool import LocalSandbox


def limits_from_config(cfg: Any) -> Limits:
    """Default job limits from a `SandboxConfig` (wall and CPU time from wall_time_s, memory_mb)."""
    return Limits(wall_time_s=cfg.wall_time_s, cpu_time_s=cfg.wall_time_s, memory_bytes=cfg.memory_mb << 20)


def make_sandbox(cfg: Any = None) -> Sandbox:
    """The sandbox a run config asks for: `LocalSandbox` (mode local) or `RemoteSandbox` (mode remote)."""
    from posttrain.config import SandboxConfig

    cfg = cfg if cfg is not None else SandboxConfig()
    if cfg.mode == "remote":
        from posttrain.sandbox.remote import RemoteSandbox

        if not cfg.url:
            raise ValueError("sandbox.mode is 'remote' but sandbox.url is not set")
        return RemoteSandbox(cfg.url, cfg.token)
    return LocalSandbox(cfg)


__all__ = [
    "ExecResult", "ExecStatus", "Job", "Limits", "LocalSandbox", "Sandbox", "SandboxUnavailable",
    "limits_from_config", "make_sandbox", "run_sync", "validate_job",
]
