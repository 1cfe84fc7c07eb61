"""The CI auto-fix loop: run the check, and when it fails, episodes of the shared repository tools
(`envs.repo_tools`, the tools and first prompt `swe.ci_fix` trains on) driven by a policy, each scored
by running the check on a FRESH copy of the repository with the episode's patch applied. Stops at the
first verified fix or when attempts, turns or time run out; saves every attempt's transcript.

Policies: `EnginePolicy` (our paged engine through `rollout.run_episode`, the training rollout) and
`ApiPolicy` (any OpenAI-compatible endpoint through `rollout.api.api_episode`). The CLI
(`posttrain agent ci-fix`) and `posttrain bench ci-fix` call `fix_repository`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.apps.ci_fix.check import CheckResult, CheckRunner
from posttrain.envs.base import StepResult
from posttrain.envs.domains.swe_ci_fix import is_steering_file
from posttrain.envs.repo_tools import (
    TOOL_SPECS,
    RepoFiles,
    apply_patch,
    fix_prompt,
    repo_tools,
    trim_log,
    unified_diff,
)
from posttrain.envs.tool_env import ToolEnvironment
from posttrain.envs.tools import InfraError, Tool
from posttrain.rollout import EpisodeLimits
from posttrain.types import Message, Task

MAX_OBS_LOG_CHARS = 3000


def is_test_path(path: str) -> bool:
    """A test file by pytest's conventions: under a tests/ or test/ folder, test_*.py, *_test.py, conftest.py."""
    parts = path.split("/")
    name = parts[-1]
    return (
        any(p in ("tests", "test") for p in parts[:-1])
        or (name.startswith("test_") and name.endswith(".py"))
        or name.endswith("_test.py")
        or name == "conftest.py"
    )


def protected_reason(path: str) -> str | None:
    if is_test_path(path):
        return f"'{path}' is a test file: fix the code, not the tests (the run allows test edits only with --allow-test-edits)"
    if is_steering_file(path):
        return (
            f"'{path}' steers how the tests run (pytest.ini, pyproject.toml, setup.cfg, tox.ini, "
            "sitecustomize.py, usercustomize.py, .pth files): fix the code instead (or pass --allow-test-edits)"
        )
    return None


class RepoFixEnv(ToolEnvironment):
    """One fixing attempt on an in-memory working copy. Test runs go through `runner`; files the command
    creates are kept in the working copy (as in a CI workspace) but are not part of the patch unless
    the model writes them. `score` runs the check on a fresh copy: original files + the patch."""

    terminal_tools = frozenset({"submit"})

    def __init__(
        self,
        runner: CheckRunner,
        original: dict[str, str],
        allow_test_edits: bool = False,
        chat_format: str = "smollm2",
        max_turns: int = 10,
    ) -> None:
        super().__init__(chat_format, max_turns)
        self.runner = runner
        self.original = dict(original)
        self.allow_test_edits = allow_test_edits
        self.generated: dict[str, str] = {}  # path -> the text the check wrote there
        self.last_run: CheckResult | None = None
        self.fresh: CheckResult | None = None
        self.patch = ""
        self.steps: list[dict[str, Any]] = []  # each assistant text and its observations, as they happen

    async def step(self, assistant_text: str) -> StepResult:
        result = await super().step(assistant_text)
        self.steps.append(
            {"assistant": assistant_text, "observations": [m.to_openai() for m in result.observations]}
        )
        return result

    def _refuse(self, path: str) -> str | None:
        return None if self.allow_test_edits else protected_reason(path)

    async def setup(self, task: Task) -> tuple[list[Message], dict[str, Tool]]:
        self.repo = RepoFiles(self.original, self._refuse)
        return list(task.prompt), repo_tools(self.repo, self.run_tests, self.submit)

    async def run_tests(self, tests: list[str] | None = None) -> str:
        res = await self.runner.run(self.repo.files, tests)
        self.last_run = res
        for path, data in res.outputs.items():
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if path not in self.repo.files or self.generated.get(path) == self.repo.files[path]:
                self.generated[path] = text
                self.repo.files[path] = text
        return f"{res.headline()}\n{trim_log(res.log, MAX_OBS_LOG_CHARS)}"

    def submit(self) -> str:
        return "submitted"

    def source_files(self) -> dict[str, str]:
        """The working copy without the files the check generated (unless the model changed them since)."""
        return {p: t for p, t in self.repo.files.items() if self.generated.get(p) != t}

    async def score(self) -> tuple[float, dict[str, float], dict[str, Any]]:
        source = self.source_files()
        self.patch = unified_diff(self.original, source)
        changed = self.patch != ""
        # No change: the check already failed on exactly these files, so there is nothing to verify.
        self.fresh = await self.runner.run(apply_patch(self.original, self.patch)) if changed else None
        success = float(changed and self.fresh is not None and self.fresh.passed)
        touched_tests = sorted(
            p
            for p in set(self.original) | set(source)
            if protected_reason(p) and self.original.get(p) != source.get(p)
        )
        info = {
            "patch": self.patch,
            "fresh_check": self.fresh.summary() if self.fresh else None,
            "working_copy_check": self.last_run.summary() if self.last_run else None,
            "submitted": self.called_terminal,
            "test_edits": touched_tests,
        }
        return success, {"success": success, "changed": float(changed)}, info


