"""Planning over the simulated learner: the cross-entropy method, the learner's expected dynamics, and
`PlanningOracle` (bench row `oracle_plan`), an allocation that plans with the learner's hidden state.

Owns no sampler anyone can run. `oracle` (`sim.OracleSampler`) reads the hidden state but allocates
myopically, by each arm's one-step gain; it says how far knowledge takes a greedy rule. `oracle_plan`
says how far knowledge takes an allocation that looks ahead: every `replan` steps it simulates the
learner's expected dynamics (`expected_run`) from the true state to the end of the token budget under
candidate plans (a mix per quarter of what is left), picks the best plan by the cross-entropy method, and
follows the plan's first mix until the next replan (or keeps the previous plan, if the model scores it
no worse). It also knows the data schedule (when `code:0` leaves and returns) and the threshold:
uniform_by_domain's final macro accuracy as the same expected dynamics predict it (the bench's threshold
is uniform's realised final accuracy, within 0.006 of that on seeds 0-15).
Its objective, minimised (`PlanningOracle.objective`):

    reach / budget - w_final * final macro + w_forget * mean_k (peak_k - final_k) - w_worst * min_k final_k

reach = the tokens spent when the predicted macro accuracy first reaches the threshold (2 budgets less
the final macro when it never does), peak_k = the highest p_k so far (the realised past included) or
predicted. The terms mirror the benchmark's targets: tokens to threshold, forgetting, worst arm.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from posttrain.bench.sim import (
    ORACLE_PLAN,
    REMOVED_ARM,
    Learner,
    SimSettings,
    budget_tokens,
    register_reference,
    sigmoid,
)
from posttrain.config import CurriculumConfig
from posttrain.curriculum.arms import Arm
from posttrain.curriculum.samplers import Sampler, _uniform_by_domain


def cross_entropy_min(
    score: Callable[[np.ndarray], float | np.ndarray],
    mu: np.ndarray,
    sd: np.ndarray,
    rounds: int,
    population: int,
    elite: int,
    rng: np.random.Generator,
    sd_floor: float | np.ndarray = 0.05,
    bounds: tuple[np.ndarray, np.ndarray] | None = None,
    batched: bool = False,
) -> tuple[float, np.ndarray]:
    """Minimise score(x) by the cross-entropy method: each round draws `population` points from
    N(mu, sd) (clipped to `bounds`), keeps the `elite` best, and refits mu and sd (+ sd_floor) to them.
    batched: score takes all of a round's points at once (shape (population, *mu.shape)) and returns
    their scores. Returns the best (score, x) seen. Deterministic given rng."""
    best: tuple[float, np.ndarray] | None = None
    for _ in range(rounds):
        xs = mu + sd * rng.standard_normal((population, *np.shape(mu)))
        if bounds is not None:
            xs = np.clip(xs, *bounds)
        scores = np.asarray(score(xs), dtype=np.float64) if batched else np.array([score(x) for x in xs])
        i = int(np.argmin(scores))
        if best is None or scores[i] < best[0]:
            best = (float(scores[i]), xs[i])
        chosen = xs[np.argsort(scores)[:elite]]
        mu, sd = chosen.mean(axis=0), chosen.std(axis=0) + sd_floor
    assert best is not None, "cross_entropy_min needs rounds >= 1 and population >= 1"
    return best


def domain_matrix(learner: Learner) -> tuple[np.ndarray, np.ndarray]:
    """(arms x domains one-hot, each arm's domain transfer rate rho) in `Learner.domain_of`'s order."""
    onehot = np.eye(int(learner.domain_of.max()) + 1)[learner.domain_of]
    rho_of = {int(d): learner.rho[a.domain] for a, d in zip(learner.arms, learner.domain_of, strict=True)}
    return onehot, np.array([rho_of[int(d)] for d in learner.domain_of])


def move(
    learner: Learner,
    theta: np.ndarray,
    step: np.ndarray,
    p_idle: np.ndarray,
    domains: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """`Learner.train`'s update of skill logits theta (shape (..., arms)) given each arm's own step
    (eta_k / B * the sum of its groups' gradients) and the chance p_idle that the arm had no group this
    step (1 or 0 for one step; the expected disuse decay in between): disuse, same-domain transfer,
    then interference from the other domains' |step|. domains: `domain_matrix(learner)`, if at hand."""
    floor = learner.floor
    theta = np.where(
        theta > floor, floor + (theta - floor) * (1.0 - p_idle + p_idle * np.exp(-learner.delta)), theta
    )
    onehot, rho = domain_matrix(learner) if domains is None else domains
    theta = theta + step + rho * ((step @ onehot) @ onehot.T - step)
    by_domain = np.abs(step) @ onehot
    interference = (by_domain.sum(axis=-1, keepdims=True) - by_domain) @ onehot.T
    return np.where(theta > floor, floor + (theta - floor) * np.exp(-learner.kappa * interference), theta)


def expected_run(
    learner: Learner,
    theta: np.ndarray,
    plans: np.ndarray,
    spent: float,
    budget: float,
    settings: SimSettings,
    threshold: float,
    peak: np.ndarray,
    removed: int | None = None,
    plans_removed: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Run C plans (weights, shape (C, P, arms): P mixes, mix j while the spent share of the tokens
    left at the start is in [j/P, (j+1)/P)) from logits theta and `spent` tokens to the budget, under
    the learner's expected dynamics: an arm with weight w gets B*w groups a step, its own step is
    eta * w * p(1-p)(1 - 1/G), and it goes a step without a group with chance max(0, 1 - B*w)
    (systematic sampling). (A group's gradient in `Learner.train` is the variance of its rewards, r(1-r)
    for a success rate r, whose mean over Binomial(G, p) draws is p(1-p)(1 - 1/G); p is the rollouts'
    success rate, before the disuse decay.) Arm `removed` gets no groups while the spent share is in the
    settings' removal window (its weight goes to the others in proportion, or the mixes come from
    plans_removed there; a mix with no weight left is uniform over the arms with data). Returns per plan: reach (tokens at the first
    step whose macro accuracy is >= threshold; inf if none), final (p at the end, (C, arms)), peak
    (highest p, past `peak` included) and macro (the final macro accuracy)."""
    c, phases, _ = plans.shape
    b, g = settings.groups_per_step, settings.group_size
    th = np.repeat(theta[None, :], c, axis=0)
    spent_c = np.full(c, float(spent))
    reach = np.full(c, np.inf)
    p = sigmoid(th)  # the success rates; at the top of a step, the rollouts' (before the disuse decay)
    peak_c = np.maximum(np.repeat(peak[None, :], c, axis=0), p)
    rows = np.arange(c)
    domains = domain_matrix(learner)
    left = max(budget - spent, 1.0)
    going = spent_c < budget
    while going.any():
        phase = np.minimum(phases - 1, ((spent_c - spent) / left * phases).astype(np.int64))
        frac = spent_c / budget
        out = (
            (settings.removed_from <= frac) & (frac < settings.removed_until) if removed is not None else None
        )
        w = plans[rows, phase].copy()
        there = np.ones_like(w)  # 1 where the arm has data now
        if out is not None and out.any():
            there[out, removed] = 0.0
            if plans_removed is not None:
                w[out] = plans_removed[rows[out], phase[out]]
            w[out, removed] = 0.0
        total = w.sum(axis=1, keepdims=True)
        w = np.where(total > 0, w / np.where(total > 0, total, 1.0), there / there.sum(axis=1, keepdims=True))
        groups = b * w
        idle = np.clip(1.0 - groups, 0.0, 1.0)
        step = learner.eta * w * p * (1.0 - p) * (1.0 - 1.0 / g)
        nxt = move(learner, th, step, idle, domains)
        th = np.where(going[:, None], nxt, th)
        spent_c = spent_c + np.where(going, (groups * g * learner.tokens).sum(axis=1), 0.0)
        p = sigmoid(th)
        peak_c = np.maximum(peak_c, p)
        hit = going & np.isinf(reach) & (p.mean(axis=1) >= threshold - 1e-12)
        reach[hit] = spent_c[hit]
        going = spent_c < budget
    return {"reach": reach, "final": p, "peak": peak_c, "macro": p.mean(axis=1)}


def search_plan(
    score: Callable[[np.ndarray], np.ndarray],
    previous: np.ndarray,
    keep_previous: bool,
    rng: np.random.Generator,
    rounds: int,
    population: int,
    elite: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Cross-entropy search over plans as softmax logits (shape (phases, arms)), started at `previous`;
    with keep_previous, `previous` stays when score rates it no worse than the search's best (so noise in
    the search does not churn the allocation). Returns (the plan's logits, its first mix as weights)."""
    found, best = cross_entropy_min(
        score, previous, np.ones_like(previous), rounds, population, elite, rng, batched=True
    )
    if keep_previous and score(previous[None])[0] <= found:
        best = previous
    w = np.exp(best[0] - best[0].max())
    return best, w / w.sum()


class PlanningOracle(Sampler):
    """A reference, not a sampler anyone can run: model-predictive control with the learner's hidden
    state and dynamics (see the module docstring). Deterministic per seed."""

    name = ORACLE_PLAN
    replan = 10  # steps between plans
    phases = 4  # mixes per plan, one per quarter of the tokens left
    population, rounds, elite = 64, 10, 12
    w_final, w_forget, w_worst = 0.3, 10.0, 0.5

    def __init__(
        self, cfg: CurriculumConfig, arms: list[Arm], seed: int, learner: Learner, settings: SimSettings
    ):
        super().__init__(cfg, arms, seed)
        self._learner, self._settings = learner, settings
        self._budget = budget_tokens(learner, settings)
        self._removed = self.arms.index(REMOVED_ARM)
        self._plan_rng = np.random.default_rng(40_000 + self.seed)
        self._mu = np.zeros((self.phases, len(self.arms)))
        self._plan: np.ndarray | None = None
        self._planned_at = 0
        self._peak = learner.p.copy()
        self.threshold = self._predicted_uniform_final()

    def _predicted_uniform_final(self) -> float:
        everything = np.arange(len(self.arms))
        without = np.array([i for i in everything if i != self._removed])
        full = _uniform_by_domain(self.arms, everything)
        part = np.zeros(len(self.arms))
        part[without] = _uniform_by_domain(self.arms, without)
        model = self.model()
        res = expected_run(
            model,
            model.theta,
            full[None, None, :],
            0.0,
            self._budget,
            self._settings,
            np.inf,
            self._peak,
            self._removed,
            part[None, None, :],
        )
        return float(res["macro"][0])

    def model(self) -> Learner:
        """The learner the plans are simulated on: the true one (its current state and hidden parameters).
        A subclass can return one with some parameters replaced, to see what knowing them is worth."""
        return self._learner

    def objective(self, res: dict[str, np.ndarray]) -> np.ndarray:
        """The planning objective per plan (lower is better; see the module docstring)."""
        reach = np.where(np.isfinite(res["reach"]), res["reach"] / self._budget, 2.0 - res["macro"])
        forgetting = (res["peak"] - res["final"]).mean(axis=1)
        return (
            reach
            - self.w_final * res["macro"]
            + self.w_forget * forgetting
            - self.w_worst * res["final"].min(axis=1)
        )

    def _replan(self) -> None:
        """Search plans from the current state (`search_plan`, keeping the previous plan if no worse)."""
        spent = self.progress * self._budget
        model = self.model()

        def score(logits: np.ndarray) -> np.ndarray:
            w = np.exp(logits - logits.max(axis=2, keepdims=True))
            w /= w.sum(axis=2, keepdims=True)
            res = expected_run(
                model,
                model.theta,
                w,
                spent,
                self._budget,
                self._settings,
                self.threshold,
                self._peak,
                self._removed,
            )
            return self.objective(res)

        self._mu, self._plan = search_plan(
            score, self._mu, self._plan is not None, self._plan_rng, self.rounds, self.population, self.elite
        )

    def _policy(self, avail: np.ndarray) -> np.ndarray:
        self._peak = np.maximum(self._peak, self._learner.p)
        step = self._s["last_step"]
        now = -1 if step is None else int(step)
        if self._plan is None or now - self._planned_at >= self.replan:
            self._replan()
            self._planned_at = now
        w = self._plan[avail]
        return w / w.sum() if w.sum() > 0 else np.full(len(avail), 1.0 / len(avail))


@register_reference(ORACLE_PLAN)
def _planning_oracle(cfg, arms, seed, learner, settings, static_weights) -> Sampler:
    return PlanningOracle(cfg, arms, seed, learner, settings)
