"""Isolated execution of untrusted code: the contract (`api`), warm jailed worker pools (`pool`),
isolation layers (`isolation`, `jailed/`), graders (`grading`) and an HTTP service (`remote`).
Must not import torch.
"""

from __future__ import annotations

from typing import Any

from posttrain.sandbox.api import ExecResult, ExecStatus, Job, Limits, Sandbox, run_sync, validate_job
from posttrain.sandbox.configured import ConfiguredSandbox
from posttrain.sandbox.isolation import SandboxUnavailable
from posttrain.sandbox.pool import LocalSandbox


def make_sandbox(cfg: Any = None) -> ConfiguredSandbox:
    """The sandbox a run config asks for: `LocalSandbox` (mode local) or `RemoteSandbox` (mode remote),
    wrapped so that every job gets the config's wall-time ceiling and memory limit."""
    from posttrain.config import SandboxConfig

    cfg = cfg if cfg is not None else SandboxConfig()
    if cfg.mode == "remote":
        from posttrain.sandbox.remote import RemoteSandbox

        if not cfg.url:
            raise ValueError("sandbox.mode is 'remote' but sandbox.url is not set")
        return ConfiguredSandbox(RemoteSandbox(cfg.url, cfg.token, timeout_s=cfg.remote_timeout_s), cfg)
    return ConfiguredSandbox(LocalSandbox(cfg), cfg)


__all__ = [
    "ConfiguredSandbox",
    "ExecResult",
    "ExecStatus",
    "Job",
    "Limits",
    "LocalSandbox",
    "Sandbox",
    "SandboxUnavailable",
    "make_sandbox",
    "run_sync",
    "validate_job",
]
