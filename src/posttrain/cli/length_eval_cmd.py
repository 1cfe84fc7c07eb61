"""`posttrain eval MODEL --suite longctx.ruler,longctx.hard --lengths 1k,2k,4k,8k`: score each task at
each length (our engine or --api-base) and print a table per domain (tasks x lengths, strict accuracy with
95% intervals, the task average) and the effective length at each --threshold."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from posttrain.cli.common import console, warn_failures


def eval_lengths(
    model_spec: str | None,
    api: tuple[str, str, str | None] | None,
    cfg: Any,
    domains: dict[str, Any],
    levels: list[int],
    thresholds: list[float],
    n: int,
    sandbox: Any,
    temperature: float,
    samples: int,
) -> dict[str, Any]:
    """Run `orchestrator.eval.length_eval.evaluate_lengths` with our engine on `model_spec` (its max_model_len
    and KV pool raised to each length's needs, `engine_for_length`) or the endpoint
    `api` = (base, model, key); print the tables; return the result."""
    from posttrain.orchestrator.eval.evaluate import ACCURACY_DEFINITION, evaluate_api, evaluate_local
    from posttrain.orchestrator.eval.length_eval import engine_for_length, evaluate_lengths
    from posttrain.rollout import EpisodeLimits

    limits = EpisodeLimits(cfg.envs.max_turns, cfg.envs.max_episode_tokens, cfg.engine.max_new_tokens)

    def score(sub: dict[str, Any], arms: list[Any], tokens: int) -> Any:
        console.print(f"[dim]scoring {len(arms)} tasks x {n} at {tokens} tokens ...[/]")
        if api is not None:
            base, model, key = api
            report = evaluate_api(
                base,
                model,
                sub,
                arms,
                n,
                limits,
                cfg.seed,
                key,
                temperature=temperature,
                samples=samples,
                sandbox=sandbox,
            )
        else:
            level_cfg = cfg.model_copy(update={"engine": engine_for_length(cfg.engine, tokens)})
            assert model_spec is not None
            report = evaluate_local(
                model_spec, level_cfg, sub, arms, n, cfg.seed, sandbox, temperature, samples
            )
            base = f"our engine on {model_spec}"
        warn_failures(report.failures, f"{base} at {tokens} tokens")
        return report

    result = evaluate_lengths(domains, levels, score, thresholds, cfg.seed)
    result.update(
        model=f"{api[0]}#{api[1]}" if api else model_spec,
        accuracy_definition=ACCURACY_DEFINITION,
        n_per_cell=n,
        temperature=temperature,
        samples_per_task=1 if temperature == 0.0 else samples,
    )
    for table in length_tables(result):
        console.print(table)
    return result


def length_tables(result: dict[str, Any]) -> list[Table]:
    """One table per domain: a row per task and the task average, a column per length; the effective
    lengths in the caption."""

    def ci(c: dict[str, Any], key: str) -> str:
        if c[key] is None:
            return "-"
        return f"{c[key]:.2f} [{c['ci_low']:.2f}, {c['ci_high']:.2f}]"

    tables = []
    lengths = [str(n) for n in result["lengths"]]
    for dom, tasks in result["tasks"].items():
        eff = ", ".join(f"> {t}%: {_tokens(v)}" for t, v in result["effective_length"][dom].items())
        table = Table(
            "task",
            *[f"{int(n) // 1024}k" for n in lengths],
            title=f"{dom}: strict accuracy [95% CI] by length",
            caption=f"effective length {eff}",
        )
        for task, cells in tasks.items():
            table.add_row(task, *[f"{ci(cells[n], 'accuracy')} n={cells[n]['n']}" for n in lengths])
        avg = result["task_average"][dom]
        table.add_row("task average", *[ci(avg[n], "value") for n in lengths], style="bold")
        tables.append(table)
    return tables


def _tokens(n: int | None) -> str:
    return "below the shortest length" if n is None else f"{n // 1024}k"
