"""`swe.ci_fix`: "fix the failing build". A generated Python repository (3-8 modules under `app/`, tests
under `tests/`) with one injected bug. The first prompt and the tools are the ones the CI auto-fix agent
uses (`envs.repo_tools`): the repository map, the failing test log and the files it names; `read_file`,
`search`, `list_dir`, `apply_patch`, `write_file`, `run_tests` and `submit`. All test runs go through
the sandbox.

Reward = fixed * kept, and 0 when a test or a protected file was touched: `fixed` = the fraction of the
originally failing tests that pass now, `kept` = the fraction of the originally passing tests that
still pass. Tests that passed before any edit earn nothing by themselves (doing nothing scores 0), and
breaking them scales the credit for a fix down in proportion. `success` = 1 only when every test passes
and nothing protected was touched. Components: `fixed`, `kept`, `passed` (fraction of all tests),
`tests_untouched`, `success`. Protected: everything under `tests/` (edits score 0) and every file that
steers a test run anywhere in the tree - conftest.py, pytest.ini, pyproject.toml, setup.cfg, tox.ini,
sitecustomize.py, usercustomize.py, *.pth - which `write_file` refuses and which also score 0.
Levels: 0 = 3 modules and an operator/constant bug; 1 = 4-5 modules, any mutation; 2 = 6-8 modules.

Tests run in the trusted runner (`envs.harness`) from the ORIGINAL test files of the task; the model's
`app/` runs in a separate `python -I -S` subject process that only answers calls with plain values, so
nothing the model writes (an `app/__init__.py` that exits, forges output, kills the runner or patches
`builtins`/`unittest`) can pass a test. Residual risk: code that special-cases the exact inputs the
visible tests use (the tests are readable) passes them without being a general fix.

Generation checks that the bug makes at least one test fail by running the generated tests with the
same harness in a local subprocess (our own generated code only, never model output).
"""

from __future__ import annotations

import ast
import json
import random
from functools import lru_cache
from typing import Any

from posttrain.envs.base import Domain, Environment
from posttrain.envs.domains import swe_repos as repos
from posttrain.envs.harness import build_job, module_name, module_tests, parse_result, run_locally
from posttrain.envs.parsers import get_parser
from posttrain.envs.registry import register_env
from posttrain.envs.repo_tools import TOOL_SPECS, RepoFiles, fix_prompt, repo_tools
from posttrain.envs.tool_env import ToolEnvironment
from posttrain.envs.tools import InfraError, Tool, ToolError
from posttrain.types import Message, Task

MAX_FILES = 60
STEERING_FILES = frozenset(
    {
        "conftest.py",
        "pytest.ini",
        "pyproject.toml",
        "setup.cfg",
        "tox.ini",
        "sitecustomize.py",
        "usercustomize.py",
    }
)
LEVELS = {
    0: ((3, 3), ("wrong_operator", "off_by_one")),
    1: ((4, 5), repos.MUTATION_KINDS),
    2: ((6, 8), repos.MUTATION_KINDS),
}


def test_ids(files: dict[str, str]) -> list[str]:
    """'tests/test_x.py::test_name' for every test function, in file order."""
    out = []
    for path in sorted(files):
        if path.startswith("tests/test_") and path.endswith(".py"):
            try:
                tree = ast.parse(files[path])
            except SyntaxError:
                continue
            out += [
                f"{path}::{n.name}"
                for n in tree.body
                if isinstance(n, ast.FunctionDef) and n.name.startswith("test")
            ]
    return out


def is_test_file(path: str) -> bool:
    return path.startswith("tests/")


def is_steering_file(path: str) -> bool:
    """A file that changes how tests are collected or how Python starts, wherever it sits."""
    name = path.rsplit("/", 1)[-1]
    return name in STEERING_FILES or name.endswith(".pth")


def refuse_steering(path: str) -> str | None:
    """Why `write_file`/`apply_patch` refuse `path` (None: allowed; test edits are allowed and score 0)."""
    if is_steering_file(path):
        return (
            f"'{path}' steers the test run (conftest.py, pytest.ini, pyproject.toml, "
            "setup.cfg, tox.ini, sitecustomize.py, usercustomize.py and .pth files are protected); "
            "fix the code under app/ instead"
        )
    return None


def touched_protected(files: dict[str, str], original: dict[str, str]) -> list[str]:
    """Test and steering files that differ from (or are missing from, or are new to) the original."""
    return sorted(
        p
        for p in set(files) | set(original)
        if (is_test_file(p) or is_steering_file(p)) and files.get(p) != original.get(p)
    )


