"""Forged passes earn nothing: every attack a policy could put in its submission - fake result lines,
writes to every inherited fd, exits, killing the runner, patched builtins/unittest/pytest, import hooks,
an `__eq__` that always says True, nonce hunting in frames, gc and /proc - scores as a FAIL in
swe.ci_fix, code.humaneval, code.unit_tests and grade_asserts, while correct solutions still pass and
wrong ones still fail. All through the real sandbox."""

from __future__ import annotations

import asyncio
import json

import pytest

from posttrain.envs import get_domain, run_episode
from posttrain.envs.domains.swe_ci_fix import test_ids as swe_test_ids
from posttrain.envs.harness import HarnessJob, build_job, call_tests, parse_result
from posttrain.envs.parsers import get_parser
from posttrain.sandbox.api import ExecResult, ExecStatus, Job
from posttrain.sandbox.grading import RESULT_MARKER, SPEC_FILE, grade_asserts

from .conftest import run

CALL = get_parser("smollm2").format_calls


def attacks(n: int) -> dict[str, str]:
    """Attack sources (module top level) that forge `n` passing tests in both the old harness's result
    format and the runner's (with a guessed nonce)."""
    fake = (
        f"\\n{RESULT_MARKER} {'0' * 32} "
        + json.dumps({"done": True, "results": [{"ok": True}] * n})
        + "\\n@@POSTTRAIN_HARNESS_RESULTS@@"
        + json.dumps([{"ok": True, "value": 0}] * n)
        + "\\n"
    )
    return {
        "fake_markers_on_stdout": f"import sys\nsys.stdout.write('{fake}')\nsys.stdout.flush()\n",
        "every_inherited_fd": (
            "import os\nfor fd in range(256):\n    try:\n        os.write(fd, b'{\"ok\": true}')\n"
            "    except OSError:\n        pass\nos._exit(0)\n"
        ),
        "os_exit_before_asserts": "import os\nos._exit(0)\n",
        "sys_exit_at_import": "import sys\nsys.exit(0)\n",
        "kill_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",
        "kill_everyone": "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    pass\n",
        "killpg_parent": "import os, signal\nos.killpg(os.getpgid(os.getppid()), signal.SIGKILL)\n",
        "fake_line_then_kill_parent": (
            f"import os, signal, sys\nsys.stdout.write('{fake}')\nsys.stdout.flush()\n"
            "os.kill(os.getppid(), signal.SIGKILL)\n"
        ),
        "patch_builtins": (
            "import builtins\nclass _Never(Exception):\n    pass\nbuiltins.AssertionError = _Never\n"
            "_real_import = builtins.__import__\n"
            "def _imp(name, *a, **k):\n    return _real_import(name, *a, **k)\n"
            "builtins.__import__ = _imp\nbuiltins.isinstance = lambda *a: True\nbuiltins.len = lambda *a: 0\n"
        ),
        "patch_unittest_pytest_sys_modules": (
            "import sys, types, unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n"
            "unittest.TestCase.assertTrue = lambda *a, **k: None\n"
            "fake = types.ModuleType('pytest')\nfake.raises = lambda *a, **k: None\nsys.modules['pytest'] = fake\n"
            "sys.modules['unittest'] = fake\n"
        ),
        "import_hook_rewrites_tests": (
            "import sys, importlib.abc, importlib.machinery\n"
            "class _Rewrite(importlib.abc.MetaPathFinder, importlib.abc.Loader):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.startswith('tests.'):\n"
            "            return importlib.machinery.ModuleSpec(name, self)\n"
            "    def create_module(self, spec):\n        return None\n"
            "    def exec_module(self, module):\n"
            "        module.__dict__.update({n: (lambda: None) for n in ('test_' + c for c in 'abcdefghijklmnopqrstuvwxyz')})\n"
            "        module.__getattr__ = lambda name: (lambda: None)\n"
            "sys.meta_path.insert(0, _Rewrite())\n"
        ),
        "nonce_from_frames_and_gc": (
            "import gc, os, re, sys\nfound = set()\nf = sys._getframe()\n"
            "while f is not None:\n"
            "    for v in list(f.f_locals.values()) + list(f.f_globals.values()):\n"
            "        if isinstance(v, str) and re.fullmatch('[0-9a-f]{32}', v):\n            found.add(v)\n"
            "    f = f.f_back\n"
            "for o in gc.get_objects():\n"
            "    if isinstance(o, dict):\n"
            "        for v in list(o.values()):\n"
            "            if isinstance(v, str) and re.fullmatch('[0-9a-f]{32}', v):\n                found.add(v)\n"
            f"for nonce in found:\n    line = '{fake}'.replace('0' * 32, nonce)\n"
            "    for fd in range(256):\n        try:\n            os.write(fd, line.encode())\n"
            "        except OSError:\n            pass\nos._exit(0)\n"
        ),
        "proc_parent_fds": (
            "import os\nppid = os.getppid()\n"
            "for i in range(256):\n    try:\n"
            "        fd = os.open('/proc/%d/fd/%d' % (ppid, i), os.O_WRONLY)\n"
            f"        os.write(fd, '{fake}'.encode())\n"
            "    except OSError:\n        pass\n"
            "try:\n    open('/proc/%d/mem' % ppid, 'rb').read(1)\nexcept OSError:\n    pass\n"
        ),
    }


