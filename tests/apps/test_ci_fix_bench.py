"""The real-project suite is sound (each task's check fails as committed and passes with its known fix,
in the sandbox), and `posttrain bench ci-fix --json` reports its named figures."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from posttrain.apps.ci_fix import CheckRunner
from posttrain.bench.ci_fix import SUITE_DIR, suite_tasks, wilson_interval
from posttrain.cli.bench import run_bench
from posttrain.envs.repo_tools import apply_patch

BUG_CLASSES = {
    "off_by_one",
    "wrong_operator",
    "missing_none_check",
    "wrong_default",
    "import_error",
    "api_misuse",
}


def _bug_class(task) -> str:
    return json.loads((SUITE_DIR / task.name / "task.json").read_text())["bug_class"]


@pytest.mark.parametrize("which", ["core", pytest.param("all", marks=pytest.mark.slow)])
def test_suite_tasks_fail_as_committed_and_pass_with_their_fix(sandbox, which):
    """`core`: one task of each bug class the issue names (fast); `all`: every task (slow)."""
    tasks = suite_tasks(SUITE_DIR)
    assert len(tasks) >= 12 and BUG_CLASSES <= {_bug_class(t) for t in tasks}
    if which == "core":
        tasks = [t for t in tasks if _bug_class(t) in BUG_CLASSES]

    async def both(t):
        runner = CheckRunner(sandbox, t.command)
        return await asyncio.gather(runner.run(t.files), runner.run(apply_patch(t.files, t.fix_patch)))

    async def all_tasks():
        return await asyncio.gather(*(both(t) for t in tasks))

    for t, (before, after) in zip(tasks, asyncio.run(all_tasks()), strict=True):
        assert not before.passed and before.counts.get("failed", 0) + before.counts.get("errors", 0) >= 1, (
            t.name
        )
        assert after.passed and after.counts.get("failed", 0) == 0, (t.name, after.log)


def test_bench_ci_fix_json(tmp_path, capsys):
    suite = tmp_path / "suite"
    shutil.copytree(SUITE_DIR / "temperature", suite / "temperature")
    out = run_bench(
        "ci-fix",
        [
            "--model",
            "tiny:llama",
            "--suite",
            str(suite),
            "--swe-n",
            "0",
            "--max-turns",
            "1",
            "--set",
            "engine.max_new_tokens=4",
            "--json",
        ],
    )
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == json.loads(json.dumps(out))
    assert out["n_tasks"] == 1 and out["n_by_source"] == {"suite": 1}
    assert out["reference_fix_rate"] == 1.0  # the known fixes verify through the same harness
    assert out["fix_rate"] == {"tiny:llama": 0.0}
    assert out["fix_rate_ci"]["tiny:llama"] == pytest.approx([0.0, 0.79346], abs=1e-5)  # Wilson, 0 of 1
    assert out["median_wall_s"]["tiny:llama"] > 0 and out["attempts_per_fix"] == {"tiny:llama": None}
    assert [(r["task"], r["status"]) for r in out["tasks"]["tiny:llama"]] == [("temperature", "not_fixed")]


def test_wilson_interval_by_hand():
    # centre (p + z^2/2n) / (1 + z^2/n), half-width z sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n), z = 1.96
    assert wilson_interval(0, 26) == pytest.approx((0.0, 0.128734), abs=1e-6)
    assert wilson_interval(5, 10) == pytest.approx((0.236590, 0.763410), abs=1e-6)
    assert wilson_interval(10, 10) == pytest.approx((0.722460, 1.0), abs=1e-6)