def tests_job(files: dict[str, str], original: dict[str, str], ids: list[str], per_test_timeout_s: float):
    """The ORIGINAL test modules run in the trusted runner; the working tree (minus tests and steering
    files) is what the subject imports `app` from."""
    trusted = {name: src for p, src in original.items() if is_test_file(p) and (name := module_name(p))}
    tree = {p: c.encode() for p, c in files.items() if not is_test_file(p) and not is_steering_file(p)}
    return build_job(
        module_tests(ids),
        modules=trusted,
        proxy_packages=(repos.PKG,),
        files=tree,
        subject_path=(".",),
        per_test_timeout_s=per_test_timeout_s,
    )


def run_tests_locally(files: dict[str, str], ids: list[str]) -> list[dict[str, Any]]:
    """Run OUR generated repository's tests in a subprocess (generation-time check only)."""
    hjob = tests_job(files, files, ids, per_test_timeout_s=5.0)
    return parse_result(run_locally(hjob), hjob).results


def build_repo(rng: random.Random, n_modules: int) -> dict[str, str]:
    a, b = rng.randint(1, 9), rng.randint(2, 7)
    files = {f"{repos.PKG}/__init__.py": "", "tests/__init__.py": ""}
    for name in repos.choose_modules(rng, n_modules):
        t = repos.BY_NAME[name]
        files[f"{repos.PKG}/{name}.py"] = ast.unparse(ast.parse(repos.fill(t.source, a, b))) + "\n"
        files[f"tests/test_{name}.py"] = repos.fill(t.tests, a, b)
    return files


@lru_cache(maxsize=256)
def _verified_bug(files_json: str, order_json: str) -> tuple[str, str, str, list[dict[str, Any]]] | None:
    """The first mutation in `order` that breaks at least one test: (path, kind#site, mutated, results)."""
    files = json.loads(files_json)
    ids = test_ids(files)
    funcs = {
        f"{repos.PKG}.{p[len(repos.PKG) + 1 : -3]}": repos.public_functions(src)
        for p, src in files.items()
        if p.startswith(repos.PKG + "/") and p.endswith(".py")
    }
    for path, kind, site in json.loads(order_json):
        mutated = repos.apply_mutation(files[path], repos.Mutation(kind, site), funcs)
        if mutated is None or mutated == files[path]:
            continue
        results = run_tests_locally({**files, path: mutated}, ids)
        if not all(r.get("ok") for r in results):
            return path, f"{kind}#{site}", mutated, results
    return None


def format_test_log(ids: list[str], results: list[dict[str, Any]], max_chars: int = 3000) -> str:
    failed = [(t, r) for t, r in zip(ids, results, strict=True) if not r.get("ok")]
    lines = [f"{len(ids) - len(failed)} passed, {len(failed)} failed"]
    for t, r in failed:
        err = (r.get("error") or "").strip().splitlines()
        lines.append(f"FAILED {t}")
        lines += ["    " + e for e in err[-4:]]
    text = "\n".join(lines)
    return text if len(text) <= max_chars else text[:max_chars] + "\n... (truncated)"


