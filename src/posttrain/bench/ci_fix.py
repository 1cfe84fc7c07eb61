"""`posttrain bench ci-fix`: the CI auto-fix agent's fix rate (strict: a patch that makes the check pass
on a fresh copy) with 95% Wilson intervals, attempts and wall time per fix, on held-out `swe.ci_fix`
repositories (levels 0-2) and on the committed suite of small real projects (`benchmarks/ci_fix/`:
one real bug class each, with its failing test and its known fix), for the in-process models given
(the embedded 135M model by default; a training run directory for a trained one) and any
`--api-base` endpoint, all on the same tasks in the same run. The known fixes are run through the
same harness first (`reference_fix_rate`, which must be 1.0): a harness that cannot verify a known
fix would make every rate meaningless.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from posttrain.bench import BenchUsageError

SUITE_DIR = Path(__file__).resolve().parents[3] / "benchmarks" / "ci_fix"
SWE_DOMAIN = "swe.ci_fix"


@dataclass
class FixTask:
    name: str
    source: str  # "suite" or "swe.ci_fix L<level>"
    files: dict[str, str]
    command: str
    fix_patch: str


def suite_tasks(folder: Path) -> list[FixTask]:
    """Every `<task>/repo` of the suite folder with its task.json and fix.patch."""
    if not folder.is_dir():
        raise BenchUsageError(f"--suite {folder}: no such folder")
    out = []
    for task_dir in sorted(p for p in folder.iterdir() if (p / "task.json").is_file()):
        meta = json.loads((task_dir / "task.json").read_text())
        repo = task_dir / "repo"
        files = {str(p.relative_to(repo)): p.read_text() for p in sorted(repo.rglob("*")) if p.is_file()}
        out.append(
            FixTask(task_dir.name, "suite", files, meta["command"], (task_dir / "fix.patch").read_text())
        )
    if not out:
        raise BenchUsageError(f"--suite {folder}: no <task>/task.json in it")
    return out


def swe_tasks(levels: list[int], n: int, seed: int) -> list[FixTask]:
    from posttrain.envs import get_domain
    from posttrain.envs.repo_tools import unified_diff

    domain = get_domain(SWE_DOMAIN)
    out = []
    for level in levels:
        for i in range(n):
            task = domain.task("heldout", level, i, seed=seed)
            buggy = task.meta["files"]
            fix = unified_diff(buggy, task.meta["original_files"])
            out.append(FixTask(f"L{level}-{i}", f"{SWE_DOMAIN} L{level}", buggy, "pytest -q", fix))
    return out


class KnownFixPolicy:
    """Applies the task's known fix with `apply_patch`, then submits (the harness check)."""

    chat_format = "hermes"

    def __init__(self, patch: str) -> None:
        self.patch = patch

    async def episode(self, env: Any, task: Any, sandbox: Any) -> Any:
        from posttrain.apps.ci_fix import AttemptOutcome
        from posttrain.envs.parsers import get_parser
        from posttrain.envs.scripted import run_episode

        fmt = get_parser(self.chat_format)
        texts = [
            fmt.format_calls([("apply_patch", {"patch": self.patch})]),
            fmt.format_calls([("submit", {})]),
        ]
        res = await run_episode(env, task, texts)
        if res.info.get("infra_failure"):
            return AttemptOutcome(None, [], 0, res.turns, res.info.get("infra_error", ""))
        return AttemptOutcome(res.info, [m.to_openai() for m in res.transcript], 0, res.turns)


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a binomial rate: unlike a bootstrap of the tasks, it does not
    collapse to [0, 0] (or [1, 1]) when no task (or every task) was fixed."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def _run_arm(
    label: str, policy_for: Any, tasks: list[FixTask], sandbox: Any, options: Any, console: Console
) -> list[dict[str, Any]]:
    from posttrain.apps.ci_fix import CheckRunner, fix_repository

    rows = []
    for k, task in enumerate(tasks, 1):
        runner = CheckRunner(sandbox, task.command)
        report = asyncio.run(fix_repository(task.files, runner, policy_for(task), options, sandbox))
        rows.append(
            {
                "task": task.name,
                "source": task.source,
                "status": report.status,
                "fixed": report.fixed,
                "attempts": report.attempts,
                "turns": report.turns,
                "tokens": report.generated_tokens,
                "wall_s": report.wall_s,
                "errors": [a["error"] for a in report.attempt_log if a["outcome"] == "error"],
            }
        )
        console.print(
            f"  {label}: {k}/{len(tasks)} {task.source} {task.name}: {report.status} "
            f"({report.attempts} attempt(s), {report.turns} turn(s), {report.wall_s:.1f} s)",
            highlight=False,
        )
    return rows


