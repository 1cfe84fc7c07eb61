"""The RL loop (sync or async with bounded staleness), checkpoint/resume of a whole run, held-out
evaluation with bootstrap intervals, and export. Implements no math the other layers own."""

from posttrain.orchestrator.checkpoint import (
    CheckpointError,
    latest_valid,
    list_checkpoints,
    save_checkpoint,
    verify,
)
from posttrain.orchestrator.loop import RLRun

__all__ = ["CheckpointError", "RLRun", "latest_valid", "list_checkpoints", "save_checkpoint", "verify"]