@dataclass
class AttemptOutcome:
    """What a policy's episode left: the final step's info (None on an infrastructure failure, with
    `error`), the transcript, and tokens generated."""

    info: dict[str, Any] | None
    transcript: Any
    generated_tokens: int = 0
    turns: int = 0
    error: str = ""


class EnginePolicy:
    """The in-process engine, driven by the training rollout loop (`rollout.run_episode`)."""

    chat_format = "smollm2"

    def __init__(self, engine: Any, tokenizer: Any, sampling: Any, limits: EpisodeLimits) -> None:
        self.engine, self.tokenizer, self.sampling, self.limits = engine, tokenizer, sampling, limits

    async def episode(self, env: RepoFixEnv, task: Task, sandbox: Any) -> AttemptOutcome:
        from posttrain.rollout import run_episode
        from posttrain.types import TrajectoryStatus

        traj = await run_episode(
            self.engine,
            self.tokenizer,
            _OneEnv(env),
            task,
            sandbox,
            self.sampling,
            replace_limits(self.limits, env.max_turns),
            chat_format=self.chat_format,
        )
        transcript = self.tokenizer.decode(traj.token_ids)
        generated = int(sum(traj.loss_mask))
        if traj.status in (TrajectoryStatus.ENGINE_ERROR, TrajectoryStatus.SANDBOX_ERROR):
            why = traj.info.get("error") or traj.info.get("infra_error") or traj.status.value
            return AttemptOutcome(None, transcript, generated, traj.turns, str(why))
        return AttemptOutcome(dict(traj.info), transcript, generated, traj.turns)


class ApiPolicy:
    """Any OpenAI-compatible chat endpoint (`posttrain serve` included), through the evaluation loop."""

    chat_format = "hermes"

    def __init__(
        self,
        api_base: str,
        model: str,
        limits: EpisodeLimits,
        api_key: str | None = None,
        temperature: float = 0.0,
    ) -> None:
        self.api_base, self.model, self.limits = api_base.rstrip("/"), model, limits
        self.api_key, self.temperature = api_key, temperature

    async def episode(self, env: RepoFixEnv, task: Task, sandbox: Any) -> AttemptOutcome:
        import httpx

        from posttrain.rollout.api import api_episode

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with httpx.AsyncClient(base_url=self.api_base, headers=headers, timeout=300.0) as client:
            try:
                ep = await api_episode(
                    client,
                    self.model,
                    env,
                    task,
                    replace_limits(self.limits, env.max_turns),
                    self.temperature,
                )
            except httpx.HTTPError as err:
                return AttemptOutcome(
                    None, [], 0, env.turn, f"{type(err).__name__}: {err} (at {self.api_base})"
                )
        transcript = [m.to_openai() for m in ep.messages]
        if ep.result is None:
            return AttemptOutcome(None, transcript, ep.completion_tokens, env.turn, ep.why)
        return AttemptOutcome(dict(ep.result.info), transcript, ep.completion_tokens, env.turn)