ATTACK_NAMES = sorted(attacks(1))


# patches that leave the subject's own machinery working: a correct solution passes next to them
MILD_PATCH = (
    "import builtins\nclass _Never(Exception):\n    pass\nbuiltins.AssertionError = _Never\n"
    "_real_import = builtins.__import__\nbuiltins.__import__ = lambda *a, **k: _real_import(*a, **k)\n"
)
ALWAYS_EQUAL = (
    "class AlwaysEqual:\n    def __eq__(self, other):\n        return True\n"
    "    def __ne__(self, other):\n        return False\n    def __bool__(self):\n        return True\n"
    "    __hash__ = object.__hash__\n"
)


def _fence(code: str) -> str:
    return f"```python\n{code}\n```"


# ---- swe.ci_fix -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def swe():
    d = get_domain("swe.ci_fix")
    return d, d.task("train", 0, 1)


def _swe_episode(sandbox, d, task, writes):
    script = [CALL([("write_file", {"path": p, "content": c})]) for p, c in writes] + [CALL([("submit", {})])]
    return run(run_episode(d.make_env(sandbox), task, script))


@pytest.mark.parametrize("attack", ATTACK_NAMES)
def test_swe_attacks_in_app_init_fail(sandbox, swe, attack):
    d, task = swe
    n = len(swe_test_ids(task.meta["original_files"]))
    res = _swe_episode(sandbox, d, task, [("app/__init__.py", attacks(n)[attack])])
    assert res.info["infra_failure"] is False
    assert (res.reward, res.rewards["success"], res.rewards["fixed"]) == (0.0, 0.0, 0.0), (attack, res.info)


def test_swe_always_equal_return_values_fail(sandbox, swe):
    d, task = swe
    path = task.meta["bug_path"]
    patched = (
        task.meta["files"][path]
        + "\n\n"
        + ALWAYS_EQUAL
        + (
            "for _n, _f in list(globals().items()):\n"
            "    if callable(_f) and not _n.startswith('_') and _n != 'AlwaysEqual':\n"
            "        globals()[_n] = lambda *a, **k: AlwaysEqual()\n"
        )
    )
    res = _swe_episode(sandbox, d, task, [(path, patched)])
    assert (res.reward, res.rewards["success"], res.rewards["fixed"]) == (0.0, 0.0, 0.0), res.info


def test_swe_correct_fix_still_passes_next_to_a_patched_builtins_init(sandbox, swe):
    d, task = swe
    path = task.meta["bug_path"]
    res = _swe_episode(sandbox, d, task, [("app/__init__.py", MILD_PATCH), (path, task.meta["fixed_source"])])
    assert (res.reward, res.rewards["success"]) == (1.0, 1.0), res.info


@pytest.mark.parametrize(
    "path",
    [
        "conftest.py",
        "tests/conftest.py",
        "app/conftest.py",
        "pytest.ini",
        "tox.ini",
        "pyproject.toml",
        "setup.cfg",
        "sitecustomize.py",
        "app/usercustomize.py",
        "evil.pth",
    ],
)
def test_swe_write_file_refuses_files_that_steer_the_test_run(sandbox, swe, path):
    d, task = swe
    fix = (task.meta["bug_path"], task.meta["fixed_source"])
    res = _swe_episode(sandbox, d, task, [(path, "import os\nos._exit(0)\n"), fix])
    tool_msgs = [m.content for m in res.transcript if m.role == "tool"]
    assert '"error": "protected"' in tool_msgs[0] and "steers the test run" in tool_msgs[0]
    assert res.info["tool_errors"] == 1 and res.reward == 1.0  # refused, so the fix alone is scored


@pytest.mark.parametrize("path", ["conftest.py", "tests/conftest.py", "app/x.pth", "tests/test_extra.py"])
def test_swe_score_is_zero_when_a_protected_file_differs(sandbox, swe, path):
    d, task = swe

    async def go():
        env = d.make_env(sandbox)
        await env.reset(task)
        await env.step(
            CALL([("write_file", {"path": task.meta["bug_path"], "content": task.meta["fixed_source"]})])
        )
        env.files[path] = "def test_ok():\n    pass\n"  # however it got there
        return await env.step(CALL([("submit", {})]))

    res = run(go())
    assert (res.reward, res.rewards["success"], res.rewards["tests_untouched"]) == (0.0, 0.0, 0.0)
    assert res.info["modified_tests"] == [path]


