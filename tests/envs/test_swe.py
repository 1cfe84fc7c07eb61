from __future__ import annotations

import pytest

from posttrain.envs import get_domain, run_episode
from posttrain.envs.domains import swe_repos as repos
from posttrain.envs.parsers import get_parser

from .conftest import BrokenSandbox, run

CALL = get_parser("smollm2").format_calls


def test_mutations_are_exact_source_edits():
    src = "def f(a, b):\n    if a < b:\n        return g(a, b)\n    return a + 1\n"
    funcs = {"app.m": ["x", "y"]}
    assert repos.apply_mutation(src, repos.Mutation("wrong_operator", 0), funcs) == (
        "def f(a, b):\n    if a <= b:\n        return g(a, b)\n    return a + 1\n"
    )
    assert "return a + 2" in repos.apply_mutation(src, repos.Mutation("off_by_one", 0), funcs)
    assert "return g(b, a)" in repos.apply_mutation(src, repos.Mutation("swapped_args", 0), funcs)
    assert (
        repos.apply_mutation(src, repos.Mutation("missing_case", 0), funcs)
        == "def f(a, b):\n    return a + 1\n"
    )
    imp = "from app.m import x\n"
    assert repos.apply_mutation(imp, repos.Mutation("wrong_import", 0), funcs) == "from app.m import y as x\n"
    assert repos.apply_mutation(src, repos.Mutation("off_by_one", 9), funcs) is None


def test_generated_repo_has_tests_that_catch_the_bug():
    d = get_domain("swe.ci_fix")
    task = d.task("train", 1, 0)
    files = task.meta["files"]
    assert 4 <= sum(p.startswith("app/") and p != "app/__init__.py" for p in files) <= 5
    assert task.meta["failing_tests"] and "FAILED " + task.meta["failing_tests"][0] in task.prompt[1].content
    assert files[task.meta["bug_path"]] != task.meta["original_files"][task.meta["bug_path"]]


def test_doing_nothing_scores_zero_though_most_tests_pass(sandbox):
    d = get_domain("swe.ci_fix")
    task = d.task("train", 0, 1)
    res = run(run_episode(d.make_env(sandbox), task, [CALL([("submit", {})])]))
    total = res.info["tests_total"]
    assert res.rewards["passed"] == pytest.approx((total - len(task.meta["failing_tests"])) / total)
    assert res.rewards["passed"] > 0.5
    assert (res.rewards["fixed"], res.rewards["kept"], res.rewards["success"], res.reward) == (
        0.0,
        1.0,
        0.0,
        0.0,
    )


def test_a_fix_that_breaks_passing_tests_is_scaled_by_what_it_kept(sandbox):
    d = get_domain("swe.ci_fix")
    task = next(t for t in (d.task("train", 1, i) for i in range(20)) if _leaf_module(t))
    leaf = _leaf_module(task)
    ids = [t for f in sorted(task.meta["original_files"]) for t in _ids_of(task, f)]
    broken = [t for t in ids if f"from app.{leaf} import" in task.meta["original_files"][t.split("::")[0]]]
    passing_before = [t for t in ids if t not in task.meta["failing_tests"]]
    fix = d.reference(task)[1]
    breaker = CALL([("write_file", {"path": f"app/{leaf}.py", "content": "raise RuntimeError('broken')\n"})])
    res = run(run_episode(d.make_env(sandbox), task, [fix, breaker, CALL([("submit", {})])]))
    kept = (len(passing_before) - len(broken)) / len(passing_before)
    assert broken and res.rewards["fixed"] == 1.0 and res.rewards["kept"] == pytest.approx(kept)
    assert res.reward == pytest.approx(kept) and res.rewards["success"] == 0.0


def _ids_of(task, path):
    from posttrain.envs.domains.swe_ci_fix import test_ids

    return test_ids({path: task.meta["original_files"][path]})


def _leaf_module(task):
    """An app module other than the buggy one that no other app module imports."""
    files = task.meta["original_files"]
    for path in sorted(files):
        name = path[len("app/") : -3]
        if not path.startswith("app/") or name == "__init__" or path == task.meta["bug_path"]:
            continue
        if not any(f"app.{name}" in src for p, src in files.items() if p.startswith("app/") and p != path):
            return name
    return None


def test_modifying_tests_scores_zero(sandbox):
    d = get_domain("swe.ci_fix")
    task = d.task("train", 0, 1)
    failing_file = task.meta["failing_tests"][0].split("::")[0]
    fix = d.reference(task)[1]
    tamper = CALL([("write_file", {"path": failing_file, "content": "def test_ok():\n    pass\n"})])
    res = run(run_episode(d.make_env(sandbox), task, [fix, tamper, CALL([("submit", {})])]))
    assert res.rewards["tests_untouched"] == 0.0 and res.reward == 0.0
    assert res.info["modified_tests"] == [failing_file]


def test_tools_reject_bad_paths_and_report_test_runs(sandbox):
    d = get_domain("swe.ci_fix")
    task = d.task("heldout", 0, 0)
    script = [
        CALL([("read_file", {"path": "../../etc/passwd"})]),
        CALL([("write_file", {"path": "/tmp/x.py", "content": ""})]),
        CALL([("run_tests", {})]),
        *d.reference(task),
    ]
    res = run(run_episode(d.make_env(sandbox), task, script))
    tool_msgs = [m.content for m in res.transcript if m.role == "tool"]
    assert '"error": "not_found"' in tool_msgs[0] and '"error": "invalid_argument"' in tool_msgs[1]
    assert f"{len(task.meta['failing_tests'])} failed" in tool_msgs[2]
    assert res.reward == 1.0 and res.info["tool_errors"] == 2


@pytest.mark.parametrize("raises", [False, True])
def test_sandbox_failure_is_infra_not_zero(raises):
    d = get_domain("swe.ci_fix")
    task = d.task("train", 0, 0)
    res = run(run_episode(d.make_env(BrokenSandbox(raises=raises)), task, d.reference(task)))
    assert res.info["infra_failure"] is True and res.reward is None and res.done
