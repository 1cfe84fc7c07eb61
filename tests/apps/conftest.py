"""Fixtures for the CI auto-fix tests: planted git repositories, a warm sandbox, and live OpenAI-compatible
servers on 127.0.0.1: one over a canned engine double (a scripted policy: its replies are a fixed list
of texts, one per request, so tool calls go through the real server and parsers) and one over the tiny
random model on the paged engine."""

from __future__ import annotations

import asyncio
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from envs.conftest import sandbox  # noqa: F401 - the session's warm sandbox, shared with the env tests
from posttrain.engine import Completion, Engine, GenerationOutput, GenerationRequest


def git(root: Path, *args: str) -> str:
    env = {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    import os

    proc = subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, env={**os.environ, **env}
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def make_repo(root: Path, files: dict[str, str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    git(root, "init", "-q", "-b", "main")
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "init")
    return root


BUGGY_OPS = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
FIXED_OPS = BUGGY_OPS.replace("a - b", "a + b")
PLANTED = {
    "calc/__init__.py": "",
    "calc/ops.py": BUGGY_OPS,
    "tests/test_ops.py": (
        "from calc.ops import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
        "def test_mul():\n    assert mul(2, 3) == 6\n"
    ),
}
FIX_PATCH = "--- a/calc/ops.py\n+++ b/calc/ops.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n"


@pytest.fixture
def planted(tmp_path) -> Path:
    return make_repo(tmp_path / "planted", PLANTED)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


class CannedEngine(Engine):
    """An Engine double whose n-th request gets the n-th text of `texts` (then "done")."""

    def __init__(self, tokenizer: Any, texts: list[str]) -> None:
        self.tokenizer = tokenizer
        self.texts = list(texts)
        self.version = 0
        self.max_model_len = 16384
        self.lock = threading.Lock()

    def _reply(self, req: GenerationRequest) -> Completion:
        with self.lock:
            text = self.texts.pop(0) if self.texts else "done"
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return Completion(ids, [-0.5] * len(ids), text, "stop")

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationOutput]:
        return [
            GenerationOutput(r.request_id or "x", r.prompt_token_ids, [self._reply(r)], 0.0) for r in requests
        ]

    def load_weights(self, weights: Any, version: int | None = None) -> None:
        self.version = version or self.version + 1


@pytest.fixture(scope="session")
def tokenizer():
    from posttrain.models import load_tokenizer

    return load_tokenizer("tiny:llama")


@pytest.fixture
def canned_server(tokenizer):
    """start(texts) -> (base URL, the ChatFormat the server parses tool calls in)."""
    from posttrain.envs.parsers import get_parser
    from posttrain.serve import ModelEntry, ServeSettings, ServeState
    from serve.conftest import start_server

    live = []

    def start(texts: list[str]) -> tuple[str, Any]:
        state = ServeState(ServeSettings())
        entry = ModelEntry("canned", CannedEngine(tokenizer, texts), tokenizer, max_model_len=16384)
        state.add_model(entry)
        live.append(start_server(state))
        return live[-1].url + "/v1", get_parser(entry.chat_format)

    yield start
    for srv in live:
        srv.stop()