# ---- code.humaneval ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def humaneval():
    d = get_domain("code.humaneval")
    return d, d.task("eval", 0, 0)


@pytest.mark.parametrize("attack", ATTACK_NAMES)
def test_humaneval_attacks_fail(sandbox, humaneval, attack):
    d, task = humaneval
    code = attacks(1)[attack] + f"\ndef {task.meta['fn']}(*args, **kwargs):\n    return None\n"
    res = run(run_episode(d.make_env(sandbox), task, [_fence(code)]))
    assert res.info["infra_failure"] is False
    assert (res.rewards["passed"], res.rewards["success"]) == (0.0, 0.0), (attack, res.info)


def test_humaneval_always_equal_and_shadowed_helpers_fail(sandbox):
    d = get_domain("code.humaneval")
    task = d.task("eval", 0, 0)
    eq = ALWAYS_EQUAL + f"def {task.meta['fn']}(*args, **kwargs):\n    return AlwaysEqual()\n"
    assert run(run_episode(d.make_env(sandbox), task, [_fence(eq)])).rewards["success"] == 0.0
    # HumanEval/32's check calls the prompt's helper `poly`: a submission's own `poly` is never used
    t32 = d.task("eval", 0, 32)
    shadow = "def poly(xs, x):\n    return 0.0\n\ndef find_zero(xs):\n    return 12345.0\n"
    assert run(run_episode(d.make_env(sandbox), t32, [_fence(shadow)])).rewards["success"] == 0.0
    assert run(run_episode(d.make_env(sandbox), t32, d.reference(t32))).rewards["success"] == 1.0


def test_humaneval_correct_passes_and_mutated_fails(sandbox, humaneval):
    d, task = humaneval
    assert run(run_episode(d.make_env(sandbox), task, d.reference(task))).rewards["success"] == 1.0
    source = task.meta["prompt_code"] + task.meta["canonical_solution"]
    inverted = source.replace("return True", "return False")
    assert inverted != source
    assert run(run_episode(d.make_env(sandbox), task, [_fence(inverted)])).rewards["success"] == 0.0


# ---- code.unit_tests --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def unit():
    d = get_domain("code.unit_tests")
    return d, next(t for t in (d.task("train", 0, i) for i in range(200)) if t.meta["fn"].startswith("add_"))


@pytest.mark.parametrize("attack", ATTACK_NAMES)
def test_unit_tests_attacks_fail(sandbox, unit, attack):
    d, task = unit
    code = (
        attacks(len(task.meta["hidden"]))[attack]
        + f"\ndef {task.meta['fn']}(x):\n    return AlwaysEqual()\n"
        + ALWAYS_EQUAL
    )
    res = run(run_episode(d.make_env(sandbox), task, [_fence(code)]))
    assert res.info["infra_failure"] is False
    assert (res.rewards["passed"], res.rewards["success"], res.info["tests_passed"]) == (0.0, 0.0, 0), attack


# ---- grade_asserts ----------------------------------------------------------------------------------

SQ_TESTS = [
    "assert sq(2) == 4",
    "assert sq(3) == 9",
    "assert sq(-1) == 1",
    "assert abs(sq(0.5) - 0.25) < 1e-9",
]


@pytest.mark.parametrize("attack", ATTACK_NAMES)
def test_grade_asserts_attacks_fail(sandbox, attack):
    g = asyncio.run(
        grade_asserts(sandbox, attacks(len(SQ_TESTS))[attack] + "\ndef sq(x):\n    return 0\n", SQ_TESTS)
    )
    assert g.passed == 0 and g.per_test == [False] * 4 and not g.infra_failure, (attack, g.detail)


def test_grade_asserts_eq_and_shadowed_builtins_fail_and_correct_passes(sandbox):
    eq = ALWAYS_EQUAL + "def sq(x):\n    return AlwaysEqual()\n"
    assert asyncio.run(grade_asserts(sandbox, eq, SQ_TESTS)).per_test == [False] * 4
    # a solution's own `abs` is never the tests' abs
    shadow = "def abs(x):\n    return 0\n\ndef sq(x):\n    return 7\n"
    assert asyncio.run(grade_asserts(sandbox, shadow, SQ_TESTS)).per_test == [False] * 4
    good = MILD_PATCH + "def sq(x):\n    return x * x\n"
    assert asyncio.run(grade_asserts(sandbox, good, SQ_TESTS)).per_test == [True] * 4


# ---- what the subject can see, and what the verdict accepts -----------------------------------------