def load_engine(model: str, cfg: Any, temperature: float = 0.0) -> tuple[Any, Any, Any]:
    """(engine, tokenizer, sampling) for a model spec, HF folder or training run directory (its
    exported policy), built from `cfg.engine` as evaluation builds it."""
    from posttrain.engine import SamplingParams, make_engine
    from posttrain.models import load_policy, load_tokenizer

    run_dir = Path(model)
    if (run_dir / "config.yaml").is_file():
        from posttrain.orchestrator.eval.export import export_run

        policy = run_dir / "policy"
        if not (policy / "config.json").is_file():
            export_run(run_dir, policy)
        model = str(policy)
    tokenizer = load_tokenizer(model)
    engine = make_engine(cfg.engine, load_policy(model, dtype=cfg.engine.dtype), tokenizer)
    sampling = SamplingParams(
        temperature=temperature, max_tokens=cfg.engine.max_new_tokens, stop_token_ids=[tokenizer.eos_token_id]
    )
    return engine, tokenizer, sampling


def replace_limits(limits: EpisodeLimits, max_turns: int) -> EpisodeLimits:
    return EpisodeLimits(max_turns, limits.max_episode_tokens, limits.max_new_tokens)


class _OneEnv:
    """A domain whose only environment is `env` (what `rollout.run_episode` asks a domain for)."""

    def __init__(self, env: RepoFixEnv) -> None:
        self.env = env

    def make_env(self, sandbox: Any = None, chat_format: str = "smollm2") -> RepoFixEnv:
        return self.env


@dataclass
class FixOptions:
    max_turns: int = 10
    max_attempts: int = 3
    timeout_s: float = 900.0
    allow_test_edits: bool = False
    log: str | None = None  # a CI log to start from instead of the sandbox's first run
    transcripts_dir: Path | None = None


@dataclass
class FixReport:
    """`status`: "fixed" (a patch that makes the check pass in a fresh copy), "not_fixed", or
    "nothing_to_fix" (the check already passes in the sandbox)."""

    status: str
    patch: str = ""
    explanation: str = ""
    attempts: int = 0
    turns: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0
    tests_before: dict[str, Any] = field(default_factory=dict)
    tests_after: dict[str, Any] | None = None
    attempt_log: list[dict[str, Any]] = field(default_factory=list)
    test_edits: list[str] = field(default_factory=list)

    @property
    def fixed(self) -> bool:
        return self.status == "fixed"

    def summary(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "fixed": self.fixed,
            "attempts": self.attempts,
            "turns": self.turns,
            "tokens": self.generated_tokens,
            "wall_s": round(self.wall_s, 3),
            "tests_before": self.tests_before,
            "tests_after": self.tests_after,
            "test_edits": self.test_edits,
            "attempt_outcomes": [a["outcome"] for a in self.attempt_log],
            "patch_lines": self.patch.count("\n"),
        }


def explain(patch: str, fresh: CheckResult, command: str) -> str:
    """A plain account of a verified patch: the files it changes with lines added and removed."""
    counts: dict[str, list[int]] = {}
    name = ""
    for line in patch.splitlines():
        if line.startswith("diff --git "):
            name = line.split(" b/", 1)[-1]
            counts[name] = [0, 0]
        elif line.startswith("+") and not line.startswith("+++"):
            counts[name][0] += 1
        elif line.startswith("-") and not line.startswith("---"):
            counts[name][1] += 1
    files = ", ".join(f"{n} (+{a} -{r})" for n, (a, r) in counts.items())
    return f"Changed {files}; `{command}` passes on a fresh copy with this patch: {fresh.headline()}."


