"""A simulated multi-arm learner for comparing samplers on CPU in seconds (benchmark 1).

Owns the learner's dynamics and the loop that drives any `Sampler` against it under a token budget.
It is a model, not a measurement of an LLM: the dynamics are stated below and chosen before the
samplers were compared, and the benchmark reports whatever they give.

Dynamics (per seed, every hidden parameter drawn from the ranges in `make_learner`):
- Arm k has skill logit theta_k; its success probability is p_k = sigmoid(theta_k). Each rollout is a
  Bernoulli(p_k) reward.
- Learning is the policy gradient of a Bernoulli policy with a group-mean baseline: a group of G
  rewards moves theta_k by eta_k * (1/G) * sum_i (r_i - mean r)(r_i - p_k), divided by the number of
  groups in the step's batch: every group weighs the same, as a per-sequence mean loss does (the loop's
  default token_mean weighs a group by its tokens; with that weighting, tried on seeds 0-31,
  the ordering was the same: adaptive 0.84x, forgetting 0.012 vs uniform 0.008, sec 0.92x). Its
  expectation is eta_k * p(1-p) * (1 - 1/G): the premise every advantage-driven sampler shares, and
  all-equal groups teach nothing.
- Same-domain transfer: an arm's step moves the other arms of its domain by rho_domain times as much
  (this is how a "too hard yet" arm becomes learnable).
- Forgetting, two ways. Disuse: an arm with no trained group in a step moves its logit toward its
  floor by the factor exp(-delta_k), delta in [0.005, 0.02]. Interference: after each step, every arm
  above its floor moves toward it by exp(-kappa_k * U), kappa in [0.02, 0.1], U = sum of |step| of
  the arms of *other* domains. Practice counteracts interference only through the arm's own
  gradient, which is small when p is near 0 or 1. Floors: mastered p in [0.3, 0.5], learnable p0/2.
- Roles (the `default` layout, 8 arms, 4 domains): 2 mastered (p0 in [0.85, 0.95]), 4 learnable (p0 in
  [0.1, 0.45], eta log-uniform in [0.3, 3]), 2 too hard yet (p0 in [0.01, 0.03], learnable once
  transfer from their domain's easier arms lifts them; rho in [0.3, 0.6]). Other layouts (`LAYOUTS`,
  or a spec `domain:level=role,...`; `parse_layout`) use the same roles and ranges: a sensitivity check
  of how much there is to gain, not the benchmark's figures. `idle_heavy` puts about half of
  uniform_by_domain's groups on arms with little to learn: 3 mastered, 2 learnable, 3 too hard, one of
  them alone in its domain (no easier arm lifts it).
- `code:0` (learnable in every preset) has no training data between 35% and 65% of the token budget
  (the sampler is told via set_data_size(arm, 0)); its skill keeps decaying meanwhile. A layout
  without `code:0` is refused.
- Tokens: every rollout of arm k costs tokens_k (about 150*(1+difficulty)); probes (adaptive only)
  cost the same per prompt and count against the same budget. A probe of a domain splits its
  probe_size prompts evenly over the domain's arms; each arm's score is Binomial(m, p)/m, reported
  with its m. Only the arms the sampler's `probe_arms(step)` names are probed (and charged).
`OracleSampler` (bench row `oracle`) reads the hidden p and eta and allocates greedily: not a sampler.
`planning.PlanningOracle` (bench row `oracle_plan`) reads the whole hidden state and plans on the
expected dynamics: how far knowing the learner takes an allocation that looks ahead.
`StaticSampler` (bench row `hindsight_static`, `--hindsight`) holds one fixed weight vector (or one per
phase of the budget), the best one a search finds for the seed by running it: what a fixed mix (or a
phased plan) chosen with hindsight can reach.
Not modelled: prompts within an arm (choose_prompt), optimiser state, noise in the reward itself.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from posttrain.config import CurriculumConfig
from posttrain.curriculum.arms import Arm
from posttrain.curriculum.samplers import Sampler, make_sampler

Layout = tuple[tuple[str, int, str], ...]  # (domain, level, role) per arm, in arm order
ROLES = ("mastered", "learnable", "too_hard")
LAYOUT: Layout = (
    ("math", 0, "mastered"),
    ("math", 1, "learnable"),
    ("math", 2, "too_hard"),
    ("code", 0, "learnable"),
    ("code", 1, "too_hard"),
    ("tools", 0, "mastered"),
    ("tools", 1, "learnable"),
    ("logic", 0, "learnable"),
)


def _recast(layout: Layout, roles: dict[str, str]) -> Layout:
    """The layout with the roles of the arms named by key ("tools:1") replaced."""
    return tuple((d, lv, roles.get(f"{d}:{lv}", role)) for d, lv, role in layout)


LAYOUTS: dict[str, Layout] = {
    "default": LAYOUT,
    "idle_heavy": _recast(LAYOUT, {"tools:1": "mastered", "logic:0": "too_hard"}),
}
REMOVED_ARM = Arm("code", 0)


def parse_layout(spec: str) -> Layout:
    """A preset name of LAYOUTS, or `domain:level=role,...` (roles: mastered, learnable, too_hard).
    The arms must be distinct and include REMOVED_ARM (its data leaves mid-run) and another arm."""
    spec = spec.strip()
    if spec in LAYOUTS:
        return LAYOUTS[spec]
    if "=" not in spec:
        raise ValueError(
            f"layout '{spec}' is neither a preset ({', '.join(LAYOUTS)}) nor domain:level=role,..."
        )
    out = []
    for item in spec.split(","):
        arm_key, _, role = item.strip().partition("=")
        domain, _, level = arm_key.strip().partition(":")
        if not domain or not level.strip().isdigit():
            raise ValueError(
                f"layout item '{item.strip()}' must be domain:level=role with an integer level >= 0"
            )
        if role.strip() not in ROLES:
            raise ValueError(
                f"layout item '{item.strip()}': role '{role.strip()}' is not one of {', '.join(ROLES)}"
            )
        out.append((domain.strip(), int(level), role.strip()))
    keys = [(d, lv) for d, lv, _ in out]
    if len(set(keys)) != len(keys):
        raise ValueError(f"layout '{spec}' names an arm twice")
    if tuple(REMOVED_ARM) not in keys:
        raise ValueError(f"layout '{spec}' must include {REMOVED_ARM.key}: its data leaves mid-run")
    if len(out) < 2:
        raise ValueError(
            f"layout '{spec}' needs an arm besides {REMOVED_ARM.key}, which has no data for part of the run"
        )
    return tuple(out)


def _logit(p: float) -> float:
    return float(np.log(p / (1.0 - p)))


def sigmoid(theta: np.ndarray) -> np.ndarray:
    """Success probabilities of skill logits."""
    return 1.0 / (1.0 + np.exp(-theta))


@dataclass
class Learner:
    arms: list[Arm]
    roles: list[str]
    theta: np.ndarray
    floor: np.ndarray
    eta: np.ndarray
    kappa: np.ndarray
    delta: np.ndarray  # passive decay rate per step without practice
    tokens: np.ndarray  # tokens per rollout
    data_size: np.ndarray
    rho: dict[str, float]
    domain_of: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        names = sorted({a.domain for a in self.arms})
        self.domain_of = np.array([names.index(a.domain) for a in self.arms])

    @property
    def p(self) -> np.ndarray:
        return sigmoid(self.theta)

    def train(self, idx: np.ndarray, rewards: np.ndarray) -> None:
        """One optimiser step on groups of arms `idx` (shape B) with rewards (B, G)."""
        unpractised = np.ones(len(self.arms), dtype=bool)
        unpractised[idx] = False
        self.theta = np.where(
            unpractised & (self.theta > self.floor),
            self.floor + (self.theta - self.floor) * np.exp(-self.delta),
            self.theta,
        )
        if len(idx) == 0:
            return
        p = self.p
        grad = ((rewards - rewards.mean(axis=1, keepdims=True)) * (rewards - p[idx, None])).mean(axis=1)
        step = np.zeros(len(self.arms))
        np.add.at(step, idx, grad)
        step *= self.eta / len(idx)
        moved = step.copy()
        for d in np.unique(self.domain_of):
            same = self.domain_of == d
            total = step[same].sum()
            moved[same] += self.rho[self.arms[int(np.flatnonzero(same)[0])].domain] * (total - step[same])
        self.theta = self.theta + moved
        abs_by_domain = np.array(
            [np.abs(step[self.domain_of == d]).sum() for d in range(self.domain_of.max() + 1)]
        )
        interference = abs_by_domain.sum() - abs_by_domain[self.domain_of]
        above = self.theta > self.floor
        decayed = self.floor + (self.theta - self.floor) * np.exp(-self.kappa * interference)
        self.theta = np.where(above, decayed, self.theta)


def make_learner(seed: int, layout: Layout = LAYOUT) -> Learner:
    """Draw the hidden parameters of one simulated learner (the same for every sampler at this seed)."""
    rng = np.random.default_rng(10_000 + seed)
    arms, roles, theta, floor, eta, kappa, delta, tokens, size = [], [], [], [], [], [], [], [], []
    for domain, level, role in layout:
        arms.append(Arm(domain, level))
        roles.append(role)
        if role == "mastered":
            p0 = rng.uniform(0.85, 0.95)
            fl = rng.uniform(0.3, 0.5)
            e = np.exp(rng.uniform(np.log(0.5), np.log(2.0)))
        elif role == "learnable":
            p0 = rng.uniform(0.1, 0.45)
            fl = p0 / 2
            e = np.exp(rng.uniform(np.log(0.3), np.log(3.0)))
        else:
            p0 = rng.uniform(0.01, 0.03)
            fl = p0
            e = np.exp(rng.uniform(np.log(0.5), np.log(2.0)))
        theta.append(_logit(p0))
        floor.append(_logit(fl))
        eta.append(e)
        kappa.append(rng.uniform(0.02, 0.1))
        delta.append(rng.uniform(0.005, 0.02))
        tokens.append(int(150 * (1 + level) * rng.uniform(0.8, 1.25)))
        size.append(int(np.exp(rng.uniform(np.log(200), np.log(5000)))))
    rho = {d: float(rng.uniform(0.3, 0.6)) for d in sorted({a.domain for a in arms})}
    return Learner(
        arms,
        roles,
        np.array(theta),
        np.array(floor),
        np.array(eta),
        np.array(kappa),
        np.array(delta),
        np.array(tokens, dtype=np.float64),
        np.array(size),
        rho,
    )


ORACLE = "oracle"
ORACLE_PLAN = "oracle_plan"  # planning.PlanningOracle: reads the hidden state and plans


class OracleSampler(Sampler):
    """A reference, not a sampler anyone can run: it reads the learner's hidden state. Weights are
    proportional to each arm's expected one-step gain in success probability per group,
    eta_k * (p_k(1-p_k))^2 (the drift of `Learner.train` times dp/dtheta, transfer ignored), mixed
    with eps/K uniform like the adaptive rule, and it never pays for probes. It shows how much
    an allocation that knew the truth could gain in this simulator (myopically)."""

    name = ORACLE

    def __init__(self, cfg: CurriculumConfig, arms: list[Arm], seed: int, learner: Learner):
        super().__init__(cfg, arms, seed)
        self._learner = learner

    def _policy(self, avail: np.ndarray) -> np.ndarray:
        p = self._learner.p[avail]
        gain = self._learner.eta[avail] * (p * (1.0 - p)) ** 2
        w = gain / gain.sum() if gain.sum() > 0 else np.full(len(avail), 1.0 / len(avail))
        return (1.0 - self.cfg.eps) * w + self.cfg.eps / len(avail)


HINDSIGHT = "hindsight_static"


class StaticSampler(Sampler):
    """Fixed weights over the arms (renormalised over the available ones), or a plan of P such rows, row
    j used while the spent share of the token budget is in [j/P, (j+1)/P) (`sim.run` reports it through
    set_progress). A reference for the bench's hindsight search, not a sampler anyone can run: the
    weights are chosen after seeing the seed's runs."""

    name = HINDSIGHT

    def __init__(self, cfg: CurriculumConfig, arms: list[Arm], seed: int, weights: np.ndarray | None):
        super().__init__(cfg, arms, seed)
        w = np.asarray(weights if weights is not None else [], dtype=np.float64)
        w = w[None, :] if w.ndim == 1 else w
        ok = w.ndim == 2 and len(w) >= 1 and w.shape[1] == len(self.arms)
        if not ok or np.any(w < 0) or not np.all(np.isfinite(w)) or np.any(w.sum(axis=1) <= 0):
            raise ValueError(
                f"StaticSampler: need {len(self.arms)} finite weights >= 0 with a positive sum (or rows of them, "
                f"one per phase), got {w.tolist()}"
            )
        self._w = w
        self._phase = 0

    def set_progress(self, fraction: float) -> None:
        """The spent share of the token budget (in [0, 1]); it also picks the plan's row."""
        super().set_progress(fraction)
        self._phase = min(len(self._w) - 1, max(0, int(self.progress * len(self._w))))

    def _policy(self, avail: np.ndarray) -> np.ndarray:
        w = self._w[self._phase, avail]
        return w / w.sum() if w.sum() > 0 else np.full(len(avail), 1.0 / len(avail))


