"""Graders: exact per-test outcomes, and the harness is not fooled by forged lines or exits."""

import asyncio

import pytest

from posttrain.sandbox import ExecStatus, Limits
from posttrain.sandbox.grading import grade_asserts, grade_io, outputs_match

SQUARE = "def sq(x):\n    return x * x\n"
TESTS = ["assert sq(2) == 4", "assert sq(3) == 10", "assert sq(-1) == 1", "assert sq(0) == 1"]


def grade(sb, code, tests=TESTS, **kw):
    return asyncio.run(grade_asserts(sb, code, tests, **kw))


def test_per_test_results_and_fraction(sandbox):
    g = grade(sandbox, SQUARE)
    assert g.per_test == [True, False, True, False]
    assert (g.passed, g.total, g.fraction, g.status, g.infra_failure) == (2, 4, 0.5, ExecStatus.OK, False)


@pytest.mark.parametrize(
    "forger",
    [
        # prints lines in the harness format with guessed nonces, then exits before the tests run
        "import sys\nfor i in range(4):\n    print('\\n0 %d 1' % i)\nsys.exit(0)\n",
        "import os\nprint('x 0 1\\nx 1 1', flush=True)\nos._exit(0)\n",
        "import sys\nsys.stdout.close()\n" + SQUARE,
    ],
)
def test_forged_lines_and_early_exit_earn_nothing(sandbox, forger):
    g = grade(sandbox, forger)
    if "sq" in forger:  # closing sys.stdout does not stop the harness's private fd
        assert g.per_test == [True, False, True, False]
    else:
        assert g.passed == 0 and g.per_test == [False] * 4 and not g.infra_failure


def test_exit_inside_a_test_fails_only_that_test(sandbox):
    code = SQUARE + "def boom():\n    raise SystemExit(0)\n"
    g = grade(sandbox, code, ["assert sq(2) == 4", "boom()", "assert sq(3) == 9"])
    assert g.per_test == [True, False, True]


def test_a_job_that_never_completes_credits_nothing(sandbox):
    # the verdict needs the runner's own completion: earlier passes of a job killed at its wall limit
    # do not count
    g = grade(
        sandbox,
        SQUARE,
        ["assert sq(2) == 4", "while True: pass", "assert sq(3) == 9"],
        limits=Limits(wall_time_s=0.5),
    )
    assert g.per_test == [False, False, False] and g.status == ExecStatus.TIMEOUT
    assert "did not complete" in g.detail and not g.infra_failure


def test_per_test_timeout(sandbox):
    g = grade(
        sandbox,
        SQUARE,
        ["assert sq(2) == 4", "while True: pass", "assert sq(3) == 9"],
        per_test_timeout_s=0.2,
    )
    assert g.per_test == [True, False, True] and g.status == ExecStatus.OK


def test_outputs_match_rules():
    assert outputs_match("1 2  \n3\n\n\n", "1 2\n3")
    assert not outputs_match("1 2\n3", "1 2\n4")
    assert not outputs_match("0.3333", "0.3333333", None)
    assert outputs_match("0.3333", "0.3333333", 1e-3)
    assert not outputs_match("0.33", "0.3333333", 1e-3)
    assert not outputs_match("abc 1.0", "abd 1.0", 1e-3)


def test_grade_io_python_and_c(sandbox):
    cases = [("2 3\n", "5\n"), ("10 -4\n", "6"), ("1 1\n", "3\n")]
    g = asyncio.run(grade_io(sandbox, "a, b = map(int, input().split())\nprint(a + b)   ", cases))
    assert g.per_test == [True, True, False] and g.passed == 2
    c = '#include <stdio.h>\nint main(){int a,b;scanf("%d %d",&a,&b);printf("%d  \\n",a+b);}'
    assert asyncio.run(grade_io(sandbox, c, cases, language="c")).per_test == [True, True, False]
    bad = asyncio.run(grade_io(sandbox, "int main( {", cases, language="c"))
    assert bad.status == ExecStatus.COMPILE_ERROR and bad.passed == 0 and not bad.infra_failure


def test_grade_io_float_tolerance(sandbox):
    code = "print(1/3)"
    assert asyncio.run(grade_io(sandbox, code, [("", "0.333")], float_tol=1e-3)).passed == 1
    assert asyncio.run(grade_io(sandbox, code, [("", "0.333")])).passed == 0
