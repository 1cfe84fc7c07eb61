"""The CI auto-fix agent end to end: a scripted policy (a canned engine behind the real server) fixes a
planted bug through the real CLI and sandbox; patches that do not apply, test edits, fixes that only
pass in the working copy, hostile repositories, a live tiny model over --api-base and in-process, and
the exit codes."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from posttrain.apps.ci_fix import CheckRunner, RepoFixEnv, load_repo, pytest_counts
from posttrain.cli import app
from posttrain.envs import get_domain
from posttrain.envs.parsers import get_parser
from posttrain.envs.repo_tools import TOOL_SPECS, fix_prompt
from posttrain.envs.scripted import run_episode
from posttrain.types import Task

from .conftest import BUGGY_OPS, FIX_PATCH, FIXED_OPS, PLANTED, git, make_repo, run

cli = CliRunner()
HERMES = get_parser("hermes").format_calls


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def agent_args(repo: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "agent",
        "ci-fix",
        "--repo",
        str(repo),
        "--transcripts",
        str(tmp_path / "tr"),
        "--json",
        "--set",
        "sandbox.pool_size=1",
        *extra,
    ]


def test_scripted_policy_fixes_a_planted_bug_through_the_cli(planted, tmp_path, canned_server):
    url, fmt = canned_server(
        [
            fmt_call("read_file", {"path": "calc/ops.py"}),
            fmt_call("apply_patch", {"patch": FIX_PATCH}),
            fmt_call("run_tests", {}),
            fmt_call("submit", {}),
        ]
    )
    res = cli.invoke(
        app,
        agent_args(
            planted, tmp_path, "--api-base", url, "--model", "canned", "--commit", "--branch", "fix/add"
        ),
    )
    assert res.exit_code == 0, res.output
    out = last_json(res.stdout)
    assert (out["status"], out["fixed"], out["attempts"], out["turns"]) == ("fixed", True, 1, 4)
    assert out["tests_before"] == {
        "ok": False,
        "exit_code": 1,
        "status": "runtime_error",
        "failed": 1,
        "passed": 1,
    }
    assert out["tests_after"] == {"ok": True, "exit_code": 0, "status": "ok", "passed": 2}
    assert "-    return a - b\n+    return a + b\n" in out["patch"] and out["patch"] in res.stdout
    assert out["explanation"].startswith("Changed calc/ops.py (+1 -1)")
    # the patch applies with git and makes the host's pytest pass; --commit made a branch, work tree untouched
    assert (planted / "calc/ops.py").read_text() == BUGGY_OPS
    assert git(planted, "show", "fix/add:calc/ops.py") == FIXED_OPS
    assert git(planted, "rev-parse", "--abbrev-ref", "HEAD").strip() == "main"
    assert git(planted, "status", "--porcelain") == ""
    (tmp_path / "fix.patch").write_text(out["patch"])
    git(planted, "apply", str(tmp_path / "fix.patch"))
    host = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=planted,
        capture_output=True,
        text=True,
    )
    assert host.returncode == 0, host.stdout
    saved = json.loads((tmp_path / "tr" / "attempt-1.json").read_text())
    tool_msgs = [m["content"] for m in saved["transcript"] if m["role"] == "tool"]
    assert tool_msgs[0] == BUGGY_OPS and tool_msgs[1] == "patched calc/ops.py"
    assert tool_msgs[2].startswith("check PASSED (status ok, exit code 0; 2 passed)")


def fmt_call(name: str, args: dict) -> str:
    """A tool call as the canned engine writes it: the tiny tokenizer's chat format (the server parses it)."""
    from posttrain.models import load_tokenizer
    from posttrain.serve.chat import chat_format_for

    return get_parser(chat_format_for(load_tokenizer("tiny:llama"))).format_calls([(name, args)])


def _env(sandbox, files, allow_test_edits=False, command="pytest -q", **kw):
    runner = CheckRunner(sandbox, command, wall_time_s=kw.pop("wall_time_s", 60.0))
    env = RepoFixEnv(runner, files, allow_test_edits, "hermes", max_turns=8)
    task = Task(
        "t", "ci_fix", 0, fix_prompt("FAILED tests/test_ops.py::test_add", files), list(TOOL_SPECS.values())
    )
    return env, task


def test_a_patch_that_does_not_apply_is_a_clear_tool_error(sandbox):
    env, task = _env(sandbox, PLANTED)
    stale = FIX_PATCH.replace("return a - b", "return a - b  # old")
    res = run(
        run_episode(
            env,
            task,
            [HERMES([("apply_patch", {"patch": stale})]), HERMES([("apply_patch", {"patch": "fix it"})])],
        )
    )
    msgs = [m.content for m in res.transcript if m.role == "tool"]
    err = json.loads(msgs[0])
    assert err["error"] == "patch_does_not_apply"
    assert err["message"].startswith("hunk 1 (@@ -1,2 +1,2 @@) of calc/ops.py does not apply")
    assert "return a - b  # old" in err["message"]
    assert (
        json.loads(msgs[1])["message"] == "not a unified diff: no '--- a/path' / '+++ b/path' headers found"
    )
    assert env.repo.files["calc/ops.py"] == BUGGY_OPS and res.info["tool_errors"] == 2