def _reason(info: dict[str, Any]) -> str:
    if not info.get("patch"):
        return "it changed no file"
    fresh = info.get("fresh_check") or {}
    return f"its patch does not make the check pass on a fresh copy (exit code {fresh.get('exit_code')}, status {fresh.get('status')})"


async def fix_repository(
    files: dict[str, str],
    runner: CheckRunner,
    policy: Any,
    options: FixOptions,
    sandbox: Any = None,
) -> FixReport:
    """Run the check; if it fails, up to `max_attempts` fixing episodes until one is verified.

    Raises InfraError when the sandbox fails on the first run (nothing can be judged then); an attempt
    whose sandbox or model endpoint fails is recorded and counts as an attempt."""
    t0 = time.perf_counter()
    before = await runner.run(files)
    report = FixReport("nothing_to_fix", tests_before=before.summary())
    if before.passed:
        report.wall_s = time.perf_counter() - t0
        return report
    report.status = "not_fixed"
    log = options.log if options.log is not None else f"$ {runner.command}\n{before.log}"
    prompt = fix_prompt(log, files)
    feedback = ""
    for attempt in range(1, options.max_attempts + 1):
        left = options.timeout_s - (time.perf_counter() - t0)
        if left <= 0:
            report.attempt_log.append({"attempt": attempt, "outcome": "timeout", "error": "no time left"})
            break
        messages = list(prompt)
        if feedback:
            messages[-1] = Message("user", f"{messages[-1].content}\n\n{feedback}")
        task = Task(
            id=f"ci-fix-{attempt}",
            domain="ci_fix",
            difficulty=0,
            prompt=messages,
            tools=list(TOOL_SPECS.values()),
        )
        env = RepoFixEnv(runner, files, options.allow_test_edits, policy.chat_format, options.max_turns)
        report.attempts = attempt
        try:
            outcome = await asyncio.wait_for(policy.episode(env, task, sandbox), timeout=left)
        except TimeoutError:  # the transcript: what the environment saw before the time ran out
            why = f"timeout: the run's {options.timeout_s:g} s ran out"
            outcome = AttemptOutcome(None, env.steps, 0, env.turn, why)
        except InfraError as err:
            outcome = AttemptOutcome(None, env.steps, 0, env.turn, f"sandbox failure: {err}")
        report.turns += outcome.turns
        report.generated_tokens += outcome.generated_tokens
        info = outcome.info
        entry: dict[str, Any] = {
            "attempt": attempt,
            "turns": outcome.turns,
            "tokens": outcome.generated_tokens,
        }
        if info is None:
            entry.update(
                outcome="timeout" if outcome.error.startswith("timeout:") else "error", error=outcome.error
            )
        else:
            ok = bool(info.get("patch")) and bool((info.get("fresh_check") or {}).get("ok"))
            entry.update(
                outcome="fixed" if ok else "not_fixed",
                patch=info.get("patch", ""),
                fresh_check=info.get("fresh_check"),
                working_copy_check=info.get("working_copy_check"),
                submitted=info.get("submitted"),
                test_edits=info.get("test_edits", []),
            )
        report.attempt_log.append(entry)
        _save_transcript(options.transcripts_dir, entry, outcome.transcript)
        if entry["outcome"] == "fixed":
            report.status = "fixed"
            report.patch = entry["patch"]
            report.tests_after = entry["fresh_check"]
            report.test_edits = entry["test_edits"]
            report.explanation = (env.final_text or "").strip() or explain(
                report.patch, env.fresh, runner.command
            )
            break
        if entry["outcome"] == "timeout":
            break
        feedback = (
            f"Attempt {attempt} did not fix the build: "
            + (entry.get("error") or _reason(info or {}))
            + ". Try a different change."
        )
        if info is not None and env.fresh is not None:
            report.tests_after = env.fresh.summary()
    report.wall_s = time.perf_counter() - t0
    return report


def _save_transcript(folder: Path | None, entry: dict[str, Any], transcript: Any) -> None:
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"attempt-{entry['attempt']}.json"
    path.write_text(json.dumps({**entry, "transcript": transcript}, indent=1, default=str))