class CiFixEnv(ToolEnvironment):
    terminal_tools = frozenset({"submit"})

    def __init__(self, sandbox: Any, chat_format: str = "smollm2", max_turns: int = 10) -> None:
        super().__init__(chat_format, max_turns)
        self.sandbox = sandbox

    async def _run(self, files: dict[str, str]) -> tuple[list[str], list[dict[str, Any]]]:
        original = self.task.meta["original_files"]
        ids = test_ids(original)
        hjob = tests_job(files, original, ids, per_test_timeout_s=2.0)
        try:
            result = await self.sandbox.run(hjob.job)
        except Exception as err:  # noqa: BLE001 - a sandbox that raises is an infrastructure failure
            raise InfraError(f"{type(err).__name__}: {err}") from err
        report = parse_result(result, hjob)
        if report.infra_failure:
            raise InfraError(report.error)
        return ids, report.results

    async def setup(self, task: Task) -> tuple[list[Message], dict[str, Tool]]:
        self.repo = RepoFiles(task.meta["files"], refuse_steering, max_files=MAX_FILES)
        self.max_turns = int(task.meta.get("max_turns", self.max_turns))
        return list(task.prompt), repo_tools(self.repo, self.run_tests, self.submit)

    @property
    def files(self) -> dict[str, str]:
        return self.repo.files

    async def run_tests(self, tests: list[str] | None = None) -> str:
        ids, results = await self._run(self.files)
        if tests:
            chosen = [i for i, t in enumerate(ids) if any(t == s or t.startswith(s + "::") for s in tests)]
            if not chosen:
                raise ToolError("not_found", f"no test matches {tests} (tests look like {ids[0]})")
            ids, results = [ids[i] for i in chosen], [results[i] for i in chosen]
        return format_test_log(ids, results)

    def submit(self) -> str:
        return "submitted"

    async def score(self) -> tuple[float, dict[str, float], dict[str, Any]]:
        meta = self.task.meta
        touched = touched_protected(self.files, meta["original_files"])
        ids, results = await self._run(self.files)
        now_passing = {t for t, r in zip(ids, results, strict=True) if r.get("ok") is True}
        failing_before = set(meta["failing_tests"])
        passing_before = set(ids) - failing_before
        fixed = len(failing_before & now_passing) / max(1, len(failing_before))
        kept = len(passing_before & now_passing) / len(passing_before) if passing_before else 1.0
        passed = len(now_passing) / max(1, len(ids))
        untouched = 0.0 if touched else 1.0
        success = float(untouched == 1.0 and len(now_passing) == len(ids))
        info = {
            "tests_passed": len(now_passing),
            "tests_total": len(ids),
            "modified_tests": touched[:10],
            "submitted": self.called_terminal,
        }
        rewards = {
            "fixed": fixed,
            "kept": kept,
            "passed": passed,
            "tests_untouched": untouched,
            "success": success,
        }
        return fixed * kept * untouched, rewards, info


@register_env("swe.ci_fix")
class CiFixDomain(Domain):
    difficulties = [0, 1, 2]
    requires_sandbox = True
    description = "generated multi-module repo with an injected bug; fix it with read/write/run_tests/submit"

    def __init__(self, max_turns: int = 10) -> None:
        if max_turns < 1:
            raise ValueError(f"swe.ci_fix: max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns

    def task(self, split: str, difficulty: int, index: int, seed: int = 0) -> Task:
        (lo, hi), kinds = LEVELS[difficulty]

        def make(rng: random.Random):
            files = build_repo(rng, rng.randint(lo, hi))
            sites = [
                (p, m.kind, m.site)
                for p in sorted(files)
                if p.startswith(repos.PKG + "/") and files[p]
                for m in repos.candidate_mutations(files[p])
                if m.kind in kinds
            ]
            rng.shuffle(sites)
            # The split is decided by the repository alone (before the costly bug search), so a repository
            # and every bug injected into it belong to one split only.
            key = json.dumps(files, sort_keys=True)

            def build() -> Task | None:
                found = _verified_bug(key, json.dumps(sites[:40]))
                if found is None:
                    return None
                path, mutation, mutated, results = found
                buggy = {**files, path: mutated}
                ids = test_ids(files)
                meta = {
                    "files": buggy,
                    "original_files": files,
                    "bug_path": path,
                    "mutation": mutation,
                    "failing_tests": [t for t, r in zip(ids, results, strict=True) if not r.get("ok")],
                    "fixed_source": files[path],
                    "max_turns": self.max_turns,
                }
                prompt = fix_prompt(format_test_log(ids, results), buggy)
                return Task(
                    id="",
                    domain=self.name,
                    difficulty=difficulty,
                    prompt=prompt,
                    tools=list(TOOL_SPECS.values()),
                    meta=meta,
                )

            return key, build

        return self.draw(split, difficulty, index, seed, make)

    def reference(self, task: Task, chat_format: str = "smollm2") -> list[str]:
        fmt = get_parser(chat_format)
        path = task.meta["bug_path"]
        return [
            fmt.format_calls([("read_file", {"path": path})]),
            fmt.format_calls([("write_file", {"path": path, "content": task.meta["fixed_source"]})]),
            fmt.format_calls([("run_tests", {})]),
            fmt.format_calls([("submit", {})]),
        ]

    def make_env(self, sandbox: Any = None, chat_format: str = "smollm2") -> Environment:
        if sandbox is None:
            raise ValueError(
                "domain 'swe.ci_fix' runs tests: pass a sandbox to make_env "
                "(posttrain.sandbox.make_sandbox(cfg))"
            )
        return CiFixEnv(sandbox, chat_format, self.max_turns)
