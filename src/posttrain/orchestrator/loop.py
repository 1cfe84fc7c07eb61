"""The RL loop's former home, kept so `posttrain.orchestrator.loop.RLRun` still imports. The loop now
lives in `run.py` (RLRun), `pipeline.py` (the async schedule), `tasks.py` (task cursors, dynamic
sampling), `state.py` (checkpoint/resume of a run), `probes.py`, `metrics.py` and `signals.py`."""

from posttrain.orchestrator.metrics import PhaseLog
from posttrain.orchestrator.run import RLRun
from posttrain.orchestrator.state import COUNTERS, LEARNER_DIR, RUN_STATE

__all__ = ["COUNTERS", "LEARNER_DIR", "RUN_STATE", "PhaseLog", "RLRun"]
