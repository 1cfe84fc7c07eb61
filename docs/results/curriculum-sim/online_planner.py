"""An online planner on the simulated learner (docs/curriculum.md, stop 19; not adopted, not a sampler of
the package). It reads nothing hidden: every 10 steps it fits the simulator's own model (the functional
form of `sim.Learner`) to what the sampler has seen, by maximum a posteriori through the recursion (torch
L-BFGS), and plans on the fit with `oracle_plan`'s machinery and objective.

Fitted: start logits, per-arm learning rate and floor, per-domain transfer, one interference and one
disuse rate. Data: each step's groups per arm, their rollouts and successes (a binomial likelihood), and
the sum of the groups' reward variances (each step's gradient, exactly). It samples uniform_by_domain for
the first 10 steps, keeps a 0.1 uniform floor, infers the budget from its tokens and the spent share, and
aims at uniform_by_domain's final macro accuracy as predicted from the fitted start (it does not know the
data schedule).

    .venv/bin/python docs/results/curriculum-sim/online_planner.py SEED0 N     (~25 s a seed)
"""

import math
import sys

import numpy as np
import torch
from _summary import summarise  # this folder (the script's directory is on sys.path)

from posttrain.curriculum import samplers
from posttrain.bench.planning import PlanningOracle, expected_run, search_plan
from posttrain.bench.sim import Learner, SimSettings

torch.set_num_threads(1)
FLOOR = 0.1  # uniform share mixed into every policy, so every arm keeps being observed
WARMUP = 10  # steps of uniform_by_domain before the first fit


