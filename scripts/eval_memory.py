"""Peak memory of a held-out evaluation on the many-domain layout (`bench curriculum --real --layout many`):
the process's peak resident set, and the decode stages' peak bytes beside the K/V pool's and the real
(unpadded) staged K/V, read by a hook on `DecodeStager.plan`; and the tasks solved, so that settings can
be checked to give the same greedy outputs.

    python scripts/eval_memory.py [--model smollm2-135m] [--n 8] [--set engine.decode_staging=false ...]

`--n` is tasks per arm (25 arms). Used in docs/curriculum.md (memory of the 25-arm benchmark).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

from posttrain.bench.curriculum_real import PRESETS, base_eval, run_overrides
from posttrain.engine import decode_stage


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=8, help="held-out tasks per arm")
    ap.add_argument("--set", action="append", default=[], help="a config override, as --run-set takes")
    args = ap.parse_args()
    peak = {"stage_bytes": 0, "real_slots": 0, "pool_bytes": 0, "slot_bytes": 0, "steps": 0}
    plan = decode_stage.DecodeStager.plan

    def hooked(self, members, k_cache, v_cache, *rest):  # noqa: ANN001, ANN202
        groups = plan(self, members, k_cache, v_cache, *rest)
        peak["steps"] += 1
        peak["stage_bytes"] = max(peak["stage_bytes"], self.nbytes())
        peak["real_slots"] = max(peak["real_slots"], sum(sum(s.lengths) for s in self.stages))
        peak["pool_bytes"] = 2 * k_cache.numel() * k_cache.element_size()
        layers, _, _, kv, hd = k_cache.shape
        peak["slot_bytes"] = 2 * layers * kv * hd * self.dtype.itemsize
        return groups

    decode_stage.DecodeStager.plan = hooked
    ns = argparse.Namespace(
        model=args.model,
        layout="many",
        domains="layout many",
        quick=False,
        overrides=[],
        run_overrides=args.set,
    )
    sizes = dict(PRESETS["full"], max_new_tokens=96)
    start = time.perf_counter()
    report = base_eval(run_overrides(ns, sizes), args.n, 1000, True)
    scores = [x for v in report.per_task.values() for x in v if x is not None]
    out = {
        "tasks_per_arm": args.n,
        "seconds": round(time.perf_counter() - start, 1),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        "peak_stage_gb": peak["stage_bytes"] / 1e9,
        "peak_real_staged_gb": peak["real_slots"] * peak["slot_bytes"] / 1e9,
        "pool_gb": peak["pool_bytes"] / 1e9,
        "decode_steps": peak["steps"],
        "solved": f"{sum(scores):g}/{len(scores)}",  # strict success, greedy: outputs agree across settings?
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