def test_test_file_edits_are_refused_unless_allowed(sandbox):
    cheat = "def test_add():\n    pass\n"
    patch = "--- a/tests/test_ops.py\n+++ b/tests/test_ops.py\n@@ -1,1 +1,1 @@\n-from calc.ops import add, mul\n+from calc.ops import mul\n"
    script = [
        HERMES([("write_file", {"path": "tests/test_ops.py", "content": cheat})]),
        HERMES([("apply_patch", {"patch": patch})]),
        HERMES([("write_file", {"path": "pytest.ini", "content": "[pytest]\naddopts = -k mul\n"})]),
        HERMES([("submit", {})]),
    ]
    env, task = _env(sandbox, PLANTED)
    res = run(run_episode(env, task, script))
    errs = [json.loads(m.content) for m in res.transcript if m.role == "tool"][:3]
    assert [e["error"] for e in errs] == ["protected"] * 3
    assert (
        "'tests/test_ops.py' is a test file" in errs[0]["message"]
        and "--allow-test-edits" in errs[0]["message"]
    )
    assert env.repo.files == PLANTED and res.reward == 0.0 and res.info["patch"] == ""
    env, task = _env(sandbox, PLANTED, allow_test_edits=True)
    res = run(run_episode(env, task, [script[0], script[3]]))
    assert res.reward == 1.0 and res.info["test_edits"] == ["tests/test_ops.py"]  # allowed, and flagged


def test_a_fix_that_only_passes_in_the_working_copy_is_not_reported(sandbox):
    # The "fix" passes only once an earlier run left a file behind: the working copy has it, a fresh copy not.
    stateful = (
        "import os\n_STATE = os.path.join(os.path.dirname(__file__), 'warm.state')\n\n\ndef add(a, b):\n"
        "    if os.path.exists(_STATE):\n        return a + b\n    open(_STATE, 'w').write('1')\n    return a - b\n\n\n"
        "def mul(a, b):\n    return a * b\n"
    )
    script = [
        HERMES([("write_file", {"path": "calc/ops.py", "content": stateful})]),
        HERMES([("run_tests", {})]),
        HERMES([("run_tests", {"tests": ["tests/test_ops.py::test_add"]})]),
        HERMES([("submit", {})]),
    ]
    env, task = _env(sandbox, PLANTED)
    res = run(run_episode(env, task, script))
    runs = [m.content for m in res.transcript if m.role == "tool"][1:3]
    assert runs[0].startswith("check FAILED (status runtime_error, exit code 1; 1 failed, 1 passed)")
    assert runs[1].startswith("check PASSED (status ok, exit code 0; 1 passed)")
    assert res.info["working_copy_check"] == {"ok": True, "exit_code": 0, "status": "ok", "passed": 1}
    assert res.info["fresh_check"] == {
        "ok": False,
        "exit_code": 1,
        "status": "runtime_error",
        "failed": 1,
        "passed": 1,
    }
    assert "b/calc/warm.state" not in res.info["patch"] and "calc/warm.state" in env.repo.files
    assert res.reward == 0.0 and res.rewards["success"] == 0.0


