"""Held-out evaluation: per-domain strict accuracy with 95% bootstrap intervals, unbiased pass@k, and
paired comparison with a baseline model on the same tasks. The policy is our engine, or any
OpenAI-compatible endpoint.

A task's score is strict success: the domain's `success` reward component, or `reward >= 1` when a
domain reports none. The shaped reward and its other components are reported beside it under their own
names, never as accuracy. Infrastructure failures are excluded and counted, never scored 0.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from posttrain.envs.base import stable_hash
from posttrain.rollout import EpisodeLimits, run_episode
from posttrain.rollout.api import api_episode
from posttrain.types import Task

if TYPE_CHECKING:
    from posttrain.engine import Engine

BOOTSTRAP_RESAMPLES = 2000
FULL_REWARD = 1.0 - 1e-9  # a reward this high is full marks (float sums of weights such as 0.85 + 0.15)
ACCURACY_DEFINITION = "strict success per task: rewards['success'], else reward >= 1; mean over samples"


def task_score(rewards: dict[str, float], reward: float) -> float:
    """Strict success of one episode: the domain's `success` component, else 1 only for full reward."""
    if "success" in rewards:
        return float(rewards["success"])
    return 1.0 if reward is not None and reward >= FULL_REWARD else 0.0


@dataclass(frozen=True)
class EpisodeScore:
    """One scored episode: strict success (what accuracy counts), the shaped reward, its other components."""

    success: float
    reward: float
    components: dict[str, float] = field(default_factory=dict)


def episode_score(rewards: dict[str, float], reward: float | None) -> EpisodeScore:
    shaped = float(reward or 0.0)
    parts = {k: float(v) for k, v in rewards.items() if k != "success"}
    return EpisodeScore(task_score(rewards, shaped), shaped, parts)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task from n samples of which c succeeded (Chen et al. 2021):
    1 - C(n-c, k) / C(n, k), the chance that k of the n samples drawn without replacement hold a success."""
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= successes <= samples, got {c} of {n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs at least {k} samples per task, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def parse_pass_at(text: str) -> list[int]:
    """`"1,4,16"` -> [1, 4, 16]; ValueError naming the bad entry."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"--pass-at takes comma-separated integers >= 1 (e.g. 1,4,16), got {part!r}")
        if int(part) not in out:
            out.append(int(part))
    return sorted(out)


def check_pass_at(pass_at: Sequence[int], samples_per_task: int) -> None:
    """ValueError, naming --pass-at and --samples, when some k exceeds the samples drawn per task."""
    if pass_at and max(pass_at) > samples_per_task:
        raise ValueError(
            f"--pass-at {max(pass_at)} needs at least {max(pass_at)} samples per task, but each task gets "
            f"{samples_per_task}: pass --samples {max(pass_at)} or more with --temperature > 0"
        )


def bootstrap_ci(
    values: np.ndarray, seed: int = 0, resamples: int = BOOTSTRAP_RESAMPLES
) -> tuple[float, float]:
    """Percentile 95% interval of the mean."""
    if len(values) == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(values), size=(resamples, len(values)))
    means = values[idx].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


HELDOUT_DRAWS_PER_TASK = 8  # an arm whose held-out space is small stops after this many draws per task asked


def task_key(task: Task) -> str:
    """A task's identity: the content key its generator drew (`envs.base.Domain.draw`), which also tells
    apart tasks that ask the same prompt of different hidden state (tools.apis, code tests); a domain
    that sets none is identified by its prompt and tools."""
    key = task.meta.get("content_key")
    if key is not None:
        return str(key)
    return f"{stable_hash([m.to_dict() for m in task.prompt], [asdict(t) for t in task.tools]):016x}"


