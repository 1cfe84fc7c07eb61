"""Run directories, metric sinks (JSONL, TensorBoard) and the rich progress display.

Every long-running command writes into a `RunDir` and logs through a `MetricsLogger`; what the
metrics mean belongs to the layer that produced them.
"""

from posttrain.telemetry.logger import MetricsLogger, WandbSink, read_metrics
from posttrain.telemetry.progress import Progress
from posttrain.telemetry.rundir import RunDir

__all__ = ["MetricsLogger", "Progress", "RunDir", "WandbSink", "read_metrics"]
