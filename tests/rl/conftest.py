"""Shared fixtures for the RL-loop tests: a scripted engine that replays given assistant texts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from posttrain.engine import Completion, GenerationOutput
from posttrain.models import load_tokenizer


@dataclass
class ScriptedEngine:
    """Plays a fixed list of assistant texts (each ended by EOS) and records every request."""

    tokenizer: Any
    script: list[str]
    version: int = 0
    requests: list[list[int]] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)

    async def agenerate(self, request: Any) -> GenerationOutput:
        turn = len(self.requests)
        self.requests.append(list(request.prompt_token_ids))
        ids = self.tokenizer.encode(self.script[turn], add_special_tokens=False) + [
            self.tokenizer.eos_token_id
        ]
        self.outputs.append(ids)
        return GenerationOutput(
            request_id=str(turn),
            prompt_token_ids=list(request.prompt_token_ids),
            completions=[Completion(ids, [-0.25] * len(ids), self.script[turn], "stop")],
            ttft_s=0.0,
        )


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer("tiny:llama")
