"""Held-out evaluation: per-domain accuracy with 95% bootstrap intervals, and paired comparison with a
baseline model on the same tasks. The policy is our engine, or any OpenAI-compatible endpoint.

A task's score is its `correct` reward component (or the reward when a domain has none).
Infrastructure failures are excluded and counted, never scored 0.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from posttrain.rollout import EpisodeLimits, run_episode
from posttrain.types import Message, Task, ToolCall

BOOTSTRAP_RESAMPLES = 2000


def task_score(rewards: dict[str, float], reward: float) -> float:
    return float(rewards["correct"]) if "correct" in rewards else float(reward)


def bootstrap_ci(values: np.ndarray, seed: int = 0, resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float]:
    """Percentile 95% interval of the mean."""
    if len(values) == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(values), size=(resamples, len(values)))
    means = values[idx].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def heldout_tasks(domains: dict[str, Any], arms: list[Any], n: int, seed: int) -> list[tuple[Any, Any, Task]]:
    """n held-out tasks per arm, the same for every model evaluated with the same seed."""
    out = []
    for arm in arms:
        domain = domains[arm.domain]
        split = "heldout" if "heldout" in domain.splits else domain.splits[-1]
        for i in range(n):
            out.append((arm, domain, domain.task(split, arm.difficulty, i, seed=seed)))
    return out


def score_tasks(
    engine: Any,
    tokenizer: Any,
    tasks: list[tuple[Any, Any, Task]],
    sandbox: Any,
    sampling: Any,
    limits: EpisodeLimits,
    samples: int = 1,
    seed: int = 0,
    loop: asyncio.AbstractEventLoop | None = None,
    usage: dict[str, float] | None = None,
) -> list[float | None]:
    """Each task's score, the mean over `samples` seeded episodes (None when every one of them was an
    infrastructure failure). Greedy sampling ignores the seeds. `usage`, when given, gains the episodes'
    generated tokens under "generated_tokens"."""
    from dataclasses import replace

    from posttrain.rollout import sample_seed

    async def run_all() -> list[Any]:
        return await asyncio.gather(
            *(
                run_episode(
                    engine, tokenizer, d, t, sandbox, replace(sampling, seed=sample_seed(seed, 0, i, j)), limits,
                    engine.version,
                )
                for i, (_, d, t) in enumerate(tasks)
                for j in range(samples)
            )
        )

    runner = loop or asyncio.new_event_loop()
    try:
        trajs = runner.run_until_complete(run_all())
    finally:
        if loop is None:
            runner.close()
    if usage is not None:
        usage["generated_tokens"] = usage.get("generated_tokens", 0.0) + float(sum(t.num_generated for t in trajs))
    out: list[float | None] = []
    for i in range(len(tasks)):
        scores = [
            task_score(t.rewards, t.reward) for t in trajs[i * samples : (i + 1) * samples] if not t.status.is_infra_failure
        ]
        out.append(float(np.mean(scores)) if scores else None)
    return out


def evaluate_engine(
    engine: Any,
    tokenizer: Any,
    domains: dict[str, Any],
    arms: list[Any],
    n: int,
    sandbox: Any,
    sampling: Any,
    limits: EpisodeLimits,
    seed: int = 0,
    loop: asyncio.AbstractEventLoop | None = None,
    usage: dict[str, float] | None = None,
) -> dict[Any, list[float]]:
    """Scores per arm (infra failures dropped) for our engine, greedy by default; `usage` as in score_tasks."""
    tasks = heldout_tasks(domains, arms, n, seed)
    scores: dict[Any, list[float]] = {arm: [] for arm in arms}
    results = score_tasks(engine, tokenizer, tasks, sandbox, sampling, limits, 1, seed, loop, usage)
    for (arm, _, _), score in zip(tasks, results, strict=True):
        if score is not None:
            scores[arm].append(score)
    return scores


@dataclass
class EvalReport:
    model: str
    per_task: dict[str, list[float | None]]  # domain -> score per task (None = infra failure)
    per_domain: dict[str, dict[str, float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # why episodes failed at the infrastructure level

    def summarise(self, seed: int = 0) -> None:
        for dom, scores in self.per_task.items():
            vals = np.array([s for s in scores if s is not None], dtype=float)
            lo, hi = bootstrap_ci(vals, seed)
            self.per_domain[dom] = {
                "accuracy": float(vals.mean()) if len(vals) else float("nan"),
                "ci_low": lo,
                "ci_high": hi,
                "n": len(vals),
                "infra_failures": sum(s is None for s in scores),
            }


class _BadResponse(Exception):
    """The server's answer is not an OpenAI chat completion (an infrastructure failure, not a score)."""


