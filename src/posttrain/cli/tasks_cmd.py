"""`posttrain tasks list|sample|check`: show the task domains, print sample tasks with their reference
solutions, and run every reference solution through its verifier. The domains live in `posttrain.envs`;
this module only parses arguments and prints."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import typer

from posttrain.cli.common import EXIT_USAGE, console, fail, load_config_or_exit, print_json_last

app = typer.Typer(
    help="Task domains: list, sample, check reference solutions.", no_args_is_help=True, rich_markup_mode=None
)


def _options(items: list[str] | None) -> dict[str, Any]:
    from posttrain.config import parse_override_value

    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            fail(f"--option '{item}' is not of the form key=value (e.g. --option datasets=[gcd])", EXIT_USAGE)
        key, raw = item.split("=", 1)
        out[key.strip()] = parse_override_value(raw)
    return out


def _domain(name: str, options: dict[str, Any]) -> Any:
    from posttrain.envs import UnknownDomainError, get_domain

    try:
        return get_domain(name, **options)
    except UnknownDomainError as err:
        fail(str(err), EXIT_USAGE)
    except ValueError as err:
        fail(str(err), EXIT_USAGE)


@app.command("list")
def list_cmd(
    json_out: bool = typer.Option(False, "--json", help="print the table as JSON, last line"),
) -> None:
    """Show the domains with their difficulty levels and splits."""
    from rich.table import Table

    from posttrain.envs import get_domain, list_domains
    from posttrain.envs.registry import domain_class

    rows = []
    for name in list_domains():
        cls = domain_class(name)
        if cls.required_options:  # levels come from the data: shown once options are given (`tasks sample`)
            rows.append(
                {
                    "domain": name,
                    "difficulties": [],
                    "splits": list(cls.splits),
                    "sandbox": cls.requires_sandbox,
                    "description": cls.description,
                    "required_options": list(cls.required_options),
                }
            )
            continue
        d = get_domain(name)
        rows.append(
            {
                "domain": name,
                "difficulties": d.difficulties,
                "splits": list(d.splits),
                "sandbox": d.requires_sandbox,
                "description": d.description,
            }
        )
    table = Table(title="task domains")
    for col in ("domain", "difficulties", "splits", "sandbox", "description"):
        table.add_column(col)
    for r in rows:
        levels = (
            ", ".join(map(str, r["difficulties"]))
            or "needs --option " + "=, ".join(r["required_options"]) + "="
        )
        table.add_row(
            r["domain"], levels, ", ".join(r["splits"]), "yes" if r["sandbox"] else "no", r["description"]
        )
    console.print(table)
    if json_out:
        print_json_last(rows)


@app.command("sample")
def sample(
    domain: str = typer.Argument(..., help="domain name, see `posttrain tasks list`"),
    n: int = typer.Option(3, "--n", min=1, help="how many tasks"),
    seed: int = typer.Option(0, "--seed"),
    difficulty: int | None = typer.Option(None, "--difficulty", help="default: the lowest level"),
    split: str | None = typer.Option(
        None, "--split", help="train | heldout | eval (default: the first split)"
    ),
    option: list[str] = typer.Option(None, "--option", help="domain option key=value, e.g. datasets=[gcd]"),
    json_out: bool = typer.Option(False, "--json", help="print the tasks as JSON, last line"),
) -> None:
    """Print N distinct tasks of DOMAIN with their reference solutions (a small generator space repeats
    tasks: repeats are skipped, and fewer are shown when the space runs out, with a note saying so)."""
    from rich.text import Text

    from posttrain.orchestrator.eval.evaluate import HELDOUT_DRAWS_PER_TASK, task_key

    d = _domain(domain, _options(option))
    level = d.difficulties[0] if difficulty is None else difficulty
    split_name = split or d.splits[0]
    out = []
    seen: set[str] = set()
    draws = HELDOUT_DRAWS_PER_TASK * n
    for i in range(draws):
        if len(seen) == n:
            break
        try:
            task = d.task(split_name, level, i, seed)
        except ValueError as err:
            fail(str(err), EXIT_USAGE)
        key = task_key(task)
        if key in seen:
            continue
        seen.add(key)
        ref = d.reference(task)
        out.append({"task": task.to_dict(), "reference": ref})
        console.rule(Text(task.id, style="bold"))
        for m in task.prompt:
            console.print(Text.assemble((m.role, "cyan"), ": ", m.text))
        if task.tools:
            console.print(Text("tools: " + ", ".join(t.name for t in task.tools), style="dim"))
        for j, text in enumerate(ref):
            console.print(Text.assemble((f"reference {j + 1}/{len(ref)}", "green"), ": ", text))
    if len(seen) < n:
        console.print(
            Text(f"only {len(seen)} distinct tasks in {draws} draws of {domain}:{level}", style="dim")
        )
    if json_out:
        print_json_last(out)


async def _check(domains: list[Any], n: int, seed: int, sandbox: Any) -> list[dict[str, Any]]:
    from posttrain.envs import check_reference

    rows = []
    for d in domains:
        for split in d.splits:
            for level in d.difficulties:
                rewards, failures = [], []
                for i in range(n):
                    task = d.task(split, level, i, seed)
                    again = d.task(split, level, i, seed)
                    if json.dumps(task.to_dict(), sort_keys=True, default=str) != json.dumps(
                        again.to_dict(), sort_keys=True, default=str
                    ):
                        failures.append(f"{task.id}: generator is not deterministic")
                    res = await check_reference(d, task, sandbox if d.requires_sandbox else None)
                    if res.info.get("infra_failure"):
                        failures.append(f"{task.id}: sandbox failure: {res.info.get('infra_error')}")
                        continue
                    if res.info.get("reward_fn_error"):
                        failures.append(f"{task.id}: {res.info['reward_fn_error']}")
                        continue
                    rewards.append(res.reward)
                    if res.reward != 1.0:
                        failures.append(f"{task.id}: reference scored {res.reward} {res.rewards} {res.info}")
                rows.append(
                    {
                        "domain": d.name,
                        "split": split,
                        "difficulty": level,
                        "n": n,
                        "mean_reward": sum(rewards) / max(1, len(rewards)),
                        "failures": failures,
                    }
                )
    return rows


@app.command("check")
def check(
    domain: str = typer.Argument(None, help="domain name (or use --all)"),
    all_: bool = typer.Option(False, "--all", help="check every domain"),
    n: int = typer.Option(3, "--n", min=1, help="tasks per split and difficulty"),
    seed: int = typer.Option(0, "--seed"),
    config: str = typer.Option(None, "--config", help="run config whose `sandbox` section is used"),
    set_: list[str] = typer.Option(None, "--set", help="config override, e.g. --set sandbox.pool_size=2"),
    option: list[str] = typer.Option(None, "--option", help="domain option key=value (with a DOMAIN)"),
    json_out: bool = typer.Option(False, "--json", help="print the results as JSON, last line"),
) -> None:
    """Run every reference solution through its verifier; exit 1 unless all score 1.0. `--all` skips the
    domains that need options (such as `dataset`'s path): check those by name with --option."""
    from rich.table import Table
    from rich.text import Text

    from posttrain.envs import list_domains
    from posttrain.envs.registry import domain_class

    if all_ == (domain is not None):
        fail("give either a DOMAIN or --all", EXIT_USAGE)
    if all_ and option:
        fail("--option applies to one DOMAIN, not to --all", EXIT_USAGE)
    names = [n for n in list_domains() if not domain_class(n).required_options] if all_ else [domain]
    domains = [_domain(name, _options(option)) for name in names]
    cfg = load_config_or_exit(config, set_)
    sandbox = None
    if any(d.requires_sandbox for d in domains):
        from posttrain.sandbox import make_sandbox

        try:
            sandbox = make_sandbox(cfg.sandbox)
        except Exception as err:  # noqa: BLE001 - shown to the user with the reason
            fail(
                f"cannot start the sandbox needed by {', '.join(d.name for d in domains if d.requires_sandbox)}: {err}"
            )
    try:
        rows = asyncio.run(_check(domains, n, seed, sandbox))
    finally:
        if sandbox is not None:
            asyncio.run(sandbox.close())
    table = Table(title=f"reference solutions ({n} per split and level, seed {seed})")
    for col in ("domain", "split", "difficulty", "mean reward", "result"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["domain"],
            r["split"],
            str(r["difficulty"]),
            f"{r['mean_reward']:.3f}",
            "[green]ok[/]" if not r["failures"] else f"[red]{len(r['failures'])} failed[/]",
        )
    console.print(table)
    failures = [f for r in rows for f in r["failures"]]
    for f in failures[:20]:
        console.print(Text.assemble(("FAIL ", "red"), f))
    if json_out:
        print_json_last({"ok": not failures, "rows": rows})
    if failures:
        raise typer.Exit(1)


@app.command("captions")
def captions(
    out: str = typer.Option(..., "--out", help="JSONL file to write (posttrain sft --data reads it)"),
    n: int = typer.Option(64, "--n", min=1, help="how many image-caption rows"),
    split: str = typer.Option("train", "--split", help="train | heldout"),
    seed: int = typer.Option(0, "--seed"),
    domains: str = typer.Option(
        None, "--domains", help="comma-separated vision domains (default: all captioned ones)"
    ),
) -> None:
    """Write image-caption SFT rows from the vision domains' renders (scenes, panels, charts, CAD
    drawings) for the alignment stage: `posttrain sft --data OUT`."""
    from posttrain.envs.domains.vision_captions import CAPTION_DOMAINS, caption_rows, write_caption_jsonl

    names = tuple(d.strip() for d in domains.split(",") if d.strip()) if domains else CAPTION_DOMAINS
    try:
        rows = caption_rows(n, split, seed, names)
    except ValueError as err:
        fail(str(err), EXIT_USAGE)
    path = write_caption_jsonl(out, rows)
    console.print(f"wrote {len(rows)} image-caption rows ({', '.join(names)}, {split} split) to {path}")
