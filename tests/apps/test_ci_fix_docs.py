"""The CI integration examples of docs/ci-fix.md: the shell of the GitHub Actions "Fix the build" step
and of the GitLab job's `script`, extracted from the document and run as written (bash -eo pipefail,
as both CI systems run them) in a planted repository against a scripted endpoint on 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import FIX_PATCH, FIXED_OPS, git
from .test_ci_fix import fmt_call

DOC = Path(__file__).resolve().parents[2] / "docs" / "ci-fix.md"


def yaml_blocks() -> list[dict]:
    return [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.DOTALL)]


def github_fix_step() -> str:
    workflow = next(b for b in yaml_blocks() if "jobs" in b)
    return next(s for s in workflow["jobs"]["fix"]["steps"] if s.get("name") == "Fix the build")["run"]


def gitlab_script() -> str:
    job = next(b for b in yaml_blocks() if "ci-fix" in b)["ci-fix"]
    assert job["when"] == "on_failure" and job["artifacts"]["paths"] == ["ci-fix/"]
    return "\n".join(job["script"])


SCRIPT = [
    fmt_call("apply_patch", {"patch": FIX_PATCH}),
    fmt_call("run_tests", {}),
    fmt_call("submit", {}),
]


@pytest.mark.parametrize("ci", ["github", pytest.param("gitlab", marks=pytest.mark.slow)])
def test_the_documented_ci_steps_fix_a_planted_repo(ci, planted, canned_server, tmp_path):
    url, _ = canned_server(SCRIPT)
    script = github_fix_step() if ci == "github" else gitlab_script()
    outputs = tmp_path / "github_output"
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "POSTTRAIN_API_BASE": url,
        "POSTTRAIN_MODEL": "canned",
        "CHECK_COMMAND": "pytest -q",
        "GITHUB_OUTPUT": str(outputs),
    }
    proc = subprocess.run(
        ["bash", "-eo", "pipefail", "-c", script],
        cwd=planted,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((planted / "ci-fix" / "summary.json").read_text())
    assert summary["fixed"] is True and summary["attempts"] == 1
    patch = (planted / "ci-fix" / "fix.patch").read_text()
    assert patch == summary["patch"] and (planted / "ci-fix" / "transcripts" / "attempt-1.json").is_file()
    git(planted, "apply", "ci-fix/fix.patch")
    assert (planted / "calc/ops.py").read_text() == FIXED_OPS
    if ci == "github":
        assert outputs.read_text().splitlines() == ["exit=0", "fixed=true"]