def _message_of(resp: Any) -> dict[str, Any]:
    try:
        message = resp.json()["choices"][0]["message"]
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise _BadResponse(f"not a chat completion ({type(err).__name__}): {resp.text[:200]}") from None
    if not isinstance(message, dict):
        raise _BadResponse(f"choices[0].message is not an object: {resp.text[:200]}")
    return message


async def _api_episode(
    client: Any, model: str, domain: Any, task: Task, limits: EpisodeLimits, temperature: float = 0.0, seed: int | None = None
) -> tuple[float | None, str]:
    """One episode against an OpenAI-compatible chat endpoint (text in, text out)."""
    env = domain.make_env(None, chat_format="hermes")
    obs = await env.reset(task)
    messages: list[Message] = list(obs.messages)
    for _ in range(limits.max_turns):
        payload: dict[str, Any] = {
            "model": model,
            "messages": [m.to_openai() for m in messages],
            "temperature": temperature,
            "max_tokens": limits.max_new_tokens,
        }
        if seed is not None:
            payload["seed"] = seed
        if obs.tools:
            payload["tools"] = [t.to_openai() for t in obs.tools]
        resp = await client.post("/chat/completions", json=payload)
        if resp.status_code != 200:
            return None, f"HTTP {resp.status_code}: {resp.text[:200]}"
        try:
            choice = _message_of(resp)
        except _BadResponse as err:
            return None, str(err)
        text = choice.get("content") or ""
        calls: list[ToolCall] = []
        for i, call in enumerate(choice.get("tool_calls") or []):
            fn = call.get("function", {})
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except json.JSONDecodeError:
                args = {"_unparseable": fn.get("arguments")}
            calls.append(ToolCall(call.get("id") or f"call_{i}", fn.get("name", ""), args))
            # the environment parses calls from text, in the Hermes form
            text += "\n<tool_call>" + json.dumps({"name": fn.get("name"), "arguments": args}) + "</tool_call>"
        result = await env.step(text)
        if result.info.get("infra_failure"):
            return None, "sandbox failure"
        if result.done:
            return task_score(result.rewards, result.reward or 0.0), ""
        messages.append(Message("assistant", choice.get("content") or "", tool_calls=calls or None))
        tool_ids = iter(c.id for c in calls)
        for m in result.observations:
            if m.role == "tool":
                m = Message("tool", m.content, tool_call_id=next(tool_ids, m.tool_call_id), name=m.name)
            messages.append(m)
    return 0.0, "out of turns"


