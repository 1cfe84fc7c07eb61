"""The curriculum samplers: which (domain, difficulty) arm the next groups come from, and which prompt.

Owns every sampler's state (per-arm counts, learnability EMA, probe scores, per-prompt success
records, the RNG), its JSON round trip, and the registry behind `make_sampler`. It does not run
rollouts, evaluate probes or touch tensors: the RL loop feeds it rewards and probe scores.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from posttrain.config import CurriculumConfig
from posttrain.curriculum.arms import Arm, arm_from_key, check_arms
from posttrain.curriculum.policy import (
    adaptive_policy,
    bounded_renormalise,
    group_abs_dev,
    grpo_abs_advantages,
    raised_replay_fraction,
    softmax,
)

STATE_VERSION = (
    3  # 3: adaptive's success-rate EMAs and probe counts (a version-2 state loads with them empty)
)

SAMPLERS: dict[str, type[Sampler]] = {}


def register_sampler(name: str) -> Callable[[type[Sampler]], type[Sampler]]:
    def deco(cls: type[Sampler]) -> type[Sampler]:
        cls.name = name
        SAMPLERS[name] = cls
        return cls

    return deco


def check_config(cfg: CurriculumConfig) -> None:
    """Re-check the numbers a sampler depends on (a config built with model_construct skips pydantic)."""
    if not isinstance(cfg, CurriculumConfig):
        raise ValueError(f"make_sampler needs a CurriculumConfig, got {type(cfg).__name__}")
    checks = [
        ("eps", 0.0 <= cfg.eps <= 1.0, "in [0, 1]"),
        ("eps_end", cfg.eps_end is None or 0.0 <= cfg.eps_end <= 1.0, "in [0, 1] or None"),
        ("domain_mix", 0.0 <= cfg.domain_mix <= 1.0, "in [0, 1]"),
        ("alpha", 0.0 < cfg.alpha <= 1.0, "in (0, 1]"),
        ("tau", cfg.tau > 0.0, "> 0"),
        ("c", cfg.c >= 0.0, ">= 0"),
        ("lam", cfg.lam >= 0.0, ">= 0"),
        ("forget_z", cfg.forget_z >= 0.0, ">= 0"),
        ("max_share", 0.0 < cfg.max_share <= 1.0, "in (0, 1]"),
        ("probe_every", cfg.probe_every >= 0, ">= 0 (0 = no probes)"),
        ("probe_size", cfg.probe_size >= 1, ">= 1"),
        ("replay_rate", 0.0 <= cfg.replay_rate <= 1.0, "in [0, 1]"),
        ("mastered_p", 0.0 < cfg.mastered_p <= 1.0, "in (0, 1]"),
        ("sec_alpha", 0.0 < cfg.sec_alpha <= 1.0, "in (0, 1]"),
        ("sec_tau", cfg.sec_tau > 0.0, "> 0"),
        ("dump_window", cfg.dump_window >= 1, ">= 1"),
        ("dump_tau", cfg.dump_tau > 0.0, "> 0"),
        ("lp_weight", cfg.lp_weight >= 0.0, ">= 0"),
        ("lp_fast", 0.0 < cfg.lp_fast <= 1.0, "in (0, 1]"),
        ("lp_slow", 0.0 < cfg.lp_slow < cfg.lp_fast, f"in (0, lp_fast = {cfg.lp_fast})"),
        ("probe_skip_rollouts", cfg.probe_skip_rollouts >= 0, ">= 0 (0 = never skip)"),
    ]
    for key, ok, want in checks:
        value = getattr(cfg, key)
        if not (ok and (value is None or math.isfinite(float(value)))):
            raise ValueError(f"curriculum.{key} must be {want}, got {value!r}")
    if cfg.sampler not in SAMPLERS:
        raise ValueError(
            f"curriculum.sampler '{cfg.sampler}' is unknown; choose one of: {', '.join(SAMPLERS)}"
        )


def _check_domain_weights(weights: dict[str, float] | None, domains: list[str]) -> dict[str, float]:
    """Every domain's prior weight (1 when not given); ValueError for an unknown domain or a weight <= 0."""
    weights = dict(weights or {})
    unknown = sorted(set(weights) - set(domains))
    if unknown:
        raise ValueError(
            f"domain weights name {unknown}, which this curriculum lacks (its domains: {domains})"
        )
    out = {}
    for d in domains:
        w = float(weights.get(d, 1.0))
        if not (math.isfinite(w) and w > 0):
            raise ValueError(
                f"the weight of domain '{d}' must be a finite number > 0, got {weights.get(d)!r}"
            )
        out[d] = w
    return out


