"""The figures both experiment scripts print: tokens to threshold, forgetting and worst arm against uniform."""

from collections.abc import Sequence

import numpy as np

from posttrain.config import CurriculumConfig
from posttrain.bench.curriculum import _ratio, baseline, bootstrap_ci, run_metrics
from posttrain.bench.sim import SimSettings, run


def summarise(label: str, sampler: str, seeds: Sequence[int], verbose: bool = False) -> str:
    """Run `sampler` on each seed's simulated learner against uniform_by_domain; one line of figures."""
    cfg, s = CurriculumConfig(), SimSettings()
    rows = []
    for seed in seeds:
        budget, threshold, base_m, _ = baseline(seed, cfg, s)
        m = run_metrics(run(sampler, seed, cfg, s), budget, threshold)
        rows.append((_ratio(m, budget, base_m), m["forgetting"], base_m["forgetting"], m["worst_arm_accuracy"],
                     base_m["worst_arm_accuracy"]))
        if verbose:
            print(seed, [round(v, 4) for v in rows[-1]], flush=True)
    a = np.array(rows)
    ci, paired = bootstrap_ci(a[:, 0], 2000), bootstrap_ci(a[:, 1] - a[:, 2], 2000)
    first, last = min(seeds), max(seeds)
    return (f"{label}, seeds {first}-{last}: tokens to threshold {a[:, 0].mean():.3f} [{ci[0]:.3f}, {ci[1]:.3f}], "
            f"forgetting {a[:, 1].mean():.4f} (uniform {a[:, 2].mean():.4f}, paired [{paired[0]:+.4f}, "
            f"{paired[1]:+.4f}]), worst arm {a[:, 3].mean():.3f} (uniform {a[:, 4].mean():.3f})")
