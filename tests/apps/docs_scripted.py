"""A scripted chat model for the document-pipeline tests, and a worker entry point that runs with it
(the tests start it as a subprocess to kill it).

`oracle`: answers each extraction request with the gold values of the report whose values the prompt
states most, each field only where the prompt (the chunk) states its value - a stand-in for a model
that reads; `garbage`: never JSON; `repair`: not JSON first, then the oracle's answer on the repair turn.
`delay_s` sleeps before each answer (long enough to kill a worker mid-job).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from typing import Any

from posttrain.apps.docs.analyze import Reply


def _mentions(text: str, value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return bool(re.search(rf"(?<![\d,]){re.escape(f'{value:,}')}(?![\d,])", text)) or bool(
            re.search(rf"\bFY{value}\b", text)
        )
    return str(value) in text


class ScriptedModel:
    def __init__(
        self,
        golds: list[dict[str, Any]],
        mode: str = "oracle",
        delay_s: float = 0.0,
        context_tokens: int = 100_000,
    ) -> None:
        self.golds, self.mode, self.delay_s = golds, mode, delay_s
        self.name = f"scripted-{mode}"
        self.context_tokens = context_tokens
        self.calls = 0

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def answer(self, prompt: str) -> dict[str, Any]:
        doc = prompt.split("\n---\n")[0]
        best = max(self.golds, key=lambda g: sum(_mentions(doc, v) for v in g.values()))
        return {k: (v if _mentions(doc, v) else None) for k, v in best.items()}

    async def complete(self, messages, max_tokens, schema) -> Reply:
        self.calls += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        repair_turn = len(messages) > 2
        if self.mode == "garbage" or (self.mode == "repair" and not repair_turn):
            text = "Sure! The company did well this year {not json"
        else:
            text = json.dumps(self.answer(messages[1]["content"]))
        return Reply(text, self.count_tokens(messages[-1]["content"]), self.count_tokens(text))


def main(argv: list[str]) -> None:
    """argv: queue_url db_url golds.json mode delay_s concurrency visibility_s [until_idle]"""
    from posttrain.apps.docs.db import Database
    from posttrain.apps.docs.queue import QueuePolicy, open_queue
    from posttrain.apps.docs.worker import Worker

    queue_url, db_url, golds, mode, delay, conc, vis = argv[:7]
    queue = open_queue(queue_url, QueuePolicy(visibility_s=float(vis), max_attempts=3, backoff_s=0.0))
    model = ScriptedModel(json.load(open(golds)), mode, float(delay))
    worker = Worker(queue, Database(db_url), model, concurrency=int(conc), poll_s=0.1)
    stats = asyncio.run(worker.run(until_idle=len(argv) > 7))
    print(json.dumps(stats.__dict__))


if __name__ == "__main__":
    main(sys.argv[1:])