def _with_prior(pi: np.ndarray, prior: np.ndarray | None) -> np.ndarray:
    """pi * prior, renormalised (pi itself when there is no prior)."""
    if prior is None:
        return pi
    q = pi * prior
    return q / q.sum()


def _as_int(value: object, what: str, minimum: int = 0) -> int:
    """Accept Python and numpy integers (not bools or floats) at or above minimum."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_groups(arm: Arm, group_rewards: Sequence[Sequence[float]]) -> list[list[float]]:
    if isinstance(group_rewards, str | bytes) or not isinstance(group_rewards, Sequence):
        raise ValueError(f"group_rewards for {arm.key} must be a list of groups (lists of rewards)")
    out = []
    for i, g in enumerate(group_rewards):
        if isinstance(g, str | bytes) or not isinstance(g, Sequence) or len(g) == 0:
            raise ValueError(f"group {i} for {arm.key} must be a non-empty list of rewards, got {g!r}")
        vals = [float(r) for r in g]
        if not all(math.isfinite(v) for v in vals):
            raise ValueError(f"group {i} for {arm.key} has a non-finite reward: {vals}")
        out.append(vals)
    return out


class Sampler:
    """Shared state and bookkeeping; subclasses define `_policy` (and may observe groups)."""

    name = "base"
    uses_probes = False  # only samplers whose rule reads forgetting ask for probes
    filters_groups = False  # dapo_filter_only: the loop drops all-equal groups and resamples

    def __init__(
        self,
        cfg: CurriculumConfig,
        arms: Sequence[Arm],
        seed: int,
        domain_weights: dict[str, float] | None = None,
    ):
        self.cfg = cfg
        self.arms = check_arms(arms)
        self._index = {a: i for i, a in enumerate(self.arms)}
        self.domains = sorted({a.domain for a in self.arms})
        self.domain_weights = _check_domain_weights(domain_weights, self.domains)
        # per-arm prior (its domain's weight), None when every domain weighs the same: the rules' plain form
        w = [self.domain_weights[a.domain] for a in self.arms]
        self._prior = None if len(set(w)) <= 1 else np.array(w, dtype=np.float64)
        self.seed = int(seed)
        self._rng = np.random.Generator(np.random.PCG64(self.seed))
        k = len(self.arms)
        self._s: dict[str, Any] = {
            "n_groups": [0] * k,
            "n_rollouts": [0] * k,
            "dev_ema": [None] * k,  # EMA of per-update mean |r - group mean|, in reward units
            "probe_best": [None] * k,
            "probe_last": [None] * k,
            "probe_best_n": [None] * k,  # prompts behind the best / latest probe score (their standard error)
            "probe_last_n": [None] * k,
            "data_size": [None] * k,  # None = unknown (available), 0 = no data now
            "prompts": [{} for _ in range(k)],  # prompt_id -> [n rewards, sum of range-normalised rewards]
            "reward_lo": {d: 0.0 for d in self.domains},  # running reward range per domain, starts at [0, 1]
            "reward_hi": {d: 1.0 for d in self.domains},
            "tokens": [[0.0, 0] for _ in range(k)],  # [tokens reported by update, rollouts they cover]
            "last_step": None,
            "progress": 0.0,  # the run's spent share, from set_progress
            "retention": {},  # retention suite key -> [paired delta from the initial policy, its SE]
        }
        self._init_extra(k)

    # -- hooks for subclasses --------------------------------------------------------------------

    def _init_extra(self, k: int) -> None:
        pass

    def _observe(self, i: int, groups: list[list[float]]) -> None:
        pass

    def _policy(self, avail: np.ndarray) -> np.ndarray:
        """Weights over the available arms `avail` (indices), summing to 1."""
        raise NotImplementedError

    # -- lookups ----------------------------------------------------------------------------------

    def _idx(self, arm: object) -> int:
        if isinstance(arm, tuple) and len(arm) == 2:
            a = Arm(*arm)
            if a in self._index:
                return self._index[a]
            if a.domain not in self.domains:
                raise ValueError(
                    f"unknown domain '{a.domain}' in arm {a!r}; this curriculum has domains {self.domains}"
                )
            levels = sorted(x.difficulty for x in self.arms if x.domain == a.domain)
            raise ValueError(f"unknown arm {a.key}: domain '{a.domain}' has difficulties {levels}")
        raise ValueError(f"{arm!r} is not an arm (domain, difficulty)")

    def _available(self) -> np.ndarray:
        return np.array([i for i, n in enumerate(self._s["data_size"]) if n != 0], dtype=np.int64)

    def _scale(self, domain: str) -> float:
        return self._s["reward_hi"][domain] - self._s["reward_lo"][domain]

    def _widen_range(self, domain: str, rewards: Sequence[float]) -> None:
        if rewards:
            self._s["reward_lo"][domain] = min(self._s["reward_lo"][domain], min(rewards))
            self._s["reward_hi"][domain] = max(self._s["reward_hi"][domain], max(rewards))

    def learnability(self) -> np.ndarray:
        """L_k = EMA of mean |r - group mean| / the domain's running reward range; 0 before any group."""
        return np.array(
            [
                0.0 if e is None else e / self._scale(a.domain)
                for a, e in zip(self.arms, self._s["dev_ema"], strict=True)
            ]
        )

    def forgetting(self) -> np.ndarray:
        """F_k = max(0, best - latest - forget_z * SE(best - latest)); 0 before any probe.

        Both scores are means over n probe prompts, so their difference has standard error
        sqrt(b(1-b)/n_b + c(1-c)/n_c) (scores in [0, 1], each shrunk as (x*n + 1)/(n + 2) so a 0 or 1
        still has spread). A drop smaller than forget_z standard errors is probe noise, not forgetting:
        with 64 prompts a probe's own noise is ~0.06, and the running best of noisy scores sits above
        the truth, so the plain difference (forget_z = 0) reads noise as forgetting on every arm.
        """
        out = np.zeros(len(self.arms))
        z = self.cfg.forget_z
        for i, (b, c) in enumerate(zip(self._s["probe_best"], self._s["probe_last"], strict=True)):
            if b is None:
                continue
            nb = self._s["probe_best_n"][i] or self.cfg.probe_size
            nc = self._s["probe_last_n"][i] or self.cfg.probe_size
            se = 0.0
            if z > 0:
                sb, sc = (
                    (min(max(b, 0.0), 1.0) * nb + 1) / (nb + 2),
                    (min(max(c, 0.0), 1.0) * nc + 1) / (nc + 2),
                )
                se = math.sqrt(sb * (1 - sb) / nb + sc * (1 - sc) / nc)
            out[i] = max(0.0, b - c - z * se)
        protect = self._retention_by_domain()
        for i, a in enumerate(self.arms):
            out[i] = max(out[i], protect.get(a.domain, 0.0))
        return out

    def record_retention(self, suite: str, delta: float, se: float) -> None:
        """A retention suite's paired delta from the initial policy (mean over its held-out tasks) and
        that delta's standard error. A suite is a `domain:level` key outside the arms: one of a trained
        domain at an untrained level pulls share back toward that domain's arms (see forgetting); any
        falling suite raises the replay fraction (`replay_fraction`)."""
        arm_from_key(suite)  # a ValueError naming a malformed key
        delta, se = float(delta), float(se)
        if not (math.isfinite(delta) and math.isfinite(se) and se >= 0):
            raise ValueError(
                f"record_retention({suite}): delta and se must be finite with se >= 0, got {delta}, {se}"
            )
        if any(a.key == suite for a in self.arms):
            raise ValueError(f"record_retention: {suite} is an arm of this curriculum, not a retention suite")
        self._s["retention"][suite] = [delta, se]

    def retention_forgetting(self) -> dict[str, float]:
        """Each retention suite's forgetting: max(0, -delta - forget_z * SE), its drop from the initial
        policy beyond forget_z standard errors (0 for a suite that held or rose)."""
        z = self.cfg.forget_z
        return {k: max(0.0, -d - z * se) for k, (d, se) in self._s["retention"].items()}

    def _retention_by_domain(self) -> dict[str, float]:
        """The largest retention forgetting of each trained domain's suites (its other levels)."""
        out: dict[str, float] = {}
        for key, f in self.retention_forgetting().items():
            domain = arm_from_key(key).domain
            if domain in self.domains:
                out[domain] = max(out.get(domain, 0.0), f)
        return out

    def replay_fraction(self, base: float, gain: float) -> float:
        """The replay fraction to use now: min(1, base + gain x the largest retention suite forgetting)."""
        return raised_replay_fraction(base, gain, list(self.retention_forgetting().values()))

    # -- the API the RL loop uses -----------------------------------------------------------------

    def weights(self) -> dict[Arm, float]:
        """Current sampling distribution over all arms (0 for arms whose data is unavailable)."""
        return dict(zip(self.arms, self._weight_vector().tolist(), strict=True))

    def _weight_vector(self) -> np.ndarray:
        avail = self._available()
        w = np.zeros(len(self.arms))
        if len(avail):
            w[avail] = self._policy(avail)
        return w

    def sample(self, n: int) -> list[Arm]:
        """Arms for the next n groups: systematic sampling of n points through the weights' CDF (so
        counts are within one of n*pi_k), in a random order. Deterministic given seed and history."""
        n = _as_int(n, "sample(n): n")
        w = self._weight_vector()
        if w.sum() <= 0:
            raise ValueError("no arm has data: every arm was given data size 0 (see set_data_size)")
        if n == 0:
            return []
        fixed = self._covered(n)
        idx = np.concatenate([fixed, self._systematic(w, n - len(fixed))]).astype(np.int64)
        idx = self._rng.permutation(idx)
        return [self.arms[int(i)] for i in idx]

    def _covered(self, n: int) -> np.ndarray:
        """Arms that get one group of an n-group batch before the weights are sampled (none by default)."""
        return np.zeros(0, dtype=np.int64)

    def _systematic(self, w: np.ndarray, n: int) -> np.ndarray:
        """n arm indices by systematic sampling through the CDF of w (counts within one of n*w_k)."""
        if n <= 0:
            return np.zeros(0, dtype=np.int64)
        cdf = np.cumsum(w / w.sum())
        points = (self._rng.random() + np.arange(n)) / n
        idx = np.searchsorted(cdf, points, side="right")
        last_positive = int(np.flatnonzero(w > 0)[-1])
        return np.minimum(idx, last_positive)

    def set_progress(self, fraction: float) -> None:
        """The share of the run spent so far, in [0, 1] (steps or tokens, whichever is further along);
        the loop reports it before each batch. Rules with a schedule (adaptive's eps_end, domain_mix)
        read it; the others ignore it."""
        f = float(fraction)
        if not (math.isfinite(f) and 0.0 <= f <= 1.0):
            raise ValueError(f"set_progress: the run's spent share must be in [0, 1], got {fraction!r}")
        self._s["progress"] = f

    @property
    def progress(self) -> float:
        return float(self._s["progress"])

    def update(
        self, step: int, arm: Arm, group_rewards: Sequence[Sequence[float]], tokens: float | None = None
    ) -> None:
        """Feed the groups arm produced at `step` (one inner list per group, all rewards of one prompt).
        Call once per arm per step with all of that arm's groups: each call is one EMA step.
        `tokens`: the tokens those groups' rollouts generated in all (optional; `adaptive` with
        cost_aware weighs arms by their mean tokens per rollout)."""
        i = self._idx(arm)
        step = _as_int(step, "update: step")
        groups = _check_groups(self.arms[i], group_rewards)
        if tokens is not None:
            tokens = float(tokens)
            if not (math.isfinite(tokens) and tokens > 0):
                raise ValueError(
                    f"update({self.arms[i].key}): tokens must be a finite number > 0, got {tokens}"
                )
        if not groups:
            return
        if tokens is not None:
            self._s["tokens"][i][0] += tokens
            self._s["tokens"][i][1] += sum(len(g) for g in groups)
        self._widen_range(self.arms[i].domain, [r for g in groups for r in g])
        x = float(np.mean([group_abs_dev(g) for g in groups]))
        prev = self._s["dev_ema"][i]
        self._s["dev_ema"][i] = x if prev is None else (1.0 - self.cfg.alpha) * prev + self.cfg.alpha * x
        self._s["n_groups"][i] += len(groups)
        self._s["n_rollouts"][i] += sum(len(g) for g in groups)
        self._s["last_step"] = step
        self._observe(i, groups)

    def set_data_size(self, arm: Arm, n_prompts: int) -> None:
        """Tell the sampler how many prompts an arm has now; 0 removes it from sampling until restored.
        `uniform_by_data` weighs arms by these sizes (unknown sizes count as the mean known size)."""
        i = self._idx(arm)
        self._s["data_size"][i] = _as_int(n_prompts, f"set_data_size({self.arms[i].key}): n_prompts")

    def probe_due(self, step: int) -> bool:
        """True on steps where the loop should run retention probes (every probe_every steps, from 0,
        for samplers whose rule uses forgetting) and at least one arm needs one (see probe_arms)."""
        return bool(self.probe_arms(step))

    def probe_arms(self, step: int) -> list[Arm]:
        """The arms to probe at `step`: every arm on probe steps (every probe_every steps, from 0) of a
        sampler whose rule uses forgetting, none otherwise. `adaptive` may skip arms whose training
        groups already measured them (curriculum.probe_skip_rollouts)."""
        step = _as_int(step, "probe_arms: step")
        if not (self.uses_probes and self.cfg.probe_every > 0 and step % self.cfg.probe_every == 0):
            return []
        return list(self.arms)

    def record_probe(self, step: int, arm: Arm, score: float, n: int | None = None) -> None:
        """A held-out probe score for an arm (e.g. greedy accuracy on its share of the domain's probe),
        the mean over `n` prompts (None: curriculum.probe_size); n sets the score's standard error."""
        i = self._idx(arm)
        score = float(score)
        if not math.isfinite(score):
            raise ValueError(f"record_probe({self.arms[i].key}): score must be finite, got {score}")
        n = self.cfg.probe_size if n is None else _as_int(n, f"record_probe({self.arms[i].key}): n", 1)
        best = self._s["probe_best"][i]
        if best is None or score >= best:
            self._s["probe_best"][i], self._s["probe_best_n"][i] = score, n
        self._s["probe_last"][i], self._s["probe_last_n"][i] = score, n

    def record_prompt(self, arm: Arm, prompt_id: str, rewards: Sequence[float]) -> None:
        """Rewards observed for one prompt of an arm; they set that prompt's observed success rate."""
        i = self._idx(arm)
        vals = _check_groups(self.arms[i], [rewards])[0]
        domain = self.arms[i].domain
        self._widen_range(domain, vals)
        lo, scale = self._s["reward_lo"][domain], self._scale(domain)
        rec = self._s["prompts"][i].setdefault(str(prompt_id), [0, 0.0])
        rec[0] += len(vals)
        rec[1] += sum((v - lo) / scale for v in vals)

    def choose_prompt(self, arm: Arm, candidates: Sequence[str]) -> str:
        """Pick one prompt id of an arm.

        With probability replay_rate (when any candidate is mastered: observed success >= mastered_p)
        a mastered prompt, uniformly. Otherwise Thompson sampling on p(1-p): each remaining candidate
        draws p ~ Beta(1 + successes, 1 + failures) (range-normalised rewards), the largest p(1-p)
        wins. Unseen prompts have the uniform prior (unknown), so they are explored; prompts observed
        near p = 0.5 win most often; all-fail and all-pass prompts rarely.
        """
        i = self._idx(arm)
        if isinstance(candidates, str) or len(candidates) == 0:
            raise ValueError(
                f"choose_prompt({self.arms[i].key}): candidates must be a non-empty list of prompt ids"
            )
        stats = self._s["prompts"][i]
        n = np.array([stats.get(str(c), [0, 0.0])[0] for c in candidates], dtype=np.float64)
        s = np.array([stats.get(str(c), [0, 0.0])[1] for c in candidates], dtype=np.float64)
        mean = np.divide(s, n, out=np.zeros_like(s), where=n > 0)
        mastered = (n > 0) & (mean >= self.cfg.mastered_p)
        if mastered.any() and self._rng.random() < self.cfg.replay_rate:
            pick = np.flatnonzero(mastered)
            return candidates[int(pick[self._rng.integers(len(pick))])]
        pool = np.flatnonzero(~mastered) if not mastered.all() else np.arange(len(candidates))
        p = self._rng.beta(1.0 + s[pool], 1.0 + np.maximum(n[pool] - s[pool], 0.0))
        return candidates[int(pool[int(np.argmax(p * (1.0 - p)))])]

    @staticmethod
    def filter_groups(group_rewards: Sequence[Sequence[float]]) -> list[bool]:
        """DAPO dynamic sampling: keep a group unless all its rewards are equal (zero advantage)."""
        keep = []
        for i, g in enumerate(group_rewards):
            if isinstance(g, str | bytes) or not isinstance(g, Sequence) or len(g) == 0:
                raise ValueError(f"filter_groups: group {i} must be a non-empty list of rewards, got {g!r}")
            keep.append(max(g) - min(g) > 1e-12)
        return keep

    def signals(self) -> dict[str, float]:
        """Flat per-arm and per-domain figures for the metric log (keys like curriculum/weight/math:0)."""
        w = self._weight_vector()
        L, F = self.learnability(), self.forgetting()
        out: dict[str, float] = {"curriculum/total_groups": float(sum(self._s["n_groups"]))}
        for i, a in enumerate(self.arms):
            out[f"curriculum/weight/{a.key}"] = float(w[i])
            out[f"curriculum/L/{a.key}"] = float(L[i])
            out[f"curriculum/F/{a.key}"] = float(F[i])
            out[f"curriculum/groups/{a.key}"] = float(self._s["n_groups"][i])
        for key, f in self.retention_forgetting().items():
            out[f"curriculum/retention_F/{key}"] = f
        for d in self.domains:
            out[f"curriculum/domain_share/{d}"] = float(
                sum(w[i] for i, a in enumerate(self.arms) if a.domain == d)
            )
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: counts, signals, prompt records and the RNG, for exact resume."""
        return {
            "version": STATE_VERSION,
            "sampler": self.name,
            "arms": [a.key for a in self.arms],
            "seed": self.seed,
            "rng": copy.deepcopy(self._rng.bit_generator.state),
            "stats": copy.deepcopy(self._s),
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if not isinstance(d, dict) or d.get("version") not in (2, STATE_VERSION):
            got = d.get("version") if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"curriculum state: expected version {STATE_VERSION}, got {got!r}")
        if d.get("sampler") != self.name:
            raise ValueError(
                f"curriculum state was saved by sampler '{d.get('sampler')}', this is '{self.name}'"
            )
        keys = [a.key for a in self.arms]
        if d.get("arms") != keys:
            raise ValueError(f"curriculum state has arms {d.get('arms')}, this sampler has {keys}")
        stats = copy.deepcopy(d["stats"])
        stats.setdefault("progress", 0.0)  # saved before set_progress existed: a run's start
        stats.setdefault("retention", {})  # saved before retention suites fed the sampler: none heard
        if d["version"] == 2:  # the signals added in version 3 start empty, as in a fresh sampler
            fresh = type(self)(self.cfg, self.arms, 0)._s
            stats = {**{k: v for k, v in fresh.items() if k not in stats}, **stats}
        missing = set(self._s) - set(stats)
        if missing:
            raise ValueError(f"curriculum state lacks {sorted(missing)}")
        rng = np.random.Generator(np.random.PCG64())
        rng.bit_generator.state = copy.deepcopy(d["rng"])
        self._rng, self._s, self.seed = rng, stats, int(d["seed"])


@register_sampler("adaptive")
class AdaptiveSampler(Sampler):
    """Learnability + UCB exploration + forgetting (+ optional learning progress); see
    `policy.adaptive_policy` and the package docstring.

    Besides the base counts it keeps, per arm, two EMAs of the success rate of its training updates
    (mean range-normalised reward; rates lp_fast and lp_slow) with their variances. They give
      LP_k      = max(0, |fast - slow| - forget_z * SE), the TSCL learning-progress signal (a too-hard arm
                  that starts to move, or a sampled arm that slips, gains share; weight lp_weight);
      F_train_k = max(0, best slow EMA so far - current slow EMA - forget_z * SE) when
                  train_retention: forgetting read for free from the arm's own training groups;
                  F_k = max(F_probe_k, F_train_k).
    SE is the standard error of the difference from the EMAs' variances (each update's variance
    taken as s(1-s)/n, the bound for rewards in [0, 1], s shrunk as (m*n+1)/(n+2)).

    Which rewards count: once the loop reports prompts (record_prompt) for an arm, only the rewards of
    prompts seen for the first time, since re-used prompts are picked by choose_prompt for being
    near p = 0.5 (and mastered ones are left out), so their success rate says little about the
    arm's; fresh prompts are an unbiased sample of it. An update with no fresh prompt leaves the
    EMAs as they were. Without record_prompt calls (the simulator) every group counts.
    """

    uses_probes = True

    def _init_extra(self, k: int) -> None:
        self._s["succ_fast"] = [None] * k  # [EMA, its variance]
        self._s["succ_slow"] = [None] * k
        self._s["succ_best"] = [None] * k  # [best slow EMA so far, its variance then]
        self._s["since_probe"] = [0] * k  # training rollouts since the arm's last probe
        self._s["fresh"] = [
            None
        ] * k  # None: no prompts reported; else rewards of new prompts since the last update

    def record_prompt(self, arm: Arm, prompt_id: str, rewards: Sequence[float]) -> None:
        i = self._idx(arm)
        new = str(prompt_id) not in self._s["prompts"][i]
        super().record_prompt(arm, prompt_id, rewards)
        if self._s["fresh"][i] is None:
            self._s["fresh"][i] = []
        if new:
            self._s["fresh"][i].extend(float(r) for r in rewards)

    def _observe(self, i: int, groups: list[list[float]]) -> None:
        domain = self.arms[i].domain
        lo, scale = self._s["reward_lo"][domain], self._scale(domain)
        if self._s["fresh"][i] is None:
            raw = [r for g in groups for r in g]
        else:
            raw, self._s["fresh"][i] = self._s["fresh"][i], []
        vals = [(r - lo) / scale for r in raw]
        n = len(vals)
        if n == 0:
            return
        m = float(np.mean(vals))
        sh = (m * n + 1.0) / (n + 2.0)
        v = sh * (1.0 - sh) / n
        for key, rate in (("succ_fast", self.cfg.lp_fast), ("succ_slow", self.cfg.lp_slow)):
            prev = self._s[key][i]
            if prev is None:
                self._s[key][i] = [m, v]
            else:
                self._s[key][i] = [
                    (1.0 - rate) * prev[0] + rate * m,
                    (1.0 - rate) ** 2 * prev[1] + rate**2 * v,
                ]
        slow = self._s["succ_slow"][i]
        best = self._s["succ_best"][i]
        if best is None or slow[0] >= best[0]:
            self._s["succ_best"][i] = list(slow)
        self._s["since_probe"][i] += n

    def record_probe(self, step: int, arm: Arm, score: float, n: int | None = None) -> None:
        super().record_probe(step, arm, score, n)
        self._s["since_probe"][self._idx(arm)] = 0

    def probe_arms(self, step: int) -> list[Arm]:
        """Probe-step arms, less those whose training groups gave at least probe_skip_rollouts rollouts
        since their last probe (their success rate is measured already); probe_skip_rollouts = 0
        probes every arm."""
        arms = super().probe_arms(step)
        skip = self.cfg.probe_skip_rollouts
        if skip <= 0:
            return arms
        return [a for a in arms if self._s["since_probe"][self._index[a]] < skip]

    def _covered(self, n: int) -> np.ndarray:
        """cover_batch: every available arm gets one group when the batch has room for all of them."""
        avail = self._available()
        if self.cfg.cover_batch and n >= len(avail):
            return avail
        return np.zeros(0, dtype=np.int64)

    def learning_progress(self) -> np.ndarray:
        """LP_k = max(0, |fast - slow| - forget_z * SE(fast - slow)); 0 before any group."""
        out = np.zeros(len(self.arms))
        z = self.cfg.forget_z
        for i, (f, s) in enumerate(zip(self._s["succ_fast"], self._s["succ_slow"], strict=True)):
            if f is not None:
                out[i] = max(0.0, abs(f[0] - s[0]) - z * math.sqrt(f[1] + s[1]))
        return out

    def forgetting(self) -> np.ndarray:
        """F_k = the probe drop (see Sampler.forgetting), or with train_retention the larger of it and
        the drop of the slow training success EMA below its best, beyond forget_z standard errors."""
        out = super().forgetting()
        if not self.cfg.train_retention:
            return out
        z = self.cfg.forget_z
        for i, (b, s) in enumerate(zip(self._s["succ_best"], self._s["succ_slow"], strict=True)):
            if b is not None:
                out[i] = max(out[i], b[0] - s[0] - z * math.sqrt(b[1] + s[1]))
        return out

    def signals(self) -> dict[str, float]:
        out = super().signals()
        lp = self.learning_progress()
        for i, a in enumerate(self.arms):
            out[f"curriculum/LP/{a.key}"] = float(lp[i])
        return out

    def scheduled(self) -> tuple[float, float]:
        """(eps, domain_mix) at the run's progress f: eps + (eps_end - eps) * f and domain_mix * f."""
        cfg, f = self.cfg, self.progress
        eps = cfg.eps if cfg.eps_end is None else cfg.eps + (cfg.eps_end - cfg.eps) * f
        return eps, cfg.domain_mix * f

    def _policy(self, avail: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        eps, mix = self.scheduled()
        counts = np.array(self._s["n_groups"], dtype=np.float64)
        pi, _ = adaptive_policy(
            self.learnability()[avail],
            counts[avail],
            int(sum(self._s["n_groups"])),
            self.forgetting()[avail],
            c=cfg.c,
            lam=cfg.lam,
            tau=cfg.tau,
            eps=eps,
            max_share=cfg.max_share,
            progress=self.learning_progress()[avail],
            mu=cfg.lp_weight,
            headroom=self.weakness()[avail],
            nu=cfg.weakness,
            cost=self.relative_cost()[avail] if cfg.cost_aware else None,
            prior=None if self._prior is None else self._prior[avail],
        )
        if mix <= 0.0:
            return pi
        blended = (1.0 - mix) * pi + mix * _uniform_by_domain(self.arms, avail, self.domain_weights)
        return bounded_renormalise(blended, eps / len(avail), max(cfg.max_share, 1.0 / len(avail)))

    def weakness(self) -> np.ndarray:
        """W_k = 1 - the arm's slow success EMA (its headroom); 0 before any group."""
        return np.array([0.0 if e is None else 1.0 - min(max(e[0], 0.0), 1.0) for e in self._s["succ_slow"]])

    def relative_cost(self) -> np.ndarray:
        """Mean tokens per rollout of each arm over the mean of the arms that reported any (update's
        `tokens`); 1 for an arm with no report yet."""
        tok = self._s["tokens"]
        per = np.array([t / n if n > 0 else np.nan for t, n in tok])
        if np.all(np.isnan(per)):
            return np.ones(len(self.arms))
        return np.where(np.isnan(per), 1.0, per / np.nanmean(per))


def _uniform_by_domain(
    arms: list[Arm], avail: np.ndarray, weights: dict[str, float] | None = None
) -> np.ndarray:
    """Each available domain's share in proportion to its weight (equal without weights), split evenly
    over its available difficulties."""
    domains = sorted({arms[i].domain for i in avail})
    per_domain = {d: sum(1 for i in avail if arms[i].domain == d) for d in domains}
    if weights is None or len({weights[d] for d in domains}) <= 1:
        return np.array([1.0 / len(domains) / per_domain[arms[i].domain] for i in avail])
    total = sum(weights[d] for d in domains)
    return np.array([weights[arms[i].domain] / total / per_domain[arms[i].domain] for i in avail])


@register_sampler("uniform_by_domain")
class UniformByDomain(Sampler):
    """Each domain with data gets a share in proportion to its weight (envs.domains[].weight; equal by
    default), split evenly over its difficulties (ROLL-style static)."""

    def _policy(self, avail: np.ndarray) -> np.ndarray:
        return _uniform_by_domain(self.arms, avail, self.domain_weights)


@register_sampler("uniform_by_data")
class UniformByData(Sampler):
    """Shares proportional to each arm's prompt count (set_data_size); unknown counts use the mean known."""

    def _policy(self, avail: np.ndarray) -> np.ndarray:
        sizes = [self._s["data_size"][i] for i in avail]
        known = [s for s in sizes if s is not None]
        fill = float(np.mean(known)) if known else 1.0
        w = np.array([fill if s is None else float(s) for s in sizes])
        return _with_prior(w / w.sum(), None if self._prior is None else self._prior[avail])


@register_sampler("dapo_filter_only")
class DapoFilterOnly(UniformByDomain):
    """uniform_by_domain weights plus DAPO dynamic sampling (the loop drops all-equal groups and
    resamples), so its difference to uniform_by_domain is the filter alone."""

    filters_groups = True


@register_sampler("sec")
class SecSampler(Sampler):
    """Self-Evolving Curriculum (Chen et al. 2025): Q_k <- sec_alpha * r + (1 - sec_alpha) * Q_k with r
    the mean GRPO |advantage| of the arm's rollouts this update (TD(0) on a one-state bandit);
    pi = softmax(Q / sec_tau) over arms. Q starts at 0; no floor, no forgetting term."""

    def _init_extra(self, k: int) -> None:
        self._s["sec_q"] = [0.0] * k

    def _observe(self, i: int, groups: list[list[float]]) -> None:
        r = float(np.mean(np.concatenate([grpo_abs_advantages(g) for g in groups])))
        a = self.cfg.sec_alpha
        self._s["sec_q"][i] = a * r + (1.0 - a) * self._s["sec_q"][i]

    def _policy(self, avail: np.ndarray) -> np.ndarray:
        pi = softmax(np.array(self._s["sec_q"])[avail] / self.cfg.sec_tau)
        return _with_prior(pi, None if self._prior is None else self._prior[avail])


@register_sampler("dump")
class DumpSampler(Sampler):
    """DUMP (Wang et al. 2025): UCB_k = mean of the last dump_window GRPO |advantage| values of arm k
    + sqrt(2 ln(N + 1) / (n_k + 1)) with n counted in rollouts (the +1s keep unseen arms finite);
    pi = softmax(UCB / dump_tau)."""

    def _init_extra(self, k: int) -> None:
        self._s["dump_window"] = [[] for _ in range(k)]

    def _observe(self, i: int, groups: list[list[float]]) -> None:
        win = self._s["dump_window"][i]
        win.extend(float(v) for g in groups for v in grpo_abs_advantages(g))
        del win[: max(0, len(win) - self.cfg.dump_window)]

    def _policy(self, avail: np.ndarray) -> np.ndarray:
        n = np.array(self._s["n_rollouts"], dtype=np.float64)
        total = float(n.sum())
        mean_adv = np.array([float(np.mean(w)) if w else 0.0 for w in self._s["dump_window"]])
        ucb = mean_adv + np.sqrt(2.0 * np.log(total + 1.0) / (n + 1.0))
        pi = softmax(ucb[avail] / self.cfg.dump_tau)
        return _with_prior(pi, None if self._prior is None else self._prior[avail])


def make_sampler(
    cfg: CurriculumConfig,
    arms: Sequence[Arm],
    seed: int,
    data_sizes: dict[Arm, int] | None = None,
    domain_weights: dict[str, float] | None = None,
) -> Sampler:
    """Build the sampler named by cfg.sampler; ValueError names a bad setting or a bad arm.
    `domain_weights`: each domain's prior weight (envs.domains[].weight; 1 for a domain not named)."""
    check_config(cfg)
    seed = _as_int(seed, "make_sampler: seed")
    sampler = SAMPLERS[cfg.sampler](cfg, arms, seed, domain_weights)
    for arm, n in (data_sizes or {}).items():
        sampler.set_data_size(arm, n)
    return sampler
