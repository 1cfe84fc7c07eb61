"""One episode against an OpenAI-compatible chat endpoint: the environment's prompt and tools go out
as a chat completion request, the reply's text (with its tool calls written back in the Hermes form the
environment parses) goes to `env.step`, until the episode ends or runs out of turns. Used by
`posttrain eval --api-base` and the CI auto-fix agent. Transport and protocol failures are reported as
infrastructure failures, never scores; the caller owns the HTTP client.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from posttrain.envs.base import StepResult
from posttrain.rollout.agent import EpisodeLimits
from posttrain.types import Message, Task, ToolCall


class BadResponse(Exception):
    """The server's answer is not an OpenAI chat completion (an infrastructure failure, not a score)."""


def message_of(resp: Any) -> dict[str, Any]:
    try:
        message = resp.json()["choices"][0]["message"]
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise BadResponse(f"not a chat completion ({type(err).__name__}): {resp.text[:200]}") from None
    if not isinstance(message, dict):
        raise BadResponse(f"choices[0].message is not an object: {resp.text[:200]}")
    return message


@dataclass
class ApiEpisode:
    """One episode against an OpenAI-compatible endpoint: the final `StepResult` (None on an
    infrastructure failure or a reward-function error, with `why`), the conversation as sent, and the server's token usage."""

    result: StepResult | None
    why: str
    messages: list[Message]
    completion_tokens: int = 0
    prompt_tokens: int = 0


async def api_episode(
    client: Any,
    model: str,
    env: Any,
    task: Task,
    limits: EpisodeLimits,
    temperature: float = 0.0,
    seed: int | None = None,
) -> ApiEpisode:
    """Drive `env` (made with chat_format "hermes") with an OpenAI-compatible chat endpoint, text in and
    text out: tool calls the server returns are handed to the environment in the Hermes form it parses.
    Out of turns, the environment scores the state as it stands, as a local rollout would."""
    obs = await env.reset(task)
    messages: list[Message] = list(obs.messages)
    ep = ApiEpisode(None, "", messages)
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
            ep.why = f"HTTP {resp.status_code}: {resp.text[:200]}"
            return ep
        try:
            choice = message_of(resp)
        except BadResponse as err:
            ep.why = str(err)
            return ep
        usage = resp.json().get("usage") or {}
        ep.completion_tokens += int(usage.get("completion_tokens") or 0)
        ep.prompt_tokens += int(usage.get("prompt_tokens") or 0)
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
        messages.append(Message("assistant", choice.get("content") or "", tool_calls=calls or None))
        if result.info.get("infra_failure"):
            ep.why = f"sandbox failure: {result.info.get('infra_error', '')}"[:300]
            return ep
        if result.info.get("reward_fn_error"):
            ep.why = str(result.info["reward_fn_error"])[:500]
            return ep
        if result.done:
            ep.result = result
            return ep
        tool_ids = iter(c.id for c in calls)
        for m in result.observations:
            if m.role == "tool":
                m = Message("tool", m.content, tool_call_id=next(tool_ids, m.tool_call_id), name=m.name)
            messages.append(m)
    result = await env.finalize()
    if result.info.get("infra_failure"):
        ep.why = f"sandbox failure: {result.info.get('infra_error', '')}"[:300]
        return ep
    if result.info.get("reward_fn_error"):
        ep.why = str(result.info["reward_fn_error"])[:500]
        return ep
    ep.result = result
    return ep
