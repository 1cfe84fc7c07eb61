from __future__ import annotations

import pytest

from posttrain.envs.extract import extract_answer, extract_code, normalize_number


@pytest.mark.parametrize(
    "text, answer, method",
    [
        ("<answer> 7 </answer>", "7", "tags"),
        ("<answer>1</answer> then <answer>2</answer>", "2", "tags"),
        ("so \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}", "boxed"),
        ("The answer is 7. I am sure", "7", "phrase"),
        ("answer: -3", "-3", "phrase"),
        ("I got 3, then 4.5 and finally 1,200", "1200", "last_number"),
        ("no digits here", None, "none"),
        ("", None, "none"),
    ],
)
def test_extract_answer_rules_in_order(text, answer, method):
    got = extract_answer(text)
    assert (got.text, got.method) == (answer, method)


def test_extract_answer_survives_huge_and_odd_input():
    assert extract_answer("x" * 1_000_000 + " 42").text == "42"
    assert extract_answer("\\boxed{" * 1000).method in ("phrase", "last_number", "none")
    assert extract_answer(None).method == "none"  # type: ignore[arg-type]


def test_normalize_number():
    assert [normalize_number(s) for s in ["7.0", "1,234", "+5", "-0", "abc", "0.50"]] == [
        "7",
        "1234",
        "5",
        "0",
        "abc",
        "0.5",
    ]


def test_extract_code_takes_last_python_or_bare_block():
    text = "```js\nx\n```\n```python\ndef a(): pass\n```\ntext\n```\ndef b(): pass\n```"
    assert extract_code(text) == "def b(): pass\n"
    assert extract_code("no code") is None
    assert extract_code("```python\n   \n```") is None


def test_extract_code_prefers_the_block_defining_the_function():
    text = "```python\ndef f(x):\n    return x\n```\nUsage:\n```python\nprint(f(3))\n```"
    assert extract_code(text, prefer=r"^\s*def\s+f\s*\(") == "def f(x):\n    return x\n"
    assert extract_code(text) == "print(f(3))\n"
    assert extract_code(text, prefer=r"^\s*def\s+g\s*\(") == "print(f(3))\n"