def test_a_hostile_repository_is_contained(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET-4242")
    outside = tmp_path / "pwned.txt"
    hostile = {
        "tests/test_evil.py": (
            "import os\n\n\n"
            f"def test_reads_secret():\n    print(open({str(secret)!r}).read())\n\n\n"
            f"def test_writes_outside():\n    open({str(outside)!r}, 'w').write('x')\n\n\n"
            "def test_home():\n    print(sorted(os.listdir('/root')) if os.path.isdir('/root') else 'no /root')\n\n\n"
            "def test_fork_bomb():\n    n = 0\n    while True:\n        try:\n            if os.fork() == 0:\n"
            "                continue\n            n += 1\n        except OSError:\n            pass\n"
        ),
    }
    runner = CheckRunner(sandbox, "pytest -q -s -p no:cacheprovider", wall_time_s=4.0)
    res = run(runner.run(hostile))
    assert not res.passed and res.status == "timeout" and "time limit (4 s)" in res.log
    assert "TOPSECRET" not in res.log and not outside.exists()
    quiet = run(
        runner.run({"tests/test_evil.py": hostile["tests/test_evil.py"].split("def test_fork_bomb")[0]})
    )
    assert quiet.counts == {"failed": 2, "passed": 1}, (
        quiet.log
    )  # the reads and writes fail, listing /root shows nothing
    assert (
        "TOPSECRET" not in quiet.log and "No such file or directory" in quiet.log and "no /root" in quiet.log
    )
    assert not outside.exists()


def test_swe_ci_fix_reference_drives_the_agent_environment(sandbox):
    """One code path: a swe.ci_fix episode's tool calls (the policy's training format) fix the same repo
    in the agent's environment, where the check is plain pytest."""
    d = get_domain("swe.ci_fix")
    task = d.task("heldout", 0, 0)
    runner = CheckRunner(sandbox, "pytest -q -p no:cacheprovider")
    env = RepoFixEnv(runner, task.meta["files"], chat_format="smollm2")
    before = run(runner.run(task.meta["files"]))
    assert before.counts["failed"] == len(task.meta["failing_tests"])
    agent_task = Task("t", "ci_fix", 0, fix_prompt(before.log, task.meta["files"]), list(TOOL_SPECS.values()))
    res = run(run_episode(env, agent_task, d.reference(task)))
    assert res.reward == 1.0 and res.info["fresh_check"]["ok"] is True
    assert [t.name for t in task.tools] == list(TOOL_SPECS)


def test_api_base_against_a_live_tiny_model(planted, tmp_path):
    """The tiny random model behind `posttrain serve`'s app on 127.0.0.1: it does not fix anything, but
    every turn is a real completion, counted, and saved."""
    from posttrain.engine import PagedEngine
    from posttrain.models import load_policy, load_tokenizer
    from posttrain.serve import ModelEntry, ServeSettings, ServeState
    from serve.conftest import start_server

    tok = load_tokenizer("tiny:llama")
    engine = PagedEngine(
        load_policy("tiny:llama", seed=0), tok, block_size=16, num_blocks=512, max_model_len=4096
    )
    state = ServeState(ServeSettings())
    state.add_model(ModelEntry("tiny", engine, tok, max_model_len=4096))
    srv = start_server(state)
    ci_log = tmp_path / "ci.log"
    ci_log.write_text("CI-RUNNER-42 FAILED tests/test_ops.py::test_add - assert -1 == 5\n")
    try:
        res = cli.invoke(
            app,
            agent_args(
                planted,
                tmp_path,
                "--api-base",
                srv.url + "/v1",
                "--model",
                "tiny",
                "--max-attempts",
                "1",
                "--max-turns",
                "2",
                "--set",
                "engine.max_new_tokens=8",
                "--log",
                str(ci_log),
            ),
        )
    finally:
        srv.stop()
    assert res.exit_code == 3, res.output
    out = last_json(res.stdout)
    assert (out["status"], out["attempts"], out["attempt_outcomes"]) == ("not_fixed", 1, ["not_fixed"])
    # greedy text without a tool call ends the attempt after one turn; each turn is 1-8 real tokens
    assert 1 <= out["turns"] <= 2 and out["turns"] <= out["tokens"] <= 8 * out["turns"] and out["patch"] == ""
    saved = json.loads((tmp_path / "tr" / "attempt-1.json").read_text())
    assert [m["role"] for m in saved["transcript"]][:2] == ["system", "user"]
    assert "CI-RUNNER-42 FAILED tests/test_ops.py::test_add" in saved["transcript"][1]["content"]  # --log


def test_in_process_model(planted, tmp_path):
    res = cli.invoke(
        app,
        agent_args(
            planted,
            tmp_path,
            "--model",
            "tiny:llama",
            "--max-attempts",
            "2",
            "--max-turns",
            "1",
            "--set",
            "engine.max_new_tokens=4",
        ),
    )
    assert res.exit_code == 3, res.output
    out = last_json(res.stdout)
    assert out["attempts"] == 2 and out["turns"] == 2 and 2 <= out["tokens"] <= 8  # one 1-4 token turn each
    second = json.loads((tmp_path / "tr" / "attempt-2.json").read_text())["transcript"]
    assert "Attempt 1 did not fix the build: it changed no file" in second


def test_exit_codes(planted, tmp_path):
    assert cli.invoke(app, ["agent", "ci-fix", "--repo", str(planted)]).exit_code == 2  # no model
    res = cli.invoke(app, agent_args(tmp_path, tmp_path, "--model", "x"))
    assert res.exit_code == 2 and "not a git work tree" in res.output
    res = cli.invoke(app, agent_args(planted, tmp_path, "--model", "x", "--branch", "b"))
    assert res.exit_code == 2 and "pass --commit too" in res.output
    passing = make_repo(tmp_path / "ok", {**PLANTED, "calc/ops.py": FIXED_OPS})
    res = cli.invoke(
        app, agent_args(passing, tmp_path, "--model", "never-loaded", "--api-base", "http://127.0.0.1:9/v1")
    )
    assert res.exit_code == 0 and last_json(res.stdout)["status"] == "nothing_to_fix"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = cli.invoke(
        app,
        agent_args(
            planted,
            tmp_path,
            "--model",
            "m",
            "--api-base",
            f"http://127.0.0.1:{port}/v1",
            "--max-attempts",
            "2",
        ),
    )
    assert res.exit_code == 1 and last_json(res.stdout)["attempt_outcomes"] == ["error", "error"]
    assert "ConnectError" in res.output
    with socket.socket() as hung:  # accepts connections (the kernel's backlog) and never answers
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        url = f"http://127.0.0.1:{hung.getsockname()[1]}/v1"
        res = cli.invoke(
            app, agent_args(planted, tmp_path, "--model", "m", "--api-base", url, "--timeout", "3")
        )
    out = last_json(res.stdout)  # out of time, in the first check or waiting for the endpoint: not fixed
    assert res.exit_code == 3 and out["status"] == "not_fixed" and out["attempt_outcomes"] == ["timeout"]


def test_pytest_counts_and_repo_loading(planted):
    assert pytest_counts("....\n1 failed, 3 passed, 2 skipped in 0.05s\n") == {
        "failed": 1,
        "passed": 3,
        "skipped": 2,
    }
    assert pytest_counts("=== 2 errors in 1.20s ===") == {"errors": 2}
    assert pytest_counts("no summary") == {}
    (planted / "notes.txt").write_text("untracked but not ignored\n")
    (planted / ".gitignore").write_text("*.log\n")
    (planted / "x.log").write_text("ignored\n")
    (planted / "blob.bin").write_bytes(b"\xff\x00")
    repo = load_repo(planted / "calc")  # a subfolder resolves to the work tree's root
    assert repo.root == planted and set(repo.files) == {*PLANTED, "notes.txt", ".gitignore"}
    assert repo.binary == {"blob.bin": b"\xff\x00"} and len(repo.head) == 40


def test_dependencies_from_host_packages_and_wheels(sandbox, tmp_path):
    import zipfile

    from posttrain.apps.ci_fix import read_wheels

    uses = {
        "tests/test_deps.py": "import yaml\nimport tinylib\n\n\ndef test_both():\n"
        "    assert yaml.safe_load('a: 1') == {'a': 1} and tinylib.VALUE == 7\n"
    }
    wheel_dir = tmp_path / "wheels"
    wheel_dir.mkdir()
    with zipfile.ZipFile(wheel_dir / "tinylib-1.0-py3-none-any.whl", "w") as whl:
        whl.writestr("tinylib/__init__.py", "VALUE = 7\n")
    wheels = read_wheels(wheel_dir)

    async def both():
        bare = CheckRunner(sandbox, "pytest -q -p no:cacheprovider")
        deps = CheckRunner(sandbox, "pytest -q -p no:cacheprovider", wheels=wheels, packages=("yaml",))
        return await asyncio.gather(bare.run(uses), deps.run(uses))

    bare, deps = run(both())
    assert not bare.passed and "ModuleNotFoundError: No module named 'yaml'" in bare.log
    assert deps.passed and deps.counts == {"passed": 1}, deps.log
    with pytest.raises(ValueError, match="no .whl files"):
        read_wheels(tmp_path)


class _FailingCheck:
    """A check double that always fails at once (the loop's timing without a sandbox)."""

    command = "pytest -q"

    async def run(self, files, select=None):
        from posttrain.apps.ci_fix import CheckResult

        return CheckResult(False, "runtime_error", 1, "FAILED tests/test_ops.py::test_add", {"failed": 1})


class _StallingPolicy:
    """Reads one file, then never answers again (a hung model endpoint)."""

    chat_format = "hermes"

    async def episode(self, env, task, sandbox):
        await env.reset(task)
        await env.step(HERMES([("read_file", {"path": "calc/ops.py"})]))
        await asyncio.sleep(3600)


def test_a_timed_out_attempt_keeps_its_transcript(tmp_path):
    from posttrain.apps.ci_fix import FixOptions, fix_repository

    options = FixOptions(max_attempts=3, timeout_s=0.5, transcripts_dir=tmp_path)
    report = run(fix_repository(PLANTED, _FailingCheck(), _StallingPolicy(), options))
    assert (report.status, report.attempts, [a["outcome"] for a in report.attempt_log]) == (
        "not_fixed",
        1,
        ["timeout"],
    )
    saved = json.loads((tmp_path / "attempt-1.json").read_text())
    assert saved["error"] == "timeout: the run's 0.5 s ran out"
    assert saved["transcript"][0]["observations"][0]["content"] == BUGGY_OPS
