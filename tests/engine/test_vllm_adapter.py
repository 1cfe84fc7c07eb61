"""The vLLM adapter's protocol against a stand-in for vLLM's AsyncLLM that enforces what the real
engine requires (`tests/engine/test_vllm_cpu.py` runs the real one on CPU, `scripts/gpu_smoke.sh` on CUDA):
sleep mode enabled when
sleep is used, nothing loaded into or generated from a sleeping engine, one event loop for every
caller, weights passed by path (never a pickled dict) and refused when stale."""

from __future__ import annotations

import asyncio
import sys
import threading
import types
from dataclasses import dataclass, field

import pytest
import torch

from posttrain.config import load_config
from posttrain.engine import GenerationRequest, SamplingParams, make_engine
from posttrain.engine.vllm_worker import WeightLoader
from posttrain.models import load_policy, load_tokenizer


@dataclass
class _Logprob:
    logprob: float


@dataclass
class _CompletionOut:
    token_ids: list[int]
    logprobs: list[dict[int, _Logprob]]
    text: str
    finish_reason: str


@dataclass
class _RequestOut:
    outputs: list[_CompletionOut]
    metrics: object = None


class _Worker(WeightLoader):
    """vLLM's worker as the extension sees it: `reload_weights` (vLLM's in-place reload)."""

    def __init__(self) -> None:
        self.model_runner = types.SimpleNamespace(model=types.SimpleNamespace(loaded={}))

    def reload_weights(self, weights_iterator):
        for name, t in weights_iterator:
            self.model_runner.model.loaded[name] = t.clone()


@dataclass
class FakeAsyncLLM:
    args: dict
    workers: list[_Worker] = field(default_factory=lambda: [_Worker(), _Worker()])
    asleep: set = field(default_factory=set)
    calls: list = field(default_factory=list)
    threads: set = field(default_factory=set)
    loops: set = field(default_factory=set)

    @classmethod
    def from_engine_args(cls, engine_args):
        return cls(dict(engine_args.kwargs))

    def _here(self) -> None:
        self.threads.add(threading.get_ident())
        self.loops.add(id(asyncio.get_running_loop()))

    async def generate(self, prompt, params, request_id):
        self._here()
        if self.asleep:
            raise RuntimeError(f"generate on a sleeping engine ({sorted(self.asleep)})")
        self.calls.append(("generate", request_id))
        await asyncio.sleep(0.01)
        n_tok = min(params.kwargs["max_tokens"], 3)
        comps = []
        for j in range(params.kwargs["n"]):
            ids = [10 + j + k for k in range(n_tok)]
            steps = [{t: _Logprob(-0.5 - k), t + 1: _Logprob(-3.0)} for k, t in enumerate(ids)]
            comps.append(_CompletionOut(ids, steps, "x" * n_tok, "length"))
        yield _RequestOut([])
        yield _RequestOut(comps)

    async def sleep(self, level):
        self._here()
        if not self.args.get("enable_sleep_mode"):
            raise RuntimeError("sleep mode is not enabled")
        self.calls.append(("sleep", level))
        self.asleep = {"weights", "kv_cache"}

    async def wake_up(self, tags=None):
        self._here()
        self.calls.append(("wake_up", tuple(tags)))
        self.asleep -= set(tags)

    async def collective_rpc(self, method, args=()):
        self._here()
        if "weights" in self.asleep:
            raise RuntimeError("weights copied into a sleeping engine")
        assert all(isinstance(a, str | int) for a in args), "only a path and a version cross the RPC"
        self.calls.append(("rpc", method))
        return [getattr(w, method)(*args) for w in self.workers]

    async def reset_prefix_cache(self, reset_running_requests=False):
        self.calls.append(("reset_prefix_cache",))
        return True

    def shutdown(self):
        self.calls.append(("shutdown",))


@pytest.fixture
def fake_vllm(monkeypatch):
    class _Kw:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = type("SamplingParams", (_Kw,), {})
    vllm.AsyncEngineArgs = type("AsyncEngineArgs", (_Kw,), {})
    mods = {"vllm": vllm}
    for name in ("vllm.v1", "vllm.v1.engine", "vllm.v1.engine.async_llm"):
        mods[name] = types.ModuleType(name)
    mods["vllm.v1.engine.async_llm"].AsyncLLM = FakeAsyncLLM
    mods["vllm.platforms"] = types.ModuleType("vllm.platforms")  # a GPU platform: sleep mode available
    mods["vllm.platforms"].current_platform = types.SimpleNamespace(is_sleep_mode_available=lambda: True)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return vllm


@pytest.fixture
def engine(fake_vllm):
    cfg = load_config(None, ["model.spec=tiny:llama", "engine.backend=vllm", "engine.tensor_parallel_size=2"])
    eng = make_engine(cfg.engine, load_policy("tiny:llama"), load_tokenizer("tiny:llama"))
    yield eng
    eng.close()


def test_engine_args_and_sampling(engine):
    args = engine.llm.args
    assert args["enable_sleep_mode"] is True and args["logprobs_mode"] == "processed_logprobs"
    assert args["worker_extension_cls"] == "posttrain.engine.vllm_worker.WeightLoader"
    assert args["tensor_parallel_size"] == 2 and args["pipeline_parallel_size"] == 1
    p = engine._params(SamplingParams(n=2, presence_penalty=0.5, frequency_penalty=-0.25, max_tokens=4))
    assert p.kwargs["presence_penalty"] == 0.5 and p.kwargs["frequency_penalty"] == -0.25