class OnlinePlanner(samplers.Sampler):
    replan, phases = PlanningOracle.replan, PlanningOracle.phases
    population, rounds, elite = PlanningOracle.population, PlanningOracle.rounds, PlanningOracle.elite
    w_final, w_forget, w_worst = PlanningOracle.w_final, PlanningOracle.w_forget, PlanningOracle.w_worst

    def _init_extra(self, k: int) -> None:
        self.records: list[np.ndarray] = []  # per step: groups, rollouts, successes, sum of variances (4, k)
        self._cur: np.ndarray | None = None
        self._cur_step: int | None = None
        self.tokens, self.token_rollouts = np.zeros(k), np.zeros(k)
        self.group_size: int | None = None
        names = sorted({a.domain for a in self.arms})
        self.domain_of = np.array([names.index(a.domain) for a in self.arms])
        self.n_domains = len(names)
        self.x: np.ndarray | None = None
        self._plan: np.ndarray | None = None
        self._mu = np.zeros((self.phases, k))
        self._planned_at = -(10**9)
        self._plan_rng = np.random.default_rng(40_000 + self.seed)
        self._peak: np.ndarray | None = None

    def _observe(self, i: int, groups: list[list[float]]) -> None:
        step = self._s["last_step"]
        if self._cur_step != step:
            self._flush()
            self._cur_step, self._cur = step, np.zeros((4, len(self.arms)))
        r = np.array(groups)
        self.group_size = r.shape[1]
        self._cur[:, i] += [len(groups), r.size, r.sum(), r.var(axis=1).sum()]

    def update(self, step, arm, group_rewards, tokens=None) -> None:  # noqa: ANN001
        super().update(step, arm, group_rewards, tokens)
        if tokens is not None:
            i = self._idx(arm)
            self.tokens[i] += tokens
            self.token_rollouts[i] += sum(len(g) for g in group_rewards)

    def _flush(self) -> None:
        if self._cur is not None:
            self.records.append(self._cur)
            self._cur = None

    def _unpack(self, x):  # noqa: ANN001, ANN202
        k, d = len(self.arms), self.n_domains
        return x[..., :k], x[..., k:2 * k], x[..., 2 * k:2 * k + d], x[..., 2 * k + d], x[..., 2 * k + d + 1], x[..., 2 * k + d + 2:]

    def _neg_log_posterior(self, x: torch.Tensor, rec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        th0, log_eta, z_rho, log_kappa, log_delta, floor_gap = self._unpack(x)
        eta, rho = torch.exp(log_eta), torch.sigmoid(z_rho)[..., self.domain_of]
        kappa, delta = torch.exp(log_kappa), torch.exp(log_delta)
        floor = th0 - torch.nn.functional.softplus(floor_gap)
        onehot = torch.tensor(np.eye(self.n_domains)[self.domain_of])
        th, nll, peak = th0, 0.0, torch.sigmoid(th0)
        for groups, n, s, var_sum in rec:
            p = torch.sigmoid(th).clamp(1e-6, 1 - 1e-6)
            nll = nll - (s * torch.log(p) + (n - s) * torch.log(1 - p)).sum()
            idle = (groups == 0).double()
            th = torch.where(th > floor, floor + (th - floor) * (1 - idle + idle * torch.exp(-delta)), th)
            step = eta * var_sum / groups.sum()
            th = th + step + rho * ((step @ onehot) @ onehot.T - step)
            by_domain = step.abs() @ onehot
            th = torch.where(th > floor, floor + (th - floor) * torch.exp(-kappa * ((by_domain.sum() - by_domain) @ onehot.T)), th)
            peak = torch.maximum(peak, torch.sigmoid(th))
        prior = (0.5 * log_eta**2).sum() + 0.5 * (z_rho**2).sum() + 0.5 * (log_kappa - math.log(0.05)) ** 2 \
            + 0.5 * (log_delta - math.log(0.01)) ** 2 + (0.5 * (th0 / 3) ** 2).sum() + (0.5 * ((floor_gap - 1.0) / 2) ** 2).sum()
        return nll + prior, th, peak

    def _fit(self) -> np.ndarray:
        """MAP fit to every record so far (warm-started); returns the fitted current logits."""
        rec = torch.tensor(np.array(self.records))
        k, d = len(self.arms), self.n_domains
        if self.x is None:
            n, s = rec[:, 1].sum(0), rec[:, 2].sum(0)
            p0 = ((s + 0.5) / (n + 1)).numpy()
            self.x = np.concatenate([np.log(p0 / (1 - p0)), np.zeros(k), np.zeros(d), [math.log(0.05), math.log(0.01)], np.ones(k)])
        x = torch.tensor(self.x, requires_grad=True)
        opt = torch.optim.LBFGS([x], max_iter=25, line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = self._neg_log_posterior(x, rec)[0]
            loss.backward()
            return loss

        opt.step(closure)
        self.x = x.detach().numpy().copy()
        with torch.no_grad():
            _, th, peak = self._neg_log_posterior(torch.tensor(self.x), rec)
        self._peak = peak.numpy()
        return th.numpy()

    def _model(self, theta: np.ndarray) -> Learner:
        th0, log_eta, z_rho, log_kappa, log_delta, floor_gap = self._unpack(self.x)
        k = len(self.arms)
        rho = 1 / (1 + np.exp(-z_rho))
        names = sorted({a.domain for a in self.arms})
        mean_tokens = self.tokens.sum() / max(self.token_rollouts.sum(), 1)
        tokens = np.where(self.token_rollouts > 0, self.tokens / np.maximum(self.token_rollouts, 1), mean_tokens)
        return Learner(list(self.arms), ["?"] * k, theta.copy(), th0 - np.log1p(np.exp(floor_gap)), np.exp(log_eta),
                       np.full(k, np.exp(log_kappa)), np.full(k, np.exp(log_delta)), tokens, np.ones(k, dtype=int),
                       {name: float(rho[j]) for j, name in enumerate(names)})

    def _policy(self, avail: np.ndarray) -> np.ndarray:
        k = len(self.arms)
        step = self._s["last_step"]
        now = -1 if step is None else int(step)
        if now < WARMUP or self.progress <= 0:
            return samplers._uniform_by_domain(self.arms, avail)
        if self._plan is None or now - self._planned_at >= self.replan:
            self._flush()
            self._cur_step = None
            theta = self._fit()
            model = self._model(theta)
            budget = self.tokens.sum() / self.progress
            settings = SimSettings(groups_per_step=int(round(self.records[-1][0].sum())), group_size=self.group_size)
            start = self._model(self._unpack(self.x)[0])
            uniform = samplers._uniform_by_domain(self.arms, np.arange(k))
            with np.errstate(all="ignore"):
                threshold = float(expected_run(start, start.theta, uniform[None, None], 0.0, budget, settings, np.inf,
                                               start.p)["macro"][0])
            peak = np.maximum(model.p, self._peak)
            spent = self.progress * budget
            away = [i for i in range(k) if i not in set(avail.tolist())]
            has_data = np.isin(np.arange(k), avail)

            def score(logits: np.ndarray) -> np.ndarray:
                w = np.exp(logits - logits.max(axis=2, keepdims=True))
                w /= w.sum(axis=2, keepdims=True)
                if away:
                    w[:, :, away] = 0
                w = (1 - FLOOR) * w / w.sum(axis=2, keepdims=True) + FLOOR / len(avail) * has_data
                res = expected_run(model, theta, w, spent, budget, settings, threshold, peak)
                reach = np.where(np.isfinite(res["reach"]), res["reach"] / budget, 2.0 - res["macro"])
                return (reach - self.w_final * res["macro"] + self.w_forget * (res["peak"] - res["final"]).mean(1)
                        - self.w_worst * res["final"].min(1))

            self._mu, self._plan = search_plan(score, self._mu, self._plan is not None, self._plan_rng, self.rounds,
                                               self.population, self.elite)
            self._planned_at = now
        w = self._plan[avail]
        w = w / w.sum() if w.sum() > 0 else np.full(len(avail), 1 / len(avail))
        return (1 - FLOOR) * w + FLOOR / len(avail)


samplers.SAMPLERS["online_plan"] = OnlinePlanner
OnlinePlanner.name = "online_plan"


def main() -> None:
    start, n = int(sys.argv[1]), int(sys.argv[2])
    print(summarise("online planner", "online_plan", range(start, start + n), verbose=True))


if __name__ == "__main__":
    main()
