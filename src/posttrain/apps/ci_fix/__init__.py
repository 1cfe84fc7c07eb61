"""The CI auto-fix agent (`posttrain agent ci-fix`): given a repository and its failing check, map the
code, change it with the shared repository tools, run the check in the sandbox until it passes, and
hand back a patch verified on a fresh copy. `check` runs the command in the jail, `repo` reads the work
tree and commits, `agent` is the loop and its policies. Imported by no layer below `apps`."""

from __future__ import annotations

from posttrain.apps.ci_fix.agent import (
    ApiPolicy,
    AttemptOutcome,
    EnginePolicy,
    FixOptions,
    FixReport,
    RepoFixEnv,
    fix_repository,
    is_test_path,
)
from posttrain.apps.ci_fix.check import CheckResult, CheckRunner, pytest_counts, read_wheels
from posttrain.apps.ci_fix.repo import Repo, RepoError, commit_patch, load_repo

__all__ = [
    "ApiPolicy",
    "AttemptOutcome",
    "CheckResult",
    "CheckRunner",
    "EnginePolicy",
    "FixOptions",
    "FixReport",
    "Repo",
    "RepoError",
    "RepoFixEnv",
    "commit_patch",
    "fix_repository",
    "is_test_path",
    "load_repo",
    "pytest_counts",
    "read_wheels",
]
