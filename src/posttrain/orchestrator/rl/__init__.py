"""The RL run: `run.py` RLRun (build, train, close; the step's parts) · `schedule.py` the sync and async
schedules, which drive a `StepWork` · `tasks.py` task cursors and dynamic sampling · `groups.py` a step's
groups into the Learner's samples · `state.py` RunState, what a run's checkpoint holds · `weight_sync.py`
and `placement.py` weights into engines, engines and learner ranks onto machines (`learner_group.py`) ·
`probes.py`, `drift.py`, `retention.py`, `replay.py` held-out probes and forgetting control ·
`metrics.py` a step's row."""

from posttrain.orchestrator.rl.run import RLRun

__all__ = ["RLRun"]
