"""Environments: the protocol, the registry, and the task domains (`envs/domains/*.py`).

Owns task generation, tools, tool-call parsing and verification. Never calls an engine and never
imports torch; code execution goes through an injected `posttrain.sandbox.Sandbox`.

Using it (the rollout loop does exactly this)::

    from posttrain.envs import get_domain, list_domains
    domain = get_domain("code.unit_tests", **options)        # UnknownDomainError (a KeyError) lists valid names
    domain.name, domain.difficulties, domain.splits            # splits: ("train", "heldout") or ("eval",)
    task = domain.task("train", difficulty=0, index=7, seed=0) # deterministic; train/heldout never overlap
    texts = domain.reference(task)                             # reference assistant texts, SmolLM2 tool markup
                                                               # (tool domains: reference(task, chat_format="hermes"))
    env = domain.make_env(sandbox, chat_format="smollm2")      # one instance per episode ("hermes"/"qwen" too);
                                                               # code/swe domains raise ValueError without a sandbox
    obs = await env.reset(task)                                # Observation(messages, tools); env.max_turns is
                                                               # final after reset (tool domains size it per task)
    res = await env.step(assistant_text)                       # StepResult(observations, reward, done, rewards, info)
    res = await env.finalize()                                 # score now if the caller's budget ran out first

`step` accepts any string and never raises on it. Until `done`, `reward` is None and `observations` are
the messages (role "tool" or "user") to append before the next assistant turn. On `done`, `reward` is a
finite number (in [0, 1] for the built-in domains) with named components in `rewards` (weights documented
in each domain module) and `info` holds counts (`turns`, `tool_calls`, `invalid_tool_calls`, `unparseable`,
...). When the sandbox fails, `info["infra_failure"]` is True, `done` is True and `reward` is None; when a
user's reward function fails, `info["reward_fn_error"]` says how: never train on either episode.

Generation cost: math, tools.apis and code.unit_tests make a task in about a millisecond; swe.ci_fix
runs the generated repository's tests in a local subprocess to verify the injected bug (0.1-1 s per
new task, cached), so call it off the event loop (`asyncio.to_thread`) when latency matters.

Adding a domain: subclass `Domain`, decorate it with `@register_env("name")`, and implement `task`,
`reference` and `make_env` (multi-turn tool domains subclass `tool_env.ToolEnvironment`).
"""

from posttrain.envs.base import Domain, Environment, Observation, StepResult
from posttrain.envs.registry import UnknownDomainError, get_domain, list_domains, load_plugin, register_env
from posttrain.envs.scripted import EpisodeResult, check_reference, run_episode

__all__ = [
    "Domain",
    "Environment",
    "EpisodeResult",
    "Observation",
    "StepResult",
    "UnknownDomainError",
    "check_reference",
    "get_domain",
    "load_plugin",
    "list_domains",
    "register_env",
    "run_episode",
]
