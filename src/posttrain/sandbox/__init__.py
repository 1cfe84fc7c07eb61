"""Isolated execution of untrusted code: the contract (`api`), warm jailed worker pools, graders and
an HTTP service. Must not import torch."""

from posttrain.sandbox.api import ExecResult, ExecStatus, Job, Limits, Sandbox, run_sync

__all__ = ["ExecResult", "ExecStatus", "Job", "Limits", "Sandbox", "run_sync"]