# The references by name: they read the simulated learner, which no real sampler can, so they are built
# here rather than by `make_sampler`. planning.py registers `oracle_plan` on import (it imports this module).
ReferenceFactory = Callable[
    [CurriculumConfig, list[Arm], int, Learner, "SimSettings", "np.ndarray | None"], Sampler
]
REFERENCES: dict[str, ReferenceFactory] = {}


def register_reference(name: str) -> Callable[[ReferenceFactory], ReferenceFactory]:
    """Register `fn(cfg, arms, seed, learner, settings, static_weights) -> Sampler` as reference `name`."""

    def deco(fn: ReferenceFactory) -> ReferenceFactory:
        REFERENCES[name] = fn
        return fn

    return deco


@register_reference(ORACLE)
def _oracle(cfg, arms, seed, learner, settings, static_weights) -> Sampler:
    return OracleSampler(cfg, arms, seed, learner)


@register_reference(HINDSIGHT)
def _hindsight(cfg, arms, seed, learner, settings, static_weights) -> Sampler:
    return StaticSampler(cfg, arms, seed, static_weights)  # rejects missing or bad weights


@dataclass
class SimSettings:
    groups_per_step: int = 32
    group_size: int = 8
    budget_uniform_steps: int = 250  # budget = this many full batches at the mean rollout length
    removed_from: float = 0.35
    removed_until: float = 0.65
    max_resample_rounds: int = 2  # dapo_filter_only
    charge_probes: bool = True  # probe tokens count against the budget
    layout: Layout = LAYOUT  # the arms and their roles (see LAYOUTS)


