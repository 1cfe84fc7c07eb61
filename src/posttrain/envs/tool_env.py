"""The multi-turn tool-use episode shared by tool domains: parse the assistant text with the chat
format's parser, run valid calls, answer invalid or unparseable ones with an explanatory observation,
count everything, and score when the model answers without a call, calls a terminal tool, or runs out
of turns. Domains subclass `ToolEnvironment` and provide `setup` and `score`.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

from posttrain.envs.base import Environment, Observation, StepResult, clip01
from posttrain.envs.parsers import ParsedOutput, get_parser
from posttrain.envs.tools import InfraError, Tool, execute_call, tool_specs
from posttrain.types import Message, Task

MAX_TEXT_CHARS = 200_000  # longer assistant texts are cut before parsing (a scored, counted event)


class ToolEnvironment(Environment):
    """One tool-use episode. `terminal_tools` end the episode when called (e.g. `submit`)."""

    terminal_tools: frozenset[str] = frozenset()

    def __init__(self, chat_format: str = "smollm2", max_turns: int = 4) -> None:
        self.parser = get_parser(chat_format)
        self.max_turns = max_turns
        self.task: Task | None = None
        self.tools: dict[str, Tool] = {}
        self.turn = 0
        self.final_text: str | None = None
        self.called_terminal = False
        self.truncated = False
        self.counts: dict[str, int] = {}
        self._final: StepResult | None = None

    @abstractmethod
    async def setup(self, task: Task) -> tuple[list[Message], dict[str, Tool]]:
        """Build per-episode state; return the prompt messages and the tools."""

    @abstractmethod
    async def score(self) -> tuple[float, dict[str, float], dict[str, Any]]:
        """(reward in [0,1], named components, extra info) for the episode as it stands."""

    async def reset(self, task: Task) -> Observation:
        self.task = task
        self.turn = 0
        self.final_text = None
        self.called_terminal = False
        self.truncated = False
        self._final = None
        self.counts = {
            "tool_calls": 0,
            "invalid_tool_calls": 0,
            "tool_errors": 0,
            "unparseable": 0,
            "tool_internal_errors": 0,
            "overlong": 0,
        }
        try:
            messages, self.tools = await self.setup(task)
        except InfraError as err:  # reported by the first step(), so reset() never raises on infrastructure
            self._finish_infra(str(err))
            return Observation(messages=list(task.prompt), tools=list(task.tools))
        return Observation(messages=messages, tools=tool_specs(self.tools))

    def format_hint(self) -> str:
        example = self.parser.format_calls([("tool_name", {"arg": "value"})])
        return f"Call tools as {example}, or answer in plain text when you are done."

    async def step(self, assistant_text: str) -> StepResult:
        if self.task is None:
            raise RuntimeError("step() before reset()")
        if self._final is not None:
            return self._final
        self.turn += 1
        text = assistant_text if isinstance(assistant_text, str) else ""
        if len(text) > MAX_TEXT_CHARS:
            self.counts["overlong"] += 1
            text = text[:MAX_TEXT_CHARS]
        parsed: ParsedOutput = self.parser.parse(text, turn=self.turn)
        observations: list[Message] = []
        try:
            for call in parsed.calls:
                self.counts["tool_calls"] += 1
                outcome = await execute_call(self.tools, call)
                self.counts["invalid_tool_calls"] += int(outcome.invalid)
                self.counts["tool_errors"] += int(outcome.tool_error)
                self.counts["tool_internal_errors"] += int(outcome.internal_error)
                observations.append(outcome.message)
                if outcome.ok and call.name in self.terminal_tools:
                    self.called_terminal = True
                    break
        except InfraError as err:
            return self._finish_infra(str(err))
        if parsed.errors:
            self.counts["unparseable"] += 1
            observations.append(
                Message(
                    role="user",
                    content="Your tool call could not be parsed: "
                    + "; ".join(parsed.errors[:3])
                    + ". "
                    + self.format_hint(),
                )
            )
        answered = not parsed.calls and not parsed.errors
        if answered:
            self.final_text = parsed.content
        if answered or self.called_terminal or self.turn >= self.max_turns:
            return await self._finish(truncated=not (answered or self.called_terminal))
        return StepResult(observations=observations, reward=None, done=False, info=self._info())

    async def finalize(self) -> StepResult:
        """Score the episode as it stands when the caller's own turn or token budget ran out first."""
        if self.task is None:
            raise RuntimeError("finalize() before reset()")
        if self._final is not None:
            return self._final
        return await self._finish(truncated=True)

    async def _finish(self, truncated: bool) -> StepResult:
        self.truncated = truncated
        try:
            reward, rewards, extra = await self.score()
        except InfraError as err:
            return self._finish_infra(str(err))
        info = {**self._info(), **extra, "truncated": truncated}
        self._final = StepResult(
            observations=[], reward=clip01(reward), done=True, rewards=rewards, info=info
        )
        return self._final

    def _info(self) -> dict[str, Any]:
        return {**self.counts, "turns": self.turn, "infra_failure": False}

    def _finish_infra(self, detail: str) -> StepResult:
        info = {**self._info(), "infra_failure": True, "infra_error": detail[:500]}
        self._final = StepResult(observations=[], reward=None, done=True, rewards={}, info=info)
        return self._final