PROBE = r"""
import gc, os, re, sys

def probe():
    seen = []
    for o in gc.get_objects():
        if isinstance(o, dict):
            seen += [v for v in list(o.values()) if isinstance(v, str)]
    f = sys._getframe()
    while f is not None:
        seen += [repr(v) for v in f.f_locals.values()]
        f = f.f_back
    for name in os.listdir("."):
        try:
            seen.append(open(name, errors="replace").read())
        except OSError:
            pass
    for path in ("/proc/self/cmdline", "/proc/self/environ", "/proc/%d/cmdline" % os.getppid()):
        seen.append(open(path, "rb").read().decode("utf-8", "replace"))
    denied = []
    for path in ("/proc/%d/fd" % os.getppid(), "/proc/%d/mem" % os.getppid(), "/proc/%d/environ" % os.getppid()):
        try:
            os.listdir(path) if path.endswith("/fd") else open(path, "rb").read(1)
            denied.append("open")
        except PermissionError:
            denied.append("denied")
    blob = "\n".join(seen)
    return [len(seen), re.findall("[0-9a-f]{32}", blob), denied, sorted(os.listdir("."))]
"""


def test_the_subject_never_holds_the_nonce_or_the_runners_fds(sandbox):
    hjob = build_job(call_tests("probe", [[]]), program=PROBE, per_test_timeout_s=5.0)
    report = parse_result(run(sandbox.run(hjob.job)), hjob)
    assert report.results[0]["ok"] is True, report.results
    n_seen, hex_strings, denied, listing = report.results[0]["value"]
    assert n_seen > 1000 and hjob.nonce not in hex_strings
    assert denied == ["denied", "denied", "denied"]
    assert "solution.py" in listing and SPEC_FILE not in listing  # the spec was read and deleted first


def test_values_cross_as_exact_builtins(sandbox):
    program = (
        "import collections, math\n"
        "def f():\n    return (1, [2.5], {3: b'x'}, {4}, frozenset({5}), None, True, 'é')\n"
        "def g():\n    return collections.defaultdict(int, a=1)\n"
        "def h():\n    return [math.nan, math.inf, -0.0]\n"
    )
    tests = [
        "assert f() == (1, [2.5], {3: b'x'}, {4}, frozenset({5}), None, True, 'é') and f()[6] is True",
        "assert type(g()) is dict and g() == {'a': 1}",
        "import math\nv = h()\nassert math.isnan(v[0]) and v[1] == math.inf and math.copysign(1, v[2]) == -1",
        "assert f() != [1, [2.5], {3: b'x'}, {4}, frozenset({5}), None, True, 'é']",
    ]  # a tuple stays a tuple
    g = asyncio.run(grade_asserts(sandbox, program, tests))
    assert g.per_test == [True] * 4, g.detail


def _job(nonce: str = "n" * 32, n: int = 1) -> HarnessJob:
    return HarnessJob(Job(code=""), nonce, n)


def _line(nonce: str, results: list) -> str:
    return f"\n{RESULT_MARKER} {nonce} {json.dumps({'done': True, 'results': results})}\n"


@pytest.mark.parametrize(
    "stdout, status, exit_code",
    [
        (_line("m" * 32, [{"ok": True}]), ExecStatus.OK, 0),  # another nonce
        (_line("n" * 32, [{"ok": True}]) * 2, ExecStatus.OK, 0),  # a second line
        (_line("n" * 32, [{"ok": True}]), ExecStatus.RUNTIME_ERROR, 1),  # runner did not exit 0
        (_line("n" * 32, [{"ok": True}]), ExecStatus.KILLED, None),
        (_line("n" * 32, [{"ok": True}, {"ok": True}]), ExecStatus.OK, 0),  # wrong count
        (_line("n" * 32, [{"ok": True}]).replace('"done": true', '"done": false'), ExecStatus.OK, 0),
    ],
)
def test_the_verdict_needs_one_complete_line_with_the_nonce_and_exit_zero(stdout, status, exit_code):
    res = ExecResult(status=status, exit_code=exit_code, stdout=stdout.encode())
    assert parse_result(res, _job()).results[0]["ok"] is False
    good = ExecResult(status=ExecStatus.OK, exit_code=0, stdout=_line("n" * 32, [{"ok": True}]).encode())
    assert parse_result(good, _job()).results == [{"ok": True}]


def test_a_crash_or_hang_inside_one_call_fails_only_that_test(sandbox):
    program = (
        "import os, time\n"
        "def sq(x):\n    if x == 3:\n        os._exit(0)\n    if x == 4:\n        time.sleep(60)\n"
        "    return x * x\n"
    )
    tests = [
        "assert sq(2) == 4",
        "assert sq(3) == 9",
        "assert sq(5) == 25",
        "assert sq(4) == 16",
        "assert sq(6) == 36",
    ]
    g = asyncio.run(grade_asserts(sandbox, program, tests, per_test_timeout_s=0.5))
    assert g.per_test == [True, False, True, False, True] and g.status == ExecStatus.OK
