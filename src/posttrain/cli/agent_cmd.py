"""`posttrain agent ci-fix`: fix a repository's failing check and hand back a verified patch.

Exit codes: 0 fixed (or nothing to fix: the check passes), 3 not fixed, 2 usage, 1 runtime failure.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import typer

from posttrain.cli.common import (
    EXIT_RUNTIME,
    EXIT_USAGE,
    console,
    err_console,
    fail,
    load_config_or_exit,
    print_json_last,
)

EXIT_NOT_FIXED = 3

app = typer.Typer(help="Agents built on posttrain.", no_args_is_help=True)


@app.command("ci-fix")
def ci_fix(
    repo: str = typer.Option(".", "--repo", help="the git work tree to fix"),
    command: str = typer.Option("pytest -q", "--command", help="the failing check, run in the sandbox"),
    log: str = typer.Option(None, "--log", help="a CI log file to start from (the check still verifies)"),
    model: str = typer.Option(
        None, "--model", help="model spec or run dir (in-process), or NAME at --api-base"
    ),
    api_base: str = typer.Option(
        None, "--api-base", help="an OpenAI-compatible endpoint, e.g. http://host:8000/v1"
    ),
    api_key: str = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY"),
    max_turns: int = typer.Option(10, "--max-turns", min=1, help="assistant turns per attempt"),
    max_attempts: int = typer.Option(3, "--max-attempts", min=1, help="fresh attempts before giving up"),
    timeout: float = typer.Option(900.0, "--timeout", min=1.0, help="seconds for the whole run"),
    allow_test_edits: bool = typer.Option(
        False, "--allow-test-edits", help="let the model edit tests (flagged)"
    ),
    out: str = typer.Option(None, "--out", help="write the patch here instead of stdout"),
    commit: bool = typer.Option(False, "--commit", help="commit the fix on a new branch (never pushed)"),
    branch: str = typer.Option(
        None, "--branch", help="the --commit branch (default posttrain/ci-fix-<time>)"
    ),
    transcripts: str = typer.Option(None, "--transcripts", help="folder for every attempt's transcript"),
    wheels: str = typer.Option(None, "--wheels", help="a folder of pure-Python wheels the check may import"),
    with_package: list[str] = typer.Option(
        None, "--with-package", help="a host package the check may import (repeatable)"
    ),
    temperature: float = typer.Option(
        0.0, "--temperature", min=0.0, help="sampling temperature (0 = greedy)"
    ),
    config: str = typer.Option(None, "--config", help="run config (sandbox limits, engine settings)"),
    set_: list[str] = typer.Option(None, "--set", help="config override"),
    json_out: bool = typer.Option(False, "--json", help="print a JSON summary as the last line"),
) -> None:
    """Run COMMAND on a sandboxed copy of the repository; if it fails, let the model fix it with the
    repository tools, and report a patch only once it makes COMMAND pass on a fresh copy."""
    from posttrain.apps.ci_fix import (
        ApiPolicy,
        CheckRunner,
        FixOptions,
        RepoError,
        commit_patch,
        fix_repository,
        load_repo,
        read_wheels,
    )
    from posttrain.envs.tools import InfraError
    from posttrain.rollout import EpisodeLimits
    from posttrain.sandbox import SandboxUnavailable, make_sandbox

    if not model:
        fail("give --model SPEC|RUN_DIR (in-process) or --api-base URL --model NAME", EXIT_USAGE)
    if branch and not commit:
        fail("--branch names the --commit branch: pass --commit too", EXIT_USAGE)
    cfg = load_config_or_exit(config, set_)
    try:
        repository = load_repo(repo)
        log_text = Path(log).read_text(errors="replace") if log else None
        wheel_files = read_wheels(wheels) if wheels else {}
    except (RepoError, ValueError) as err:
        fail(str(err), EXIT_USAGE)
    except OSError as err:
        fail(f"--log {log}: {err.strerror}", EXIT_USAGE)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    options = FixOptions(
        max_turns=max_turns,
        max_attempts=max_attempts,
        timeout_s=timeout,
        allow_test_edits=allow_test_edits,
        log=log_text,
        transcripts_dir=Path(transcripts) if transcripts else Path(cfg.telemetry.run_dir) / f"ci-fix-{stamp}",
    )
    limits = EpisodeLimits(max_turns, cfg.envs.max_episode_tokens, cfg.engine.max_new_tokens)
    try:
        sandbox = make_sandbox(cfg.sandbox)
    except (SandboxUnavailable, ValueError) as err:
        fail(f"cannot start the sandbox: {err}", EXIT_RUNTIME)
    try:
        runner = CheckRunner(sandbox, command, repository.binary, wheel_files, tuple(with_package or ()))
        if api_base:
            policy = ApiPolicy(api_base, model, limits, api_key, temperature)
        else:
            policy = _engine_policy(model, cfg, limits, temperature)
        report = asyncio.run(fix_repository(repository.files, runner, policy, options, sandbox))
    except SandboxUnavailable as err:
        fail(f"cannot start the sandbox: {err}", EXIT_RUNTIME)
    except InfraError as err:
        fail(f"the sandbox failed running the check: {err}", EXIT_RUNTIME)
    finally:
        asyncio.run(sandbox.close())
    err_console.print(f"check before: {_counts(report.tests_before)}", highlight=False)
    errors = [a for a in report.attempt_log if a["outcome"] == "error"]
    for a in report.attempt_log:
        if a["outcome"] in ("error", "timeout"):
            err_console.print(f"[yellow]attempt {a['attempt']}: {a['error']}[/yellow]", highlight=False)
    result = {
        **report.summary(),
        "patch": report.patch,
        "explanation": report.explanation,
        "transcripts": str(options.transcripts_dir),
    }
    if report.status == "nothing_to_fix":
        err_console.print(f"nothing to fix: `{command}` passes in the sandbox", highlight=False)
    elif report.fixed:
        err_console.print(
            f"fixed in {report.attempts} attempt(s), {report.turns} turn(s), {report.wall_s:.1f} s: {report.explanation}",
            highlight=False,
        )
        if out:
            Path(out).write_text(report.patch)
            err_console.print(f"patch written to {out}", highlight=False)
        else:
            console.print(report.patch, end="", markup=False, highlight=False)
        if commit:
            name = branch or f"posttrain/ci-fix-{stamp}"
            try:
                result["commit"] = commit_patch(
                    repository, report.patch, name, f"ci-fix: make `{command}` pass\n\n{report.explanation}\n"
                )
                result["branch"] = name
            except RepoError as err:
                fail(str(err), EXIT_RUNTIME)
            err_console.print(f"committed {result['commit'][:12]} on new branch {name}", highlight=False)
    else:
        err_console.print(
            f"not fixed after {report.attempts} attempt(s), {report.turns} turn(s); transcripts in {options.transcripts_dir}",
            highlight=False,
        )
    if json_out:
        print_json_last(result)
    if report.status == "not_fixed" and errors and len(errors) == len(report.attempt_log):
        raise typer.Exit(EXIT_RUNTIME)  # every attempt failed in the model endpoint or the sandbox
    if report.status == "not_fixed":
        raise typer.Exit(EXIT_NOT_FIXED)


def _counts(summary: dict) -> str:
    extra = ", ".join(f"{v} {k}" for k, v in summary.items() if k not in ("ok", "exit_code", "status"))
    state = "passes" if summary.get("ok") else "fails"
    return f"{state} (exit code {summary.get('exit_code')}, {summary.get('status')}{'; ' + extra if extra else ''})"


def _engine_policy(model: str, cfg: object, limits: object, temperature: float) -> object:
    from posttrain.apps.ci_fix import EnginePolicy
    from posttrain.apps.ci_fix.agent import load_engine
    from posttrain.models import ModelNotFoundError

    try:
        engine, tokenizer, sampling = load_engine(model, cfg, temperature)
    except ModelNotFoundError as err:
        fail(str(err), EXIT_USAGE)
    return EnginePolicy(engine, tokenizer, sampling, limits)