def main(args: Any) -> dict[str, Any]:
    from posttrain.apps.ci_fix import ApiPolicy, EnginePolicy, FixOptions
    from posttrain.apps.ci_fix.agent import load_engine
    from posttrain.config import ConfigError, load_config
    from posttrain.rollout import EpisodeLimits
    from posttrain.sandbox import make_sandbox

    console = Console(stderr=True, emoji=False, soft_wrap=True)
    try:
        cfg = load_config(None, list(args.overrides))
    except ConfigError as err:
        raise BenchUsageError(str(err)) from None
    if args.api_base and not args.api_model:
        raise BenchUsageError("--api-base needs --api-model NAME")
    try:
        levels = [int(x) for x in args.levels.split(",") if x.strip()]
    except ValueError:
        raise BenchUsageError(f"--levels must be comma-separated integers, got {args.levels!r}") from None
    if any(lv not in (0, 1, 2) for lv in levels):
        raise BenchUsageError(f"--levels: swe.ci_fix has levels 0, 1, 2; got {levels}")
    tasks = (suite_tasks(Path(args.suite)) if not args.skip_suite else []) + swe_tasks(
        levels, args.swe_n, args.seed
    )
    if not tasks:
        raise BenchUsageError("no tasks: give --swe-n > 0 or leave the suite in")
    options = FixOptions(max_turns=args.max_turns, max_attempts=args.max_attempts, timeout_s=args.timeout_s)
    limits = EpisodeLimits(args.max_turns, cfg.envs.max_episode_tokens, cfg.engine.max_new_tokens)
    sandbox = make_sandbox(cfg.sandbox)
    t0 = time.perf_counter()
    per_arm: dict[str, list[dict[str, Any]]] = {}
    try:
        console.print(f"ci-fix: {len(tasks)} tasks; the known fixes first (harness check)", highlight=False)
        reference = _run_arm(
            "known fix", lambda t: KnownFixPolicy(t.fix_patch), tasks, sandbox, options, console
        )
        for spec in args.models:
            engine, tokenizer, sampling = load_engine(spec, cfg)
            policy = EnginePolicy(engine, tokenizer, sampling, limits)
            per_arm[spec] = _run_arm(spec, lambda t, p=policy: p, tasks, sandbox, options, console)
            del engine
        if args.api_base:
            label = f"{args.api_base}#{args.api_model}"
            policy = ApiPolicy(args.api_base, args.api_model, limits, args.api_key)
            per_arm[label] = _run_arm(label, lambda t: policy, tasks, sandbox, options, console)
    finally:
        asyncio.run(sandbox.close())
    return summarise(tasks, reference, per_arm, args, time.perf_counter() - t0, console)


def summarise(
    tasks: list[FixTask],
    reference: list[dict[str, Any]],
    per_arm: dict[str, list[dict[str, Any]]],
    args: Any,
    wall_s: float,
    console: Console,
) -> dict[str, Any]:
    sources = list(dict.fromkeys(t.source for t in tasks))
    out: dict[str, Any] = {
        "fix_rate_definition": "strict: the agent's patch makes the check pass on a fresh copy of the repository",
        "fix_rate_ci_definition": "95% Wilson score interval over the tasks",
        "n_tasks": len(tasks),
        "n_by_source": {s: sum(t.source == s for t in tasks) for s in sources},
        "reference_fix_rate": sum(r["fixed"] for r in reference) / len(reference),
        "reference_median_wall_s": statistics.median(r["wall_s"] for r in reference),
        "max_turns": args.max_turns,
        "max_attempts": args.max_attempts,
        "fix_rate": {},
        "fix_rate_ci": {},
        "fix_rate_by_source": {},
        "median_wall_s": {},
        "attempts_per_fix": {},
        "wall_s_per_fix": {},
        "tokens_per_task": {},
        "errors": {},
        "tasks": {
            m: [{k: r[k] for k in ("task", "source", "status", "attempts", "turns", "wall_s")} for r in rows]
            for m, rows in per_arm.items()
        },
        "bench_wall_s": wall_s,
    }
    table = Table(
        title=f"ci-fix: {len(tasks)} tasks ({', '.join(f'{n} {s}' for s, n in out['n_by_source'].items())})"
    )
    for col in ("model", "fix rate [95% CI]", *sources, "attempts/fix", "s/fix", "median s/task"):
        table.add_column(col)
    for model, rows in per_arm.items():
        fixed = [r for r in rows if r["fixed"]]
        n_fixed = len(fixed)
        lo, hi = wilson_interval(n_fixed, len(rows))
        rate = {"rate": n_fixed / len(rows), "ci_low": lo, "ci_high": hi}
        out["fix_rate"][model] = rate["rate"]
        out["fix_rate_ci"][model] = [rate["ci_low"], rate["ci_high"]]
        out["fix_rate_by_source"][model] = {
            s: sum(r["fixed"] for r in rows if r["source"] == s) / out["n_by_source"][s] for s in sources
        }
        out["median_wall_s"][model] = statistics.median(r["wall_s"] for r in rows)
        out["attempts_per_fix"][model] = statistics.mean(r["attempts"] for r in fixed) if fixed else None
        out["wall_s_per_fix"][model] = statistics.mean(r["wall_s"] for r in fixed) if fixed else None
        out["tokens_per_task"][model] = statistics.mean(r["tokens"] for r in rows)
        out["errors"][model] = sum(bool(r["errors"]) for r in rows)
        table.add_row(
            model,
            f"{rate['rate']:.1%} [{rate['ci_low']:.1%}, {rate['ci_high']:.1%}]",
            *(f"{out['fix_rate_by_source'][model][s]:.0%}" for s in sources),
            "-" if not fixed else f"{out['attempts_per_fix'][model]:.2f}",
            "-" if not fixed else f"{out['wall_s_per_fix'][model]:.1f}",
            f"{out['median_wall_s'][model]:.1f}",
        )
    models = list(per_arm)
    if len(models) > 1:
        base = out["fix_rate"][models[0]]
        out["ratio_vs_first"] = {m: (out["fix_rate"][m] / base if base else None) for m in models[1:]}
    Console(emoji=False, width=None if sys.stdout.isatty() else 200).print(table)
    console.print(
        f"known fixes through the same harness: {out['reference_fix_rate']:.0%} verified "
        f"(median {out['reference_median_wall_s']:.1f} s per task)",
        highlight=False,
    )
    return out