def test_callers_share_one_loop_and_logprobs_are_the_sampled_tokens(engine):
    async def many():
        reqs = [GenerationRequest([1, 2, 3], SamplingParams(n=2, max_tokens=3)) for _ in range(4)]
        return await asyncio.gather(*(engine.agenerate(r) for r in reqs))

    outs = asyncio.run(many()) + engine.generate([GenerationRequest([4, 5], SamplingParams(max_tokens=2))])
    assert len(engine.llm.loops) == 1 and len(engine.llm.threads) == 1  # one AsyncLLM loop for all callers
    assert engine.llm.threads != {threading.get_ident()}
    first = outs[0].completions
    assert [c.token_ids for c in first] == [[10, 11, 12], [11, 12, 13]]
    assert first[0].logprobs == [-0.5, -1.5, -2.5]
    assert outs[-1].completions[0].token_ids == [10, 11]


def test_sleep_then_load_weights_wakes_weights_first_and_kv_at_the_next_request(engine):
    engine.release_kv_cache()
    weights = {"base_model.model.model.norm.weight": torch.full((64,), 2.0)}
    engine.load_weights(weights, version=7)
    assert engine.version == 7
    calls = engine.llm.calls
    assert calls[-4:] == [
        ("sleep", 1),
        ("wake_up", ("weights",)),
        ("rpc", "posttrain_load_weights"),
        ("reset_prefix_cache",),
    ]
    for w in engine.llm.workers:
        loaded = w.model_runner.model.loaded
        # the whole model travels (vLLM reloads fused layers from all their parts), the pushed part updated
        assert set(loaded) == set(load_policy("tiny:llama").state_dict())
        assert torch.equal(loaded["model.norm.weight"], torch.full((64,), 2.0))
    engine.generate([GenerationRequest([1], SamplingParams(max_tokens=1))])
    assert ("wake_up", ("kv_cache",)) in calls and calls[-1][0] == "generate"


def test_a_stale_or_truncated_weight_file_is_refused(tmp_path):
    from safetensors.torch import save_file

    path = str(tmp_path / "w.safetensors")
    save_file({"a": torch.ones(2)}, path, metadata={"posttrain_version": "3", "posttrain_tensors": "1"})
    worker = _Worker()
    assert worker.posttrain_load_weights(path, 3) == {"version": 3, "tensors": 1}
    # refusals are returned, not raised: an exception in a worker RPC kills vLLM's engine process
    assert "expected version 4" in worker.posttrain_load_weights(path, 4)["refused"]
    save_file({"a": torch.ones(2)}, path, metadata={"posttrain_version": "5", "posttrain_tensors": "2"})
    assert "declared '2'" in worker.posttrain_load_weights(path, 5)["refused"]
    with open(path, "r+b") as f:
        f.truncate(40)
    assert "unreadable" in worker.posttrain_load_weights(path, 5)["refused"]
    assert worker.model_runner.model.loaded["a"].tolist() == [1.0, 1.0]  # only the first, good file loaded


def test_a_push_not_applied_by_every_worker_raises_and_keeps_the_version(engine, monkeypatch):
    engine.load_weights({"model.norm.weight": torch.ones(64)}, version=1)

    def broken(path, version):
        return {"version": version - 1, "tensors": 1}

    monkeypatch.setattr(engine.llm.workers[1], "posttrain_load_weights", broken)
    with pytest.raises(RuntimeError, match="not applied by every worker"):
        engine.load_weights({"model.norm.weight": torch.ones(64)}, version=2)
    assert engine.version == 1


def test_a_push_of_an_unknown_name_or_a_wrong_shape_is_refused_before_it_is_sent(engine):
    with pytest.raises(ValueError, match="does not have: model.nope"):
        engine.load_weights({"model.nope": torch.ones(64)}, version=1)
    with pytest.raises(ValueError, match=r"model.norm.weight \(63,\) \(the model's: \(64,\)\)"):
        engine.load_weights({"model.norm.weight": torch.ones(63)}, version=1)
    assert engine.version == 0 and not any(c[0] == "rpc" for c in engine.llm.calls)


def test_without_sleep_mode_release_kv_cache_only_empties_the_prefix_cache(fake_vllm, monkeypatch):
    platforms = sys.modules["vllm.platforms"]
    monkeypatch.setattr(platforms.current_platform, "is_sleep_mode_available", lambda: False)
    cfg = load_config(None, ["model.spec=tiny:llama", "engine.backend=vllm"])
    eng = make_engine(cfg.engine, load_policy("tiny:llama"), load_tokenizer("tiny:llama"))
    try:
        assert eng.llm.args["enable_sleep_mode"] is False  # vLLM refuses it on CPU
        eng.release_kv_cache()
        assert eng.llm.calls == [("reset_prefix_cache",)]
        eng.generate([GenerationRequest([1], SamplingParams(max_tokens=1))])
    finally:
        eng.close()


def test_vllm_only_keys_are_refused_on_the_paged_engine():
    cfg = load_config(None, ["model.spec=tiny:llama", "engine.tensor_parallel_size=2"])
    with pytest.raises(ValueError, match="engine.backend=paged does not run engine.tensor_parallel_size=2"):
        make_engine(cfg.engine, load_policy("tiny:llama"), load_tokenizer("tiny:llama"))
