from __future__ import annotations

import pytest

from posttrain.envs import get_domain, run_episode

from .conftest import run, step_twice


def _score(task, text):
    d = get_domain("math")
    return run(run_episode(d.make_env(), task, [text]))


def test_level0_is_one_step_small_addition_or_subtraction():
    d = get_domain("math")
    for i in range(20):
        t = d.task("train", 0, i)
        a, op, b = t.meta["question"].removeprefix("Calculate ").rstrip(".").split()
        assert op in "+-" and 0 <= int(a) <= 10 and 0 <= int(b) <= 10
        assert int(t.meta["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert "between <answer> and </answer>" in t.prompt[-1].content


def test_reward_weighting():
    d = get_domain("math")
    task = d.task("train", 0, 0)
    ans = task.meta["answer"]
    wrong = str(int(ans) + 1)
    cases = {
        f"<answer>{ans}</answer>": (1.0, 1.0, 1.0),
        f"The answer is {ans}.": (0.85, 1.0, 0.0),  # correct, but not in the requested tags
        f"<answer>{wrong}</answer>": (0.15, 0.0, 1.0),  # format only
        f"<answer> {ans}.0 </answer>": (1.0, 1.0, 1.0),  # numeric normalisation
        "": (0.0, 0.0, 0.0),
    }
    for text, (reward, correct, fmt) in cases.items():
        res = _score(task, text)
        assert res.reward == pytest.approx(reward), text
        assert res.rewards == {"correct": correct, "format": fmt, "success": correct}, text


def test_dataset_scorer_partial_credit_is_used():
    # reasoning-gym's default scorer gives len(oracle)/len(answer) when the oracle is a substring
    d = get_domain("math", datasets=["letter_counting"])
    task = d.task("train", 0, 0)
    ans = task.meta["answer"]
    res = _score(task, f"<answer>{ans} x</answer>")
    assert res.rewards["correct"] == pytest.approx(len(ans) / len(ans + " x"))
    assert (
        0.0 < res.rewards["correct"] < 1.0 and res.rewards["success"] == 0.0
    )  # partial credit is no success


def test_any_reasoning_gym_dataset_by_name_with_config():
    d = get_domain("math", datasets={"chain_sum": {"min_terms": 3, "max_terms": 3, "max_digits": 1}})
    assert d.difficulties == [0]
    task = d.task("heldout", 0, 4)
    assert (
        task.meta["dataset"] == "chain_sum"
        and task.meta["question"].count("+") + task.meta["question"].count("-") >= 2
    )
    assert _score(task, d.reference(task)[0]).reward == 1.0


def test_unknown_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown reasoning-gym dataset 'gsm9k'"):
        get_domain("math", datasets=["gsm9k"])


def test_step_after_done_repeats_the_result():
    d = get_domain("math")
    task = d.task("train", 0, 0)
    first, again = step_twice(d, task, "<answer>nonsense</answer>")
    assert first.done and again.reward == first.reward == 1.0


def test_levels_make_each_entry_its_own_difficulty():
    d = get_domain(
        "math",
        levels=["gcd", {"chain_sum": {"min_terms": 3, "max_terms": 3, "max_digits": 1}}, ["lcm", "products"]],
    )
    assert d.difficulties == [0, 1, 2]
    assert {d.task("train", 0, i).meta["dataset"] for i in range(6)} == {"gcd"}
    assert {d.task("heldout", 1, i).meta["dataset"] for i in range(6)} == {"chain_sum"}
    assert {d.task("train", 2, i).meta["dataset"] for i in range(20)} == {"lcm", "products"}
    task = d.task("heldout", 1, 3)
    assert task.id.endswith(":d1:s0:3") and _score(task, d.reference(task)[0]).reward == 1.0
    with pytest.raises(ValueError, match="has no difficulty 3"):
        d.task("train", 3, 0)


def test_levels_errors_name_the_level():
    with pytest.raises(ValueError, match="give 'datasets' \\(one level\\) or 'levels'"):
        get_domain("math", datasets=["gcd"], levels=["gcd"])
    with pytest.raises(ValueError, match="'levels' must be a non-empty list"):
        get_domain("math", levels=[])
    with pytest.raises(ValueError, match="levels\\[1\\]: unknown reasoning-gym dataset 'gsm9k'"):
        get_domain("math", levels=["gcd", "gsm9k"])
    with pytest.raises(ValueError, match="levels\\[0\\]: dataset 'gcd' refuses config"):
        get_domain("math", levels=[{"gcd": {"min_value": 50, "max_value": 10}}])
