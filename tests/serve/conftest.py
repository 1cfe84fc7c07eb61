"""Fixtures for the server tests: a live uvicorn server on a free 127.0.0.1 port in a background thread,
serving the tiny random model on the paged engine ("tiny", and "tiny-fast": int4 weights and prompt-lookup
speculation) and a scripted engine double ("scripted")
whose reply is whatever follows `SAY:` in the last user message (for tool-call content)."""

from __future__ import annotations

import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest
import uvicorn

from posttrain.engine import Completion, Engine, GenerationOutput, GenerationRequest, PagedEngine
from posttrain.models import load_policy, load_tokenizer
from posttrain.serve import ModelEntry, ServeSettings, ServeState, create_app

MAX_MODEL_LEN = 512


class ScriptedEngine(Engine):
    """An Engine double: replies with the text after the last `SAY:` of the prompt, then EOS."""

    def __init__(self, tokenizer: Any, gate: threading.Event | None = None) -> None:
        self.tokenizer = tokenizer
        self.version = 0
        self.gate = gate
        self.max_model_len = MAX_MODEL_LEN

    def _reply(self, req: GenerationRequest) -> Completion:
        prompt = self.tokenizer.decode(req.prompt_token_ids)
        said = re.findall(r"SAY:(.*?)<\|im_end\|>", prompt, re.DOTALL)
        text = said[-1] if said else "nothing to say"
        ids = self.tokenizer.encode(text, add_special_tokens=False)[: req.params.max_tokens]
        finish = "stop" if len(ids) < req.params.max_tokens else "length"
        ids = ids + [self.tokenizer.eos_token_id] if finish == "stop" else ids
        return Completion(ids, [-0.5] * len(ids), text, finish)

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationOutput]:
        if self.gate is not None:
            assert self.gate.wait(30), "gate never opened"
        return [
            GenerationOutput(r.request_id or "x", r.prompt_token_ids, [self._reply(r)] * r.params.n, 0.0)
            for r in requests
        ]

    def load_weights(self, weights: Any, version: int | None = None) -> None:
        self.version = version or self.version + 1


@dataclass
class Live:
    url: str
    state: ServeState
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


def start_server(state: ServeState) -> Live:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(state=state), log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    return Live(f"http://127.0.0.1:{port}", state, server, thread)


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer("tiny:llama")


@pytest.fixture(scope="session")
def tiny_model():
    return load_policy("tiny:llama", seed=0)


def tiny_engine(model: Any, tokenizer: Any) -> PagedEngine:
    return PagedEngine(model, tokenizer, block_size=16, num_blocks=256, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def live(tokenizer, tiny_model):
    state = ServeState(ServeSettings(max_queue=64, max_running=16))
    state.add_model(
        ModelEntry("tiny", tiny_engine(tiny_model, tokenizer), tokenizer, max_model_len=MAX_MODEL_LEN)
    )
    # the double has no constrained decoding: its forced tool choices are prefill and prompt only
    scripted = ModelEntry(
        "scripted", ScriptedEngine(tokenizer), tokenizer, max_model_len=MAX_MODEL_LEN, constrained=False
    )
    state.add_model(scripted)
    fast = PagedEngine(
        tiny_model,
        tokenizer,
        block_size=16,
        num_blocks=256,
        max_model_len=MAX_MODEL_LEN,
        weight_quant="int4",
        speculative="ngram",
        prompt_lookup_min=1,
    )
    state.add_model(ModelEntry("tiny-fast", fast, tokenizer, mode="fast", max_model_len=MAX_MODEL_LEN))
    srv = start_server(state)
    yield srv
    srv.stop()


@pytest.fixture
def client(live):
    import openai

    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)