def evaluate_api(
    api_base: str, model: str, domains: dict[str, Any], arms: list[Any], n: int, limits: EpisodeLimits, seed: int,
    api_key: str | None = None, concurrency: int = 8, temperature: float = 0.0, samples: int = 1,
) -> EvalReport:
    """Score any OpenAI-compatible server on the same held-out tasks as `evaluate_local`.

    temperature 0 asks for greedy decoding (one episode per task); otherwise each task's score is the
    mean of `samples` episodes, each request carrying the seed `seed + k` (servers may ignore it). A
    task whose episodes all fail at the transport or protocol level (connection error, non-200,
    a body that is not a chat completion) is an infrastructure failure (`None`), never a crash."""
    import httpx

    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    k = 1 if temperature == 0.0 else samples
    tasks = heldout_tasks(domains, arms, n, seed)
    failures: list[str] = []

    async def run_all() -> list[float | None]:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        sem = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(base_url=api_base.rstrip("/"), headers=headers, timeout=120.0) as client:

            async def one(d: Any, t: Task, j: int) -> float | None:
                async with sem:
                    try:
                        score, why = await _api_episode(client, model, d, t, limits, temperature, None if k == 1 else seed + j)
                    except httpx.HTTPError as err:
                        score, why = None, f"{type(err).__name__}: {err}"
                if score is None:
                    failures.append(why)
                return score

            async def task_mean(d: Any, t: Task) -> float | None:
                got = [s for s in await asyncio.gather(*(one(d, t, j) for j in range(k))) if s is not None]
                return float(np.mean(got)) if got else None

            return await asyncio.gather(*(task_mean(d, t) for _, d, t in tasks))

    results = asyncio.run(run_all())
    report = EvalReport(model=f"{api_base}#{model}", per_task={}, failures=failures)
    for (arm, _, _), score in zip(tasks, results, strict=True):
        report.per_task.setdefault(arm.domain, []).append(score)
    report.summarise(seed)
    return report


def evaluate_local(
    spec: str, cfg: Any, domains: dict[str, Any], arms: list[Any], n: int, seed: int, sandbox: Any,
    temperature: float = 0.0, samples: int = 1,
) -> EvalReport:
    """Load `spec` (model spec or HF folder) into our engine and score it on held-out tasks.

    temperature 0 is greedy (one sample); otherwise each task's score is the mean over `samples`
    seeded samples (pass@1 estimated from k samples), the same seeds for every model compared.
    """
    from posttrain.engine import SamplingParams, make_engine
    from posttrain.models import load_policy, load_tokenizer

    tokenizer = load_tokenizer(spec)
    engine = make_engine(cfg.engine, load_policy(spec, dtype=cfg.engine.dtype), tokenizer)
    limits = EpisodeLimits(cfg.envs.max_turns, cfg.envs.max_episode_tokens, cfg.engine.max_new_tokens)
    sampling = SamplingParams(
        temperature=temperature, max_tokens=cfg.engine.max_new_tokens, stop_token_ids=[tokenizer.eos_token_id]
    )
    k = 1 if temperature == 0.0 else samples
    tasks = heldout_tasks(domains, arms, n, seed)
    report = EvalReport(model=spec, per_task={})
    for (arm, _, _), score in zip(tasks, score_tasks(engine, tokenizer, tasks, sandbox, sampling, limits, k, seed), strict=True):
        report.per_task.setdefault(arm.domain, []).append(score)
    report.summarise(seed)
    return report


def paired_delta(model: EvalReport, baseline: EvalReport, seed: int = 0) -> dict[str, Any]:
    """Mean difference (model - baseline) over tasks scored in both, per domain and over all tasks,
    with paired bootstrap 95% intervals."""
    out: dict[str, Any] = {"per_domain": {}}
    all_diffs: list[float] = []
    for dom in model.per_task:
        a, b = model.per_task[dom], baseline.per_task.get(dom, [])
        diffs = np.array([x - y for x, y in zip(a, b, strict=False) if x is not None and y is not None], dtype=float)
        lo, hi = bootstrap_ci(diffs, seed)
        out["per_domain"][dom] = {"delta": float(diffs.mean()) if len(diffs) else float("nan"), "ci_low": lo, "ci_high": hi}
        all_diffs.extend(diffs.tolist())
    arr = np.array(all_diffs, dtype=float)
    lo, hi = bootstrap_ci(arr, seed)
    out.update({"delta": float(arr.mean()) if len(arr) else float("nan"), "ci_low": lo, "ci_high": hi, "n_tasks": len(arr)})
    return out
