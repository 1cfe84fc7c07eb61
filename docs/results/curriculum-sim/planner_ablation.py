"""What knowing the simulated learner is worth to `oracle_plan` (docs/curriculum.md, stop 19).

The planner keeps reading the learner's true current skills, but plans on a model whose hidden parameters
named by PRIORS are replaced by one generic value for every arm: k interference kappa 0.06, d disuse delta
0.0125, f floors at half the starting success rate, r transfer rho 0.45, e learning rate eta 1.

    .venv/bin/python docs/results/curriculum-sim/planner_ablation.py PRIORS SEED0 N   (PRIORS "-" for none)
"""

import copy
import sys

import numpy as np
from _summary import summarise  # this folder (the script's directory is on sys.path)

import posttrain.bench.planning as planning
from posttrain.bench.sim import ORACLE_PLAN, Learner

PRIORS = sys.argv[1].strip("-")


class GenericPlanner(planning.PlanningOracle):
    def model(self) -> Learner:
        true, k = self._learner, len(self._learner.arms)
        if not hasattr(self, "_p0"):
            self._p0 = true.p.copy()
        m = copy.copy(true)
        if "k" in PRIORS:
            m.kappa = np.full(k, 0.06)
        if "d" in PRIORS:
            m.delta = np.full(k, 0.0125)
        if "f" in PRIORS:
            m.floor = np.log(self._p0 / 2 / (1 - self._p0 / 2))
        if "r" in PRIORS:
            m.rho = {d: 0.45 for d in true.rho}
        if "e" in PRIORS:
            m.eta = np.full(k, 1.0)
        m.theta = true.theta.copy()
        return m


planning.PlanningOracle = GenericPlanner  # sim.run builds oracle_plan from this module at call time


def main() -> None:
    start, n = int(sys.argv[2]), int(sys.argv[3])
    print(summarise(f"priors {PRIORS or '-'}", ORACLE_PLAN, range(start, start + n)))


if __name__ == "__main__":
    main()