def heldout_tasks(domains: dict[str, Any], arms: list[Any], n: int, seed: int) -> list[tuple[Any, Any, Task]]:
    """Up to n distinct held-out tasks per arm, the same for every model evaluated with the same seed.

    Draws i = 0, 1, ... and keeps a task only if its identity (`task_key`) is new to the arm: a small
    generator space repeats tasks, and a repeat scored greedily is the same answer counted twice,
    which would narrow every interval without adding evidence. An arm whose space runs out first (no n
    distinct tasks in HELDOUT_DRAWS_PER_TASK * n draws) gets fewer; the report's n says how many."""
    out = []
    for arm in arms:
        domain = domains[arm.domain]
        split = "heldout" if "heldout" in domain.splits else domain.splits[-1]
        seen: set[str] = set()
        for i in range(HELDOUT_DRAWS_PER_TASK * n):
            if len(seen) == n:
                break
            task = domain.task(split, arm.difficulty, i, seed=seed)
            key = task_key(task)
            if key not in seen:
                seen.add(key)
                out.append((arm, domain, task))
    return out


def score_tasks(
    engine: Engine,
    tokenizer: Any,
    tasks: list[tuple[Any, Any, Task]],
    sandbox: Any,
    sampling: Any,
    limits: EpisodeLimits,
    samples: int = 1,
    seed: int = 0,
    loop: asyncio.AbstractEventLoop | None = None,
    usage: dict[str, float] | None = None,
    failures: list[str] | None = None,
) -> list[list[EpisodeScore]]:
    """Each task's scored episodes out of `samples` seeded ones (infrastructure failures left out, so a
    task whose every episode failed gets []). Greedy sampling ignores the seeds. `usage`, when given,
    gains the episodes' generated tokens under "generated_tokens"; `failures`, when given, gains why each
    infrastructure failure failed (`failure_reason`)."""
    from dataclasses import replace

    from posttrain.rollout import sample_seed

    async def run_all() -> list[Any]:
        return await asyncio.gather(
            *(
                run_episode(
                    engine,
                    tokenizer,
                    d,
                    t,
                    sandbox,
                    replace(sampling, seed=sample_seed(seed, 0, i, j)),
                    limits,
                    engine.version,
                )
                for i, (_, d, t) in enumerate(tasks)
                for j in range(samples)
            )
        )

    runner = loop or asyncio.new_event_loop()
    try:
        trajs = runner.run_until_complete(run_all())
    finally:
        if loop is None:
            runner.close()
    if usage is not None:
        usage["generated_tokens"] = usage.get("generated_tokens", 0.0) + float(
            sum(t.num_generated for t in trajs)
        )
    if failures is not None:
        failures.extend(failure_reason(t) for t in trajs if not t.status.is_scored)
    return episodes_of(trajs, samples)


def failure_reason(traj: Any) -> str:
    """One line naming an episode that was not scored (an infrastructure failure or a reward-function
    error): the task, the status and the error it carried."""
    why = traj.info.get("error") or traj.info.get("infra_error") or traj.info.get("reward_fn_error") or ""
    task = traj.task.id or f"{traj.task.domain}:{traj.task.difficulty}"
    return f"{task}: {traj.status.value}: {why}"[:300]


def episodes_of(trajectories: Sequence[Any], samples: int) -> list[list[EpisodeScore]]:
    """Group trajectories (`samples` consecutive ones per task) into each task's scored episodes,
    infrastructure failures left out."""
    return [
        [episode_score(t.rewards, t.reward) for t in trajectories[i : i + samples] if t.status.is_scored]
        for i in range(0, len(trajectories), samples)
    ]


def evaluate_engine(
    engine: Engine,
    tokenizer: Any,
    domains: dict[str, Any],
    arms: list[Any],
    n: int,
    sandbox: Any,
    sampling: Any,
    limits: EpisodeLimits,
    seed: int = 0,
    loop: asyncio.AbstractEventLoop | None = None,
    usage: dict[str, float] | None = None,
) -> dict[Any, list[float]]:
    """Strict success per task, per arm (infra failures dropped), for our engine, greedy by default;
    `usage` as in score_tasks."""
    tasks = heldout_tasks(domains, arms, n, seed)
    scores: dict[Any, list[float]] = {arm: [] for arm in arms}
    results = score_tasks(engine, tokenizer, tasks, sandbox, sampling, limits, 1, seed, loop, usage)
    for (arm, _, _), episodes in zip(tasks, results, strict=True):
        if episodes:
            scores[arm].append(float(np.mean([e.success for e in episodes])))
    return scores


