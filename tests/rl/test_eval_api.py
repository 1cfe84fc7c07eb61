"""`posttrain eval --api-base`: scoring a live OpenAI-compatible HTTP server on the held-out tasks.

The server below is a real HTTP server on a local port that speaks the chat-completions protocol. It
knows the held-out tasks (built with the same function and seed as the evaluator), answers a chosen
subset correctly (math: the gold answer in tags; tools.apis: the gold actions as structured
`tool_calls`, one per turn, then a plain-text reply) and the rest wrongly, so the expected accuracy
is known exactly. Protocol failures (unknown model -> 404, a body that is not JSON) must become
infrastructure failures, never crashes or scores.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from typer.testing import CliRunner

from posttrain.cli import app
from posttrain.curriculum import Arm
from posttrain.envs import get_domain
from posttrain.orchestrator.eval.evaluate import evaluate_api, heldout_tasks
from posttrain.rollout import EpisodeLimits

SEED = 0
N = 6
MODEL = "fake-model"


def _domains() -> tuple[dict[str, Any], list[Arm]]:
    domains = {"math": get_domain("math"), "tools.apis": get_domain("tools.apis")}
    return domains, [Arm("math", 0), Arm("tools.apis", 0)]


class FakeOpenAI:
    """Chat completions for the known tasks: task i is answered correctly when `good(i)`."""

    def __init__(self, good: Any) -> None:
        domains, arms = _domains()
        self.tasks = {}
        for idx, (arm, _, task) in enumerate(heldout_tasks(domains, arms, N, SEED)):
            user = next(m.content for m in task.prompt if m.role == "user")
            self.tasks[user] = (arm.domain, idx % N, task)
        self.good = good
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def reply(self, payload: dict[str, Any]) -> tuple[int, Any]:
        with self.lock:
            self.requests.append(payload)
        if payload.get("model") != MODEL:
            return 404, {"error": {"message": f"model '{payload.get('model')}' not found"}}
        messages = payload["messages"]
        user = next(m["content"] for m in messages if m["role"] == "user")
        domain, i, task = self.tasks[user]
        if domain == "math":
            answer = task.meta["answer"] if self.good(i) else "not a number"
            return 200, _completion({"role": "assistant", "content": f"<answer>{answer}</answer>"})
        done = sum(1 for m in messages if m["role"] == "tool")
        gold = task.meta["gold_actions"]
        if self.good(i) and done < len(gold):
            name, args = gold[done]
            call = {
                "id": f"call_{done}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)},
            }
            return 200, _completion({"role": "assistant", "content": None, "tool_calls": [call]})
        answer = f"<answer>{task.meta['answer']}</answer>" if task.meta.get("answer") is not None else "Done."
        return 200, _completion({"role": "assistant", "content": answer})


def _completion(message: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": "cmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
    }


@pytest.fixture
def server() -> Iterator[tuple[str, FakeOpenAI]]:
    fake = FakeOpenAI(good=lambda i: i % 2 == 0)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/v1/broken/chat/completions":
                status, raw = 200, b"<html>not json</html>"
            elif self.path != "/v1/chat/completions":
                status, raw = 404, b"{}"
            else:
                status, out = fake.reply(body)
                raw = json.dumps(out).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", fake
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_evaluate_api_scores_a_live_server_exactly(server):
    url, fake = server
    domains, arms = _domains()
    report = evaluate_api(url, MODEL, domains, arms, N, EpisodeLimits(8, 4096, 64), SEED)
    # tasks 0, 2, 4 of each domain answered correctly, 1, 3, 5 wrongly
    assert report.per_task["math"] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert report.per_task["tools.apis"] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert (
        report.per_domain["math"]["accuracy"] == 0.5
        and report.per_domain["tools.apis"]["infra_failures"] == 0
    )
    assert not report.failures
    # the tool path really went multi-turn: the server saw its own tool calls and the tool results
    followups = [r for r in fake.requests if any(m["role"] == "tool" for m in r["messages"])]
    assert followups and all(r.get("tools") for r in followups)
    assert all(r["temperature"] == 0.0 and "seed" not in r for r in fake.requests)


def test_sampled_api_eval_sends_seeds_and_averages(server):
    url, fake = server
    domains, arms = _domains()
    report = evaluate_api(
        url, MODEL, domains, arms[:1], 2, EpisodeLimits(8, 4096, 64), SEED, temperature=0.7, samples=3
    )
    assert report.per_task["math"] == [1.0, 0.0]
    assert sorted(r["seed"] for r in fake.requests) == [0, 0, 1, 1, 2, 2]
    assert all(r["temperature"] == 0.7 for r in fake.requests)


def test_protocol_failures_are_infra_failures_not_crashes(server):
    url, _ = server
    domains, arms = _domains()
    limits = EpisodeLimits(8, 4096, 64)
    unknown = evaluate_api(url, "no-such-model", domains, arms[:1], 2, limits, SEED)
    assert unknown.per_task["math"] == [None, None] and unknown.per_domain["math"]["infra_failures"] == 2
    assert unknown.failures[0].startswith("HTTP 404") and "no-such-model" in unknown.failures[0]
    broken = evaluate_api(url.replace("/v1", "/v1/broken"), MODEL, domains, arms[:1], 2, limits, SEED)
    assert broken.per_task["math"] == [None, None] and "not a chat completion" in broken.failures[0]
    refused = evaluate_api("http://127.0.0.1:9/v1", MODEL, domains, arms[:1], 1, limits, SEED)
    assert refused.per_task["math"] == [None] and "ConnectError" in refused.failures[0]


def test_cli_eval_api_base_prints_per_domain_json(server):
    url, _ = server
    result = CliRunner().invoke(
        app, ["eval", "--api-base", url, "--model", MODEL, "--suite", "tools.apis", "--n", str(N), "--json"]
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.output.strip().splitlines()[-1])
    assert out["per_domain"]["tools.apis"]["accuracy"] == 0.5 and out["per_domain"]["tools.apis"]["n"] == N
    missing = CliRunner().invoke(app, ["eval", "--api-base", url])
    assert missing.exit_code == 2 and "--api-base needs --model" in missing.output


# ---------------------------------------------------------------------------------------------
# code domains: the environment runs the server's code in the sandbox the evaluator was given


CODE_N = 6
CODE_GOOD = {0, 3}  # tasks answered with the domain's reference; the rest pass only their first hidden case


def _partial(task: Any) -> str:
    """Code that returns the right value for the first hidden case only (well formatted, so the shaped
    reward is 0.85 x its fraction passed + 0.15 while strict success is 0)."""
    fn, params, first = task.meta["fn"], task.meta["params"], task.meta["hidden"][0]
    return (
        f"```python\ndef {fn}({params}):\n    if [{params}] == {first['args']!r}:\n"
        f"        return {first['expected']!r}\n    return 'wrong'\n```"
    )


def _partial_passed(task: Any) -> float:
    first = task.meta["hidden"][0]
    hidden = task.meta["hidden"]
    return sum(1 for c in hidden if c["args"] == first["args"] or c["expected"] == "wrong") / len(hidden)


@pytest.fixture
def code_server() -> Iterator[tuple[str, list[Any]]]:
    domain = get_domain("code.unit_tests")
    tasks = [
        t for _, _, t in heldout_tasks({"code.unit_tests": domain}, [Arm("code.unit_tests", 0)], CODE_N, SEED)
    ]
    by_prompt = {t.prompt[0].content: (i, t) for i, t in enumerate(tasks)}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            user = next(m["content"] for m in body["messages"] if m["role"] == "user")
            i, task = by_prompt[user]
            text = domain.reference(task)[0] if i in CODE_GOOD else _partial(task)
            raw = json.dumps(_completion({"role": "assistant", "content": text})).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", tasks
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def sandbox():
    from posttrain.sandbox import LocalSandbox, SandboxUnavailable

    try:
        sb = LocalSandbox(pool_size=2)
    except SandboxUnavailable as err:
        pytest.skip(f"sandbox unavailable on this machine: {err}")
    yield sb
    sb.close_blocking()


def _expected_code_figures(tasks: list[Any]) -> tuple[float, float, float]:
    """(strict accuracy, mean shaped reward, mean fraction passed) computed by hand from the tasks."""
    passed = [1.0 if i in CODE_GOOD else _partial_passed(t) for i, t in enumerate(tasks)]
    return (
        len(CODE_GOOD) / len(tasks),
        sum(0.85 * p + 0.15 for p in passed) / len(tasks),
        sum(passed) / len(tasks),
    )


def test_api_eval_runs_code_in_the_sandbox_and_scores_strictly(code_server, sandbox):
    url, tasks = code_server
    domains = {"code.unit_tests": get_domain("code.unit_tests")}
    arms = [Arm("code.unit_tests", 0)]
    accuracy, reward, passed = _expected_code_figures(tasks)
    assert accuracy == 1 / 3 and reward > accuracy  # the shaped reward would have overstated it
    report = evaluate_api(
        url, MODEL, domains, arms, CODE_N, EpisodeLimits(2, 4096, 256), SEED, sandbox=sandbox
    )
    assert not report.failures
    assert report.per_task["code.unit_tests"] == [1.0 if i in CODE_GOOD else 0.0 for i in range(CODE_N)]
    d = report.per_domain["code.unit_tests"]
    assert d["accuracy"] == pytest.approx(accuracy) and d["n"] == CODE_N and d["infra_failures"] == 0
    assert d["mean_reward"] == pytest.approx(reward)
    assert d["mean_components"]["passed"] == pytest.approx(passed) and d["mean_components"]["format"] == 1.0
    with pytest.raises(ValueError, match="code.unit_tests run code: pass a sandbox"):
        evaluate_api(url, MODEL, domains, arms, 1, EpisodeLimits(2, 4096, 256), SEED)


def test_cli_and_example_script_score_a_code_domain_at_an_endpoint(code_server):
    import os
    import subprocess
    import sys
    from pathlib import Path

    url, tasks = code_server
    accuracy, reward, _ = _expected_code_figures(tasks)
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "--api-base",
            url,
            "--model",
            MODEL,
            "--suite",
            "code.unit_tests",
            "--n",
            str(CODE_N),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.output.strip().splitlines()[-1])
    per = out["per_domain"]["code.unit_tests"]
    assert per["accuracy"] == pytest.approx(accuracy) and per["mean_reward"] == pytest.approx(reward)
    assert out["accuracy_definition"].startswith("strict success")
    # the example script, with its suite and task count narrowed by trailing options
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "POSTTRAIN": str(Path(sys.executable).parent / "posttrain")}
    proc = subprocess.run(
        [
            "bash",
            str(root / "examples" / "score_openai_endpoint.sh"),
            url,
            MODEL,
            "--suite",
            "code.unit_tests",
            "--n",
            str(CODE_N),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    script = json.loads(proc.stdout.strip().splitlines()[-1])
    assert script["per_domain"]["code.unit_tests"]["accuracy"] == pytest.approx(accuracy)
    assert list(script["per_domain"]) == ["code.unit_tests"]
