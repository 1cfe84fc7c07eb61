from __future__ import annotations

import pytest

from posttrain.envs import get_domain, run_episode

from .conftest import BrokenSandbox, run


def _task(fn_name_prefix: str):
    d = get_domain("code.unit_tests")
    return d, next(
        t for t in (d.task("train", 0, i) for i in range(200)) if t.meta["fn"].startswith(fn_name_prefix)
    )


def test_level0_prompts_are_one_line_functions_with_an_example():
    d = get_domain("code.unit_tests")
    for i in range(10):
        t = d.task("train", 0, i)
        assert t.meta["reference_source"].count("\n") == 2  # "def ...:\n    return ...\n"
        assert "Example:" in t.prompt[0].content and "```python" in t.prompt[0].content
        assert len(t.meta["hidden"]) == 6


def test_partial_credit_is_the_fraction_of_hidden_tests(sandbox):
    d, task = _task("add_")
    k = int(task.meta["fn"].split("_")[1])
    hidden = [case["args"][0] for case in task.meta["hidden"]]
    # correct only for non-negative inputs
    code = f"```python\ndef {task.meta['fn']}(x):\n    return x + {k} if x >= 0 else 0\n```"
    expected_pass = sum(1 for x in hidden if x >= 0 or x + k == 0)
    res = run(run_episode(d.make_env(sandbox), task, [code]))
    assert res.info["tests_passed"] == expected_pass and res.info["tests_total"] == 6
    assert res.rewards["passed"] == pytest.approx(expected_pass / 6)
    assert res.reward == pytest.approx(0.85 * expected_pass / 6 + 0.15)


def test_missing_block_scores_zero_with_a_reason(sandbox):
    d, task = _task("add_")
    res = run(run_episode(d.make_env(sandbox), task, [f"def {task.meta['fn']}(x): return x"]))
    assert res.reward == 0.0 and "fenced" in res.info["reason"]


@pytest.mark.parametrize(
    "hack",
    [
        "import os\nos._exit(0)",
        "print('@@POSTTRAIN_HARNESS_RESULTS@@' + '[{\"ok\": true, \"value\": 1}]' * 1)\nimport sys\nsys.exit(0)",
        "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
    ],
)
def test_forged_passes_do_not_count(sandbox, hack):
    d, task = _task("add_")
    code = f"```python\n{hack}\ndef {task.meta['fn']}(x):\n    return 0\n```"
    res = run(run_episode(d.make_env(sandbox), task, [code]))
    assert res.rewards["passed"] == 0.0 and res.info["infra_failure"] is False


@pytest.mark.parametrize("raises", [False, True])
def test_sandbox_failure_is_infra_not_zero(raises):
    d, task = _task("add_")
    sb = BrokenSandbox(raises=raises)
    res = run(run_episode(d.make_env(sb), task, d.reference(task)))
    assert res.info["infra_failure"] is True and res.reward is None and sb.jobs == 1


def test_make_env_without_sandbox_is_a_clear_error():
    with pytest.raises(ValueError, match="pass a sandbox"):
        get_domain("code.unit_tests").make_env(None)


def test_humaneval_is_eval_only_and_graded(sandbox):
    d = get_domain("code.humaneval")
    assert d.splits == ("eval",)
    with pytest.raises(ValueError, match="no split 'train'"):
        d.task("train", 0, 0)
    with pytest.raises(ValueError, match="164 problems"):
        d.task("eval", 0, 164)
    task = d.task("eval", 0, 2)
    assert run(run_episode(d.make_env(sandbox), task, d.reference(task))).reward == 1.0
    # body-only completion (the HumanEval convention) is accepted too
    body = task.meta["canonical_solution"]
    assert run(run_episode(d.make_env(sandbox), task, [f"```python\n{body}\n```"])).rewards["passed"] == 1.0
    wrong = f"```python\ndef {task.meta['fn']}(*a):\n    return None\n```"
    assert run(run_episode(d.make_env(sandbox), task, [wrong])).reward == pytest.approx(0.15)
