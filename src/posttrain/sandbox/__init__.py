"""Isolated execution of untrusted code: the contract (`api`), warm jailed worker pools (`pool`),
isolation layers (`isolation`, `jailed/`), graders (`grading`), an HTTP service and its client (`remote`),
a client over several services (`fleet`) and warm pools inside Ray actors (`ray_pool`).
Must not import torch.
"""

from __future__ import annotations

from typing import Any

from posttrain.sandbox.api import ExecResult, ExecStatus, Job, Limits, Sandbox, run_sync, validate_job
from posttrain.sandbox.configured import ConfiguredSandbox
from posttrain.sandbox.isolation import SandboxUnavailable
from posttrain.sandbox.pool import LocalSandbox


def make_sandbox(cfg: Any = None, ray_address: str | None = None) -> ConfiguredSandbox:
    """The sandbox a run config asks for: `LocalSandbox` (mode local), in mode remote `RemoteSandbox`
    (one URL) or `SandboxFleet` (several, comma-separated), in mode ray `RaySandboxPool` (in the Ray
    cluster this process is connected to, else the one at `ray_address`, else a local one),
    wrapped so that every job gets the config's wall-time ceiling and memory limit."""
    from posttrain.config import SandboxConfig

    cfg = cfg if cfg is not None else SandboxConfig()
    if cfg.mode == "ray":
        from posttrain.sandbox.ray_pool import RaySandboxPool

        return ConfiguredSandbox(RaySandboxPool(cfg, ray_address=ray_address), cfg)
    if cfg.mode == "remote":
        from posttrain.sandbox.fleet import SandboxFleet, parse_urls
        from posttrain.sandbox.remote import RemoteSandbox

        if not cfg.url:
            raise ValueError("sandbox.mode is 'remote' but sandbox.url is not set")
        try:
            urls = parse_urls(cfg.url)
        except ValueError as err:
            raise ValueError(f"sandbox.url: {err}") from None
        if len(urls) > 1:
            return ConfiguredSandbox(SandboxFleet(urls, cfg.token, timeout_s=cfg.remote_timeout_s), cfg)
        return ConfiguredSandbox(RemoteSandbox(urls[0], cfg.token, timeout_s=cfg.remote_timeout_s), cfg)
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
