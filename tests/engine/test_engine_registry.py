"""The engine seam: every backend built here is an `Engine` (the protocol), the registry lists and builds
them by name, an unknown name says what would be right, the vLLM module is imported only when asked
for, and a new backend needs only `generate`, `load_weights` and `version` to get the protocol's defaults."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from engine.helpers import tiny
from posttrain.config import EngineConfig
from posttrain.engine import (
    Completion,
    Engine,
    GenerationOutput,
    GenerationRequest,
    HFEngine,
    PagedEngine,
    UnknownEngineError,
    engine_builder,
    list_engines,
    make_engine,
    register_engine,
)


def test_the_backends_built_here_are_engines_and_registered(tokenizer):
    assert {"hf", "paged", "vllm"} <= set(list_engines())
    model = tiny("llama")
    paged = make_engine(EngineConfig(backend="paged", block_size=8, num_kv_blocks=32), model, tokenizer)
    hf = make_engine(EngineConfig(backend="hf"), model, tokenizer)
    assert isinstance(paged, PagedEngine) and isinstance(paged, Engine)
    assert isinstance(hf, HFEngine) and isinstance(hf, Engine)
    # hf keeps the protocol's defaults for what it does not have: no prefix cache, no KV figures
    assert hf.caches_prefixes is False and hf.kv_stats() == {}
    assert paged.caches_prefixes is True and paged.kv_stats()["blocks_allocated"] == 0


def test_an_object_missing_a_member_is_not_an_engine():
    class OnlyAsync:  # what the agent loop's test doubles implement
        version = 0

        async def agenerate(self, request):
            return None

    assert not isinstance(OnlyAsync(), Engine)
    assert not isinstance(object(), Engine)


def test_an_unknown_backend_names_the_registered_ones(tokenizer):
    with pytest.raises(
        UnknownEngineError,
        match=r"unknown engine backend 'pagd'; did you mean 'paged'\? \(registered: .*hf, paged",
    ):
        engine_builder("pagd")
    cfg = EngineConfig().model_copy(
        update={"backend": "hff"}
    )  # past the config's own check, as a plugin name would be
    with pytest.raises(ValueError, match="did you mean 'hf'"):
        make_engine(cfg, tiny("llama"), tokenizer)
    with pytest.raises(UnknownEngineError, match=r"'zzz' \(registered: "):  # nothing close: no guess
        engine_builder("zzz")


def test_the_vllm_module_is_imported_only_when_asked_for():
    code = (
        "import sys\n"
        "from posttrain.engine import engine_builder, list_engines\n"
        "assert 'vllm' in list_engines()\n"
        "engine_builder('paged'); engine_builder('hf')\n"
        "assert 'posttrain.engine.vllm_backend' not in sys.modules\n"
        "engine_builder('vllm')\n"
        "assert 'posttrain.engine.vllm_backend' in sys.modules and 'vllm' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


class EchoEngine(Engine):
    """A backend with only the required members: echoes the prompt's last token, twice."""

    def __init__(self) -> None:
        self.version = 0

    def generate(self, requests):
        out = []
        for r in requests:
            ids = [r.prompt_token_ids[-1]] * 2
            out.append(
                GenerationOutput(
                    r.request_id or "echo",
                    list(r.prompt_token_ids),
                    [Completion(ids, [-0.5, -0.5], "xx", "length")],
                    0.0,
                )
            )
        return out

    def load_weights(self, weights, version=None):
        self.version = self.version + 1 if version is None else int(version)


@register_engine("test-echo")
def build_echo(engine_cfg, model, tokenizer, *, seed=0):
    return EchoEngine()


def test_a_registered_backend_gets_the_protocol_defaults():
    engine = make_engine(EngineConfig().model_copy(update={"backend": "test-echo"}), None, None)
    assert isinstance(engine, EchoEngine) and isinstance(engine, Engine) and "test-echo" in list_engines()
    req = GenerationRequest([3, 4, 9])
    out = asyncio.run(engine.agenerate(req))  # default: generate() in a worker thread
    assert out.completions[0].token_ids == [9, 9]

    async def deltas():
        return [d async for d in engine.stream(req)]

    (delta,) = asyncio.run(deltas())  # default: the completion whole, finished
    assert (delta.index, delta.token_ids, delta.logprobs, delta.finish_reason) == (
        0,
        [9, 9],
        [-0.5, -0.5],
        "length",
    )
    assert engine.caches_prefixes is False and engine.kv_stats() == {}
    assert engine.release_kv_cache() is None and engine.reset_stats() is None
    engine.load_weights({}, version=7)
    assert engine.version == 7


def test_a_second_builder_under_a_taken_name_is_refused():
    def other(engine_cfg, model, tokenizer, *, seed=0):
        return EchoEngine()

    engine_builder("paged")  # the built-in registers on first lookup
    with pytest.raises(
        ValueError, match="engine 'paged' is already registered by posttrain.engine.paged.build_paged"
    ):
        register_engine("paged")(other)


def test_another_backend_refuses_the_paged_engines_keys(tokenizer):
    cfg = EngineConfig(backend="hf", speculative="ngram", weight_quant="int4")
    with pytest.raises(
        ValueError, match=r"engine.backend=hf does not run engine.weight_quant=int4, engine.speculative=ngram"
    ):
        make_engine(cfg, tiny("llama"), tokenizer)
    assert EngineConfig(backend="hf").paged_only_settings() == []
    make_engine(EngineConfig(backend="hf", dtype="float32"), tiny("llama"), tokenizer)  # defaults: builds
