"""Retention suites: held-out tasks of domains and levels outside the training mix (`curriculum.retention`),
scored greedily every `curriculum.retention_every` steps against the initial policy's scores of the
same tasks.

The base scores come from the engine before the first update. They are stored in the run directory
(`retention_base.json`), so a resumed run compares with the same figures rather than recomputing them.
Each suite (a domain, or an entry's `label`, and a level) reports `retention/<suite>:<level>` (strict
accuracy now) and `retention_delta/<suite>:<level>` (the paired difference from the base, over tasks
scored both times), with its 95% paired bootstrap interval as `..._lo` and `..._hi` and its standard
error as `..._se` (what the curriculum's forgetting term reads, `Sampler.record_retention`).
Infrastructure failures are left out of both sides, never scored.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np


def _key(arm: Any) -> str:
    return f"{arm.domain}:{arm.difficulty}"


class RetentionSuites:
    """The suites of a run: their domains, arms, held-out tasks and base scores."""

    def __init__(self, domains: dict[str, Any], arms: list[Any], size: int, seed: int) -> None:
        from posttrain.orchestrator.eval.evaluate import heldout_tasks

        self.domains, self.arms, self.size, self.seed = domains, arms, size, seed
        self.tasks = heldout_tasks(domains, arms, size, seed)
        self.base: dict[str, list[float | None]] | None = None

    @staticmethod
    def check_config(cfg: Any) -> None:
        """The suites' errors before any work (unknown domain or level, a trained suite, no period)."""
        RetentionSuites._arms(cfg)

    @staticmethod
    def _arms(cfg: Any) -> tuple[dict[str, Any], list[Any]]:
        """The run's suites ({} and [] when curriculum.retention is empty): each entry's domain under its
        suite name (its label, else the domain's name) and one arm per level. Refuses what would make a
        suite's figures ambiguous: a suite the run trains (same domain, options and level), a trained
        domain's name with other options and no label, a label that is a domain's name, a name twice."""
        from posttrain.config import suite_overlap
        from posttrain.curriculum import Arm
        from posttrain.envs import get_domain, list_domains

        c = cfg.curriculum
        if not c.retention:
            return {}, []
        if not c.retention_every:
            raise ValueError("curriculum.retention is set but curriculum.retention_every is 0: set how often")
        trained = {d.name: d for d in cfg.envs.domains}
        registered = set(list_domains())
        domains: dict[str, Any] = {}
        arms = []
        for spec in c.retention:
            suite = spec.label or spec.name
            where = f"curriculum.retention: '{suite}'"
            if suite in domains:
                raise ValueError(f"{where} is listed twice: give each entry its own label")
            if spec.label is not None and spec.label in registered:
                raise ValueError(
                    f"{where}: the label is a domain's name; choose another (e.g. '{spec.name}_{spec.label}')"
                )
            trained_levels, needs_label = suite_overlap(spec, cfg.envs.domains)
            if needs_label:
                twin = trained[spec.name]
                raise ValueError(
                    f"{where}: '{spec.name}' is trained with other options ({twin.options or '{}'} in "
                    f"envs.domains, {spec.options or '{}'} here): give this suite a label, so its figures "
                    "are not read as the trained domain's"
                )
            domain = domains[suite] = get_domain(spec.name, **spec.options)
            for lvl in spec.difficulties:
                if lvl not in domain.difficulties:
                    raise ValueError(
                        f"{where} has no difficulty {lvl}; valid levels are {domain.difficulties}"
                    )
                if lvl in trained_levels:
                    raise ValueError(
                        f"curriculum.retention: {spec.name}:{lvl} is in the training mix (envs.domains); "
                        "a retention suite measures what the run does not train"
                    )
                arms.append(Arm(suite, lvl))
        return domains, arms

    @classmethod
    def from_config(cls, cfg: Any) -> RetentionSuites | None:
        """The run's suites, or None when curriculum.retention is empty."""
        domains, arms = cls._arms(cfg)
        return cls(domains, arms, cfg.curriculum.retention_size, cfg.seed) if arms else None

    def score(
        self,
        engine: Any,
        tokenizer: Any,
        sandbox: Any,
        sampling: Any,
        limits: Any,
        loop: asyncio.AbstractEventLoop,
    ) -> tuple[dict[str, list[float | None]], float]:
        """Strict success per task of each suite (None: infrastructure failure), and tokens generated."""
        from posttrain.orchestrator.eval.evaluate import score_tasks

        usage: dict[str, float] = {}
        results = score_tasks(
            engine, tokenizer, self.tasks, sandbox, sampling, limits, 1, self.seed, loop, usage
        )
        out: dict[str, list[float | None]] = {_key(a): [] for a in self.arms}
        for (arm, _, _), episodes in zip(self.tasks, results, strict=True):
            out[_key(arm)].append(float(np.mean([e.success for e in episodes])) if episodes else None)
        return out, usage.get("generated_tokens", 0.0)

    def load_or_score_base(self, path: Path, *score_args: Any) -> float:
        """The base scores from `path` if it holds these suites' (same tasks), else scored now and written
        there; returns the tokens generated (0 when loaded)."""
        from posttrain.orchestrator.eval.evaluate import task_key

        # the tasks themselves: a file scored on other draws (e.g. before repeats were dropped) is rescored
        tasks = hashlib.sha256("".join(task_key(t) for _, _, t in self.tasks).encode()).hexdigest()
        ident = {"suites": [_key(a) for a in self.arms], "size": self.size, "seed": self.seed, "tasks": tasks}
        if path.is_file():
            saved = json.loads(path.read_text())
            if saved.get("ident") == ident:
                self.base = saved["scores"]
                return 0.0
        self.base, tokens = self.score(*score_args)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"ident": ident, "scores": self.base}))
        tmp.replace(path)
        return tokens

    def fell(self, figures: dict[str, float], threshold: float) -> str | None:
        """Why the run must stop (a suite's delta below -threshold, its interval below 0), or None."""
        for arm in self.arms:
            key = f"retention_delta/{_key(arm)}"
            if key in figures and figures[key] < -threshold and figures[f"{key}_hi"] < 0:
                return (
                    f"retention suite {_key(arm)} fell by {-figures[key]:.3f} [{figures[key + '_lo']:+.3f}, "
                    f"{figures[key + '_hi']:+.3f}] from the initial policy, past curriculum.retention_stop="
                    f"{threshold}"
                )
        return None

    def metrics(self, now: dict[str, list[float | None]]) -> dict[str, float]:
        """retention/*, retention_delta/* and its interval, from `now` against the base."""
        from posttrain.orchestrator.eval.evaluate import bootstrap_ci

        assert self.base is not None, "the base scores come first (load_or_score_base)"
        out: dict[str, float] = {}
        for key, scores in now.items():
            seen = [s for s in scores if s is not None]
            out[f"retention/{key}"] = float(np.mean(seen)) if seen else float("nan")
            diffs = [
                a - b for a, b in zip(scores, self.base[key], strict=True) if a is not None and b is not None
            ]
            if diffs:
                lo, hi = bootstrap_ci(np.asarray(diffs, dtype=float), self.seed)
                out[f"retention_delta/{key}"] = float(np.mean(diffs))
                out[f"retention_delta/{key}_lo"] = float(lo)
                out[f"retention_delta/{key}_hi"] = float(hi)
                out[f"retention_delta/{key}_se"] = (
                    float(np.std(diffs, ddof=1) / np.sqrt(len(diffs))) if len(diffs) > 1 else 0.0
                )
        return out


def last_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's latest retention and drift figures from its metric rows, for the eval JSON: per suite
    its accuracy and paired delta with interval at the last step that scored the suites, and the drift
    probe's figures at the last step that measured it; {} when the run logged neither."""
    out: dict[str, Any] = {}
    scored = [r for r in rows if any(str(k).startswith("retention_delta/") for k in r)]
    if scored:
        r = scored[-1]
        suites = sorted(k[len("retention/") :] for k in r if str(k).startswith("retention/"))
        out["retention"] = {
            "step": r["step"],
            "suites": {
                s: {
                    "accuracy": r[f"retention/{s}"],
                    "delta": r.get(f"retention_delta/{s}"),
                    "ci_low": r.get(f"retention_delta/{s}_lo"),
                    "ci_high": r.get(f"retention_delta/{s}_hi"),
                }
                for s in suites
            },
        }
    measured = [r for r in rows if "drift/kl_k3" in r]
    if measured:
        r = measured[-1]
        out["drift"] = {
            "step": r["step"],
            **{k[len("drift/") :]: v for k, v in r.items() if str(k).startswith("drift/")},
        }
    return out
