"""Every `posttrain bench NAME` benchmark, one module each, and the curriculum simulator they share.

`sandbox`, `engine`, `learner`, `rl` and `curriculum` (with `curriculum_real`, the real-model run) each
expose `main(...) -> dict` of named figures; `sim`, `planning` and `plot` are the simulated learner,
its planning oracles and the share plot. The top layer: it imports anything, and no product package
imports it.
"""


class BenchUsageError(ValueError):
    """A bad combination of a benchmark's options; the CLI prints it and exits 2."""
