"""Shared fixtures for the RL-loop tests: a scripted engine that replays given assistant texts, and a
dataset domain paid by completion length (rewards that vary under the tiny random model)."""

from __future__ import annotations

import json
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


# the tiny random model earns no math or tool reward: a dataset domain pays by completion length (its last digit)
REWARD_FN = """
def by_length(prompts, completions, **columns):
    return [len(c) % 10 / 10 for c in completions]
"""


@pytest.fixture(scope="session")
def length_domain(tmp_path_factory) -> str:
    """The `envs.domains` override of a dataset domain paid by `by_length`."""
    d = tmp_path_factory.mktemp("length_data")
    rows = [{"prompt": f"Say something about {w}.", "answer": "", "split": "train"} for w in "abcdefgh"]
    (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "length_reward.py").write_text(REWARD_FN)
    domain = f"{{name: dataset, difficulties: [0], options: {{path: '{d / 'rows.jsonl'}', "
    domain += f"reward_fn: '{d / 'length_reward.py'}:by_length', split_key: split}}}}"
    return f"envs.domains=[{domain}]"
