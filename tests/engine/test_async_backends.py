"""Async batching across concurrent callers, streaming, the HF baseline and make_engine."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.helpers import hf_logprobs, random_prompts, tiny
from posttrain.config import EngineConfig
from posttrain.engine import (
    BadRequestError,
    GenerationRequest,
    HFEngine,
    PagedEngine,
    SamplingParams,
    StreamDelta,
    make_engine,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_concurrent_agenerate_callers_are_batched_by_one_loop(tokenizer):
    model = tiny("llama")
    prompts = random_prompts([4, 9, 15, 22, 6, 11], seed=40)
    engine = PagedEngine(model, tokenizer, block_size=4, num_blocks=128)
    expected = [
        o.completions[0].token_ids for o in engine.generate([GenerationRequest(p, GREEDY) for p in prompts])
    ]
    steps_before = engine.num_steps
    ticks = 0
    step_threads: set[int] = set()
    step = engine._step

    def recording_step():
        step_threads.add(threading.get_ident())
        return step()

    engine._step = recording_step

    async def ticker(done: asyncio.Event):
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0.001)

    async def episode(i: int):
        await asyncio.sleep(0.002 * i)  # callers arrive while others are generating
        first = await engine.agenerate(GenerationRequest(prompts[i], GREEDY))
        await asyncio.sleep(0.01)  # a "sandbox" wait between turns
        second = await engine.agenerate(GenerationRequest(prompts[i], GREEDY))
        return first.completions[0].token_ids, second.completions[0].token_ids

    async def main():
        done = asyncio.Event()
        tick_task = asyncio.create_task(ticker(done))
        results = await asyncio.gather(*(episode(i) for i in range(len(prompts))))
        done.set()
        await tick_task
        return results

    results = asyncio.run(main())
    assert [r[0] for r in results] == expected and [r[1] for r in results] == expected
    steps = engine.num_steps - steps_before
    assert steps < 2 * 12 * len(prompts) / 2  # sequential serving would need >= 144 steps
    assert ticks >= steps / 2  # the event loop kept running between steps
    # every async step on one thread, not the event loop's (one OpenMP team: see paged.step_thread)
    assert len(step_threads) == 1 and threading.get_ident() not in step_threads


def test_stream_yields_the_completion_in_pieces(tokenizer):
    engine = PagedEngine(tiny("qwen2"), tokenizer, block_size=4, num_blocks=64)
    req = GenerationRequest(
        random_prompts([8], seed=41)[0], SamplingParams(temperature=1.0, max_tokens=10, n=2, seed=3)
    )
    whole = engine.generate([req])[0]

    async def collect():
        return [d async for d in engine.stream(req)]

    deltas: list[StreamDelta] = asyncio.run(collect())
    for j in range(2):
        mine = [d for d in deltas if d.index == j]
        assert len(mine) == 10
        assert sum((d.token_ids for d in mine), []) == whole.completions[j].token_ids
        assert "".join(d.text for d in mine) == whole.completions[j].text
        assert [d.finish_reason for d in mine] == [None] * 9 + ["length"]


def test_a_stream_closed_early_stops_generating_and_frees_its_blocks(tokenizer):
    engine = PagedEngine(tiny("llama"), tokenizer, block_size=4, num_blocks=64)
    params = SamplingParams(temperature=1.0, max_tokens=50, ignore_eos=True, seed=0)
    req = GenerationRequest([5, 6, 7], params, request_id="abandoned")
    other = GenerationRequest([8, 9], SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=1))

    async def main():
        first = []
        stream = engine.stream(req)
        async for delta in stream:
            first.append(delta)
            if len(first) == 3:
                break
        await stream.aclose()
        out = await engine.agenerate(other)
        # the 50-token request would still be running (3 + 20 steps so far) had it not been aborted
        left = [
            s
            for s in engine.scheduler.running + list(engine.scheduler.waiting)
            if s.request_id == "abandoned"
        ]
        return first, out, left, engine.kv_stats()["blocks_allocated"]

    first, out, left, blocks = asyncio.run(main())
    assert len(first) == 3 and len(out.completions[0].token_ids) == 20
    assert left == [] and blocks == 0


def test_hf_engine_matches_the_paged_engine_greedy_and_reports_logprobs(tokenizer):
    model = tiny("llama")
    prompts = random_prompts([10, 10, 10], seed=42)  # equal lengths: HF pads nothing
    reqs = [GenerationRequest(p, GREEDY) for p in prompts]
    hf = HFEngine(model, tokenizer).generate(reqs)
    paged = PagedEngine(model, tokenizer, block_size=4, num_blocks=64).generate(reqs)
    assert [o.completions[0].token_ids for o in hf] == [o.completions[0].token_ids for o in paged]
    sampled = HFEngine(model, tokenizer).generate(
        [
            GenerationRequest(
                prompts[0], SamplingParams(temperature=0.8, max_tokens=6, n=2, seed=0, ignore_eos=True)
            )
        ]
    )[0]
    assert len(sampled.completions) == 2
    for comp in sampled.completions:
        ref = hf_logprobs(model, prompts[0], comp.token_ids, temperature=0.8)
        assert max(abs(a - b) for a, b in zip(ref, comp.logprobs, strict=True)) < 1e-4


def test_make_engine_builds_the_configured_backend(tokenizer):
    model = tiny("llama")
    paged = make_engine(EngineConfig(backend="paged", block_size=8, num_kv_blocks=32), model, tokenizer)
    assert isinstance(paged, PagedEngine) and paged.block_size == 8 and paged.bm.num_blocks == 32
    assert paged.caches_prefixes  # the collector prefills a group's prompt once only on engines that cache
    no_cache = EngineConfig(backend="paged", block_size=8, num_kv_blocks=32, enable_prefix_caching=False)
    assert make_engine(no_cache, model, tokenizer).caches_prefixes is False
    hf = make_engine(EngineConfig(backend="hf"), model, tokenizer)
    assert isinstance(hf, HFEngine) and hf.caches_prefixes is False
    with pytest.raises(ImportError, match=r"pip install 'posttrain\[vllm\]'"):
        make_engine(EngineConfig(backend="vllm"), model, tokenizer)


def test_agenerate_works_across_event_loops_and_errors_reach_the_caller(tokenizer):
    engine = PagedEngine(tiny("llama"), tokenizer, block_size=4, num_blocks=64)
    req = GenerationRequest([5, 6, 7], GREEDY)
    first = asyncio.run(engine.agenerate(req)).completions[0].token_ids
    assert asyncio.run(engine.agenerate(req)).completions[0].token_ids == first  # a new loop, a new driver
    with pytest.raises(BadRequestError, match="max_tokens must be >= 1"):
        asyncio.run(engine.agenerate(GenerationRequest([5], SamplingParams(max_tokens=0))))


def test_hf_seeded_requests_give_the_same_tokens_alone_and_concurrently(tokenizer):
    import threading

    import torch

    model = tiny("llama")
    engine = HFEngine(model, tokenizer)
    prompts = random_prompts([7, 12], seed=43)
    params = [
        SamplingParams(temperature=1.0, top_k=50, max_tokens=16, seed=s, ignore_eos=True) for s in (11, 12)
    ]
    reqs = [GenerationRequest(p, q) for p, q in zip(prompts, params, strict=True)]
    state = torch.get_rng_state()
    alone = [engine.generate([r])[0].completions[0].token_ids for r in reqs]
    assert torch.equal(torch.get_rng_state(), state)  # a seeded request never touches the global generator
    assert alone[0] != alone[1]

    stop = threading.Event()

    def other_work():  # e.g. a learner's dropout in another thread, drawing from the global generator
        while not stop.is_set():
            torch.manual_seed(int(torch.randint(0, 1000, (1,))))
            torch.rand(64)

    async def together():
        return await asyncio.gather(*(engine.agenerate(r) for r in reqs))

    noise = threading.Thread(target=other_work)
    noise.start()
    try:
        for _ in range(3):
            outs = asyncio.run(together())
            assert [o.completions[0].token_ids for o in outs] == alone
    finally:
        stop.set()
        noise.join()


def test_every_end_of_turn_id_stops_generation(tokenizer):
    import copy

    from posttrain.engine.stops import end_of_turn_ids

    model = copy.deepcopy(tiny("llama"))
    prompt = random_prompts([9], seed=44)[0]
    free = PagedEngine(model, tokenizer, block_size=4, num_blocks=64).generate(
        [GenerationRequest(prompt, GREEDY)]
    )
    toks = free[0].completions[0].token_ids
    assert len(toks) == 12 and toks[0] != tokenizer.eos_token_id
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, toks[0]]  # generation_config.json's list
    params = SamplingParams(temperature=0.0, max_tokens=12)
    for engine in (PagedEngine(model, tokenizer, block_size=4, num_blocks=64), HFEngine(model, tokenizer)):
        c = engine.generate([GenerationRequest(prompt, params)])[0].completions[0]
        assert c.token_ids == toks[:1] and c.finish_reason == "stop", type(engine).__name__
    # the chat template's end-of-turn marker counts even when the tokenizer's eos is another token
    other = copy.deepcopy(tokenizer)
    other.eos_token = "<|endoftext|>"
    bare = copy.deepcopy(model)
    bare.config.eos_token_id, bare.generation_config.eos_token_id = None, None
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_ids(bare, other) == sorted({other.eos_token_id, im_end})
