"""The RL loop (sync or async with bounded staleness), checkpoint/resume of a whole run, held-out
evaluation with bootstrap intervals, and export. Implements no math the other layers own.

`run.py` RLRun (build, train, close) · `pipeline.py` the async schedule · `tasks.py` task cursors and
dynamic sampling · `state.py` what a run's checkpoint holds · `probes.py` held-out probes ·
`metrics.py` a step's row · `signals.py` SIGINT/SIGTERM · `checkpoint.py` atomic checkpoint dirs."""

from posttrain.orchestrator.checkpoint import (
    CheckpointError,
    latest_valid,
    list_checkpoints,
    save_checkpoint,
    verify,
)
from posttrain.orchestrator.run import RLRun

__all__ = ["CheckpointError", "RLRun", "latest_valid", "list_checkpoints", "save_checkpoint", "verify"]