def _mean_or_nan(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else float("nan")


def _interval(values: Sequence[float], seed: int) -> dict[str, float]:
    arr = np.asarray(values, dtype=float)
    lo, hi = bootstrap_ci(arr, seed)
    return {"value": _mean_or_nan(arr), "ci_low": lo, "ci_high": hi, "n": len(arr)}


@dataclass
class EvalReport:
    """One model's held-out results. `per_task` holds each task's strict success (the mean over its
    samples; None = every sample an infrastructure failure); `episodes`, when the scorer kept them, each
    task's scored episodes, from which mean reward, components and pass@k are drawn."""

    model: str
    per_task: dict[str, list[float | None]]  # domain -> score per task (None = infra failure)
    per_domain: dict[str, dict[str, Any]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # why episodes failed at the infrastructure level
    episodes: dict[str, list[list[EpisodeScore]]] = field(default_factory=dict)

    def add(self, domain: str, episodes: list[EpisodeScore]) -> None:
        """Record one task's scored episodes (in task order)."""
        self.episodes.setdefault(domain, []).append(list(episodes))
        self.per_task.setdefault(domain, []).append(
            float(np.mean([e.success for e in episodes])) if episodes else None
        )

    def pass_at(self, domain: str, k: int) -> list[float | None]:
        """Unbiased pass@k per task (None where fewer than k episodes were scored)."""
        out: list[float | None] = []
        for eps in self.episodes.get(domain, []):
            c = sum(1 for e in eps if e.success >= FULL_REWARD)
            out.append(pass_at_k(len(eps), c, k) if len(eps) >= k else None)
        return out

    def component(self, domain: str, name: str) -> list[float | None]:
        """Each task's mean of one reward component over its scored episodes that report it (None where
        none did), in task order like `per_task`."""
        out: list[float | None] = []
        for eps in self.episodes.get(domain, []):
            got = [e.components[name] for e in eps if name in e.components]
            out.append(float(np.mean(got)) if got else None)
        return out

    def summarise(self, seed: int = 0, pass_at: Sequence[int] = ()) -> None:
        for dom, scores in self.per_task.items():
            vals = np.array([s for s in scores if s is not None], dtype=float)
            lo, hi = bootstrap_ci(vals, seed)
            entry: dict[str, Any] = {
                "accuracy": _mean_or_nan(vals),
                "ci_low": lo,
                "ci_high": hi,
                "n": len(vals),
                "infra_failures": sum(s is None for s in scores),
            }
            scored = [eps for eps in self.episodes.get(dom, []) if eps]
            if scored:
                entry["samples"] = sum(len(eps) for eps in scored)
                entry["mean_reward"] = _mean_or_nan([np.mean([e.reward for e in eps]) for eps in scored])
                names = sorted({k for eps in scored for e in eps for k in e.components})
                entry["mean_components"] = {
                    name: _mean_or_nan(
                        [
                            np.mean(got)
                            for eps in scored
                            if (got := [e.components[name] for e in eps if name in e.components])
                        ]
                    )
                    for name in names
                }
                entry["components"] = {  # the same means over tasks, with bootstrap intervals
                    name: _interval([v for v in self.component(dom, name) if v is not None], seed)
                    for name in names
                }
            if pass_at:
                entry["pass_at"] = {
                    str(k): _interval([v for v in self.pass_at(dom, k) if v is not None], seed)
                    for k in pass_at
                }
            self.per_domain[dom] = entry


async def _api_episode(
    client: Any,
    model: str,
    domain: Any,
    task: Task,
    limits: EpisodeLimits,
    sandbox: Any = None,
    temperature: float = 0.0,
    seed: int | None = None,
) -> tuple[EpisodeScore | None, str]:
    """One scored episode of `domain` against an OpenAI-compatible chat endpoint; the environment runs
    its code in `sandbox` like a local rollout does. (None, why) on an infrastructure failure."""
    env = domain.make_env(sandbox, chat_format="hermes")
    ep = await api_episode(client, model, env, task, limits, temperature, seed)
    if ep.result is None:
        return None, ep.why
    return episode_score(ep.result.rewards, ep.result.reward), ""


def evaluate_api(
    api_base: str,
    model: str,
    domains: dict[str, Any],
    arms: list[Any],
    n: int,
    limits: EpisodeLimits,
    seed: int,
    api_key: str | None = None,
    concurrency: int = 8,
    temperature: float = 0.0,
    samples: int = 1,
    sandbox: Any = None,
    pass_at: Sequence[int] = (),
) -> EvalReport:
    """Score any OpenAI-compatible server on the same held-out tasks as `evaluate_local`.

    Domains that run code (`requires_sandbox`) need `sandbox`. temperature 0 asks for greedy decoding
    (one episode per task); otherwise each task gets `samples` episodes, each request carrying the seed
    `seed + j` (servers may ignore it), and `pass_at` lists the k of pass@k to report. An episode that
    fails at the transport or protocol level (connection error, non-200, a body that is not a chat
    completion) or in the sandbox is an infrastructure failure, never a crash or a score."""
    import httpx

    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    k = 1 if temperature == 0.0 else samples
    check_pass_at(pass_at, k)
    _check_sandbox(domains, arms, sandbox)
    tasks = heldout_tasks(domains, arms, n, seed)
    failures: list[str] = []

    async def run_all() -> list[list[EpisodeScore]]:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        sem = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(base_url=api_base.rstrip("/"), headers=headers, timeout=120.0) as client:

            async def one(d: Any, t: Task, j: int) -> EpisodeScore | None:
                async with sem:
                    try:
                        score, why = await _api_episode(
                            client, model, d, t, limits, sandbox, temperature, None if k == 1 else seed + j
                        )
                    except httpx.HTTPError as err:
                        score, why = None, f"{type(err).__name__}: {err}"
                if score is None:
                    failures.append(why)
                return score

            async def task_episodes(d: Any, t: Task) -> list[EpisodeScore]:
                return [s for s in await asyncio.gather(*(one(d, t, j) for j in range(k))) if s is not None]

            return await asyncio.gather(*(task_episodes(d, t) for _, d, t in tasks))

    results = asyncio.run(run_all())
    report = EvalReport(model=f"{api_base}#{model}", per_task={}, failures=failures)
    for (arm, _, _), episodes in zip(tasks, results, strict=True):
        report.add(arm.domain, episodes)
    report.summarise(seed, pass_at)
    return report


def _check_sandbox(domains: dict[str, Any], arms: list[Any], sandbox: Any) -> None:
    if sandbox is None:
        needing = sorted({a.domain for a in arms if getattr(domains[a.domain], "requires_sandbox", False)})
        if needing:
            raise ValueError(
                f"domain(s) {', '.join(needing)} run code: pass a sandbox (posttrain.sandbox.make_sandbox)"
            )


def evaluate_local(
    spec: str,
    cfg: Any,
    domains: dict[str, Any],
    arms: list[Any],
    n: int,
    seed: int,
    sandbox: Any,
    temperature: float = 0.0,
    samples: int = 1,
    pass_at: Sequence[int] = (),
    by_arm: bool = False,
) -> EvalReport:
    """Load `spec` (model spec or HF folder) into our engine and score it on held-out tasks.

    temperature 0 is greedy (one sample); otherwise each task gets `samples` seeded samples, the same
    seeds for every model compared: accuracy is then pass@1 estimated from them, and `pass_at` lists
    further k of pass@k to report. `by_arm`: results keyed by `domain:difficulty` instead of domain.
    """
    from posttrain.engine import SamplingParams, make_engine
    from posttrain.longctx.rope import apply_rope_scaling
    from posttrain.models import load_policy, load_tokenizer

    k = 1 if temperature == 0.0 else samples
    check_pass_at(pass_at, k)
    tokenizer = load_tokenizer(spec)
    model = apply_rope_scaling(load_policy(spec, dtype=cfg.engine.dtype), cfg.model.rope_scaling)
    engine = make_engine(cfg.engine, model, tokenizer)
    limits = EpisodeLimits(cfg.envs.max_turns, cfg.envs.max_episode_tokens, cfg.engine.max_new_tokens)
    sampling = SamplingParams(
        temperature=temperature, max_tokens=cfg.engine.max_new_tokens, stop_token_ids=[tokenizer.eos_token_id]
    )
    tasks = heldout_tasks(domains, arms, n, seed)
    report = EvalReport(model=spec, per_task={})
    results = score_tasks(
        engine, tokenizer, tasks, sandbox, sampling, limits, k, seed, failures=report.failures
    )
    for (arm, _, _), episodes in zip(tasks, results, strict=True):
        report.add(arm.key if by_arm else arm.domain, episodes)
    report.summarise(seed, pass_at)
    return report


def _paired(a: Sequence[float | None], b: Sequence[float | None]) -> list[float]:
    return [x - y for x, y in zip(a, b, strict=False) if x is not None and y is not None]


def _delta(diffs: Sequence[float], seed: int) -> dict[str, Any]:
    arr = np.asarray(diffs, dtype=float)
    lo, hi = bootstrap_ci(arr, seed)
    return {"delta": _mean_or_nan(arr), "ci_low": lo, "ci_high": hi, "n_tasks": len(arr)}


def paired_delta(
    model: EvalReport, baseline: EvalReport, seed: int = 0, pass_at: Sequence[int] = ()
) -> dict[str, Any]:
    """Mean difference (model - baseline) over tasks scored in both, per domain and over all tasks, with
    paired bootstrap 95% intervals: of strict accuracy, of pass@k for each k in `pass_at` (under
    "pass_at", keyed by str(k)), and of each reward component both report per task (under "components")."""
    out: dict[str, Any] = {"per_domain": {}}
    all_diffs: list[float] = []
    all_pass: dict[int, list[float]] = {k: [] for k in pass_at}
    for dom in model.per_task:
        diffs = _paired(model.per_task[dom], baseline.per_task.get(dom, []))
        entry = _delta(diffs, seed)
        all_diffs.extend(diffs)
        if pass_at:
            entry["pass_at"] = {}
            for k in pass_at:
                pdiffs = _paired(model.pass_at(dom, k), baseline.pass_at(dom, k))
                entry["pass_at"][str(k)] = _delta(pdiffs, seed)
                all_pass[k].extend(pdiffs)
        names = {c for eps in model.episodes.get(dom, []) for e in eps for c in e.components}
        names &= {c for eps in baseline.episodes.get(dom, []) for e in eps for c in e.components}
        if names:
            entry["components"] = {
                name: _delta(_paired(model.component(dom, name), baseline.component(dom, name)), seed)
                for name in sorted(names)
            }
        out["per_domain"][dom] = entry
    out.update(_delta(all_diffs, seed))
    if pass_at:
        out["pass_at"] = {str(k): _delta(v, seed) for k, v in all_pass.items()}
    return out


def eval_arms(cfg: Any, suite: str | None) -> tuple[dict[str, Any], list[Any]]:
    """The domains and (domain, difficulty) arms `posttrain eval` scores: the --suite domains (comma list;
    each at its configured difficulties, else its first), or the config's domains."""
    from posttrain.curriculum import Arm
    from posttrain.envs import get_domain

    wanted = [s.strip() for s in suite.split(",")] if suite else None
    domains: dict[str, Any] = {}
    arms: list[Any] = []
    configured = {d.name: d for d in cfg.envs.domains}
    for name in wanted or list(configured):
        d = configured.get(name)
        domain = get_domain(name, **(d.options if d else {}))
        domains[name] = domain
        for lvl in d.difficulties if d else domain.difficulties[:1]:
            arms.append(Arm(name, lvl))
    return domains, arms