@dataclass
class SimRun:
    tokens: np.ndarray  # cumulative tokens after each step (index 0 = start)
    p: np.ndarray  # (steps + 1, K) true success probabilities
    probe_tokens: float
    groups_by_arm: np.ndarray
    weight_rows: list[dict]


def budget_tokens(learner: Learner, s: SimSettings) -> float:
    return float(s.budget_uniform_steps * s.groups_per_step * s.group_size * learner.tokens.mean())


def run(
    sampler_name: str,
    seed: int,
    cfg: CurriculumConfig,
    s: SimSettings,
    log_weights: bool = False,
    static_weights: np.ndarray | None = None,
    noise: int = 0,
) -> SimRun:
    """Drive one sampler against the seed's learner until the token budget is spent
    (`hindsight_static` needs static_weights: one per arm of s.layout, or a (phases, arms) plan).
    `noise` > 0 draws the rewards and probes from another stream: the same learner, a fresh run."""
    learner = make_learner(seed, s.layout)
    rng = np.random.default_rng(20_000 + seed if noise == 0 else [20_000 + seed, int(noise)])
    sizes = {a: int(n) for a, n in zip(learner.arms, learner.data_size, strict=True)}
    sampler: Sampler
    if sampler_name in REFERENCES:
        sampler = REFERENCES[sampler_name](cfg, learner.arms, seed, learner, s, static_weights)
        for a, n in sizes.items():
            sampler.set_data_size(a, n)
    elif sampler_name == ORACLE_PLAN:
        raise ValueError(f"{ORACLE_PLAN} registers on import of posttrain.bench.planning: import it first")
    else:
        sampler = make_sampler(
            cfg.model_copy(update={"sampler": sampler_name}), learner.arms, seed, data_sizes=sizes
        )
    index = {a: i for i, a in enumerate(learner.arms)}
    budget = budget_tokens(learner, s)
    domains = sorted({a.domain for a in learner.arms})
    spent, probe_spent, step = 0.0, 0.0, 0
    tokens_hist, p_hist, rows = [0.0], [learner.p.copy()], []
    groups_by_arm = np.zeros(len(learner.arms))
    removed = False
    while spent < budget:
        frac = spent / budget
        want_removed = s.removed_from <= frac < s.removed_until
        sampler.set_progress(frac)
        if want_removed != removed:
            removed = want_removed
            sampler.set_data_size(REMOVED_ARM, 0 if removed else int(learner.data_size[index[REMOVED_ARM]]))
        to_probe = set(sampler.probe_arms(step))
        if to_probe:
            p = learner.p
            for d in domains:
                members = [i for i, a in enumerate(learner.arms) if a.domain == d]
                m = max(1, cfg.probe_size // len(members))
                for i in (i for i in members if learner.arms[i] in to_probe):
                    sampler.record_probe(step, learner.arms[i], rng.binomial(m, p[i]) / m, n=m)
                    probe_spent += m * learner.tokens[i]
                    spent += m * learner.tokens[i] if s.charge_probes else 0.0
        arms = sampler.sample(s.groups_per_step)
        idx = np.array([index[a] for a in arms])
        rewards = (rng.random((len(idx), s.group_size)) < learner.p[idx, None]).astype(np.float64)
        gen_idx, gen_rewards = [idx], [rewards]
        if sampler.filters_groups:
            keep = np.array(sampler.filter_groups(rewards.tolist()))
            kept_idx, kept_rewards = idx[keep], rewards[keep]
            for _ in range(s.max_resample_rounds):
                missing = s.groups_per_step - len(kept_idx)
                if missing <= 0:
                    break
                more = np.array([index[a] for a in sampler.sample(missing)])
                more_r = (rng.random((missing, s.group_size)) < learner.p[more, None]).astype(np.float64)
                gen_idx.append(more)
                gen_rewards.append(more_r)
                k2 = np.array(sampler.filter_groups(more_r.tolist()))
                kept_idx = np.concatenate([kept_idx, more[k2]])
                kept_rewards = np.concatenate([kept_rewards, more_r[k2]])
        else:
            kept_idx, kept_rewards = idx, rewards
        all_idx, all_rewards = np.concatenate(gen_idx), np.concatenate(gen_rewards)
        spent += float(learner.tokens[all_idx].sum() * s.group_size)
        by_arm: dict[int, list[list[float]]] = defaultdict(list)
        for i, r in zip(all_idx.tolist(), all_rewards.tolist(), strict=True):
            by_arm[i].append(r)
        for i in sorted(by_arm):
            sampler.update(
                step, learner.arms[i], by_arm[i], tokens=learner.tokens[i] * s.group_size * len(by_arm[i])
            )
        np.add.at(groups_by_arm, all_idx, 1)
        learner.train(kept_idx, kept_rewards)
        step += 1
        tokens_hist.append(spent)
        p_hist.append(learner.p.copy())
        if log_weights:
            rows.append({"step": step, **{k: v for k, v in sampler.signals().items() if "/weight/" in k}})
    return SimRun(np.array(tokens_hist), np.array(p_hist), probe_spent, groups_by_arm, rows)
