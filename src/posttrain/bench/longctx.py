"""`posttrain bench longctx`: peak memory and time of one training step and of one prefill against the
sequence length, with the memory features on and off, each in its own process.

Training step: `Learner.step` on one sequence of L tokens (the second half generated). Features on:
gradient checkpointing, logprobs by chunks of 1024 positions, and no `[L, L]` attention mask (a lone
sequence keeps the padded layout). Off: no checkpointing, the LM head over all L positions at once, and
the packed layout's 4-D mask (what the Learner did before). Prefill: the paged engine over an L-token
prompt, one token generated; on: chunked prefill (2048 tokens a step); off: the whole prompt in one step.
Peak memory is the process's peak RSS (`ru_maxrss`), loaded model included; `*_over_load_bytes`
subtracts the RSS once the model is loaded. Lengths above `--baseline-max-tokens` run with the features
only (the baseline's L x L tensors would not fit). `fits_32k` is whether a 32k training step finished
under the machine's memory, false when it went over or ran out of memory, null when 32k was not run or
failed otherwise (a timeout, a kill, a crash). Ring attention (`--ring-tokens N`): the bytes one
rank keeps for backward and the seconds of forward + backward of causal attention over N tokens with the
embedded model's heads, in 1 (plain attention), 2 and 4 gloo processes. `prefill_flops_per_token` is
the oracle for the prefill times: the floating-point operations per prompt token of an exact causal
prefill of L tokens (the decoder's matmuls plus QK and PV over the L(L+1)/2 causal pairs), from the
model's config; `prefill_flop_ratio_32k_over_4k` is what any exact-attention prefill running at one
FLOP rate would show as `prefill_per_token_32k_over_4k`.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

from posttrain.bench import BenchUsageError

MACHINE_BYTES = 24 * 2**30
RING_HEADS, RING_HEAD_DIM = 9, 64  # the embedded model's attention


def parse_lengths(text: str) -> list[int]:
    """'1k,4k,16384' -> [1024, 4096, 16384]."""
    from posttrain.envs.domains.longctx_common import parse_lengths as parse

    try:
        return parse(text)
    except ValueError as err:
        raise BenchUsageError(str(err)) from None


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def prefill_flops_per_token(config: Any, length: int) -> float:
    """FLOPs per token of an exact causal prefill of `length` tokens: 2 x the decoder's matmul weights
    (q, k, v, o, gate, up, down of every layer; the LM head runs on the last token only, 1/length of
    it) plus 4 x layers x heads x head_dim per causal (query, key) pair (QK and PV), averaged."""
    h, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or h // heads
    per_layer = h * heads * hd * 2 + h * kv * hd * 2 + 3 * h * config.intermediate_size
    linear = 2 * layers * per_layer + 2 * h * config.vocab_size / length
    attention = 4 * layers * heads * hd * (length + 1) / 2
    return float(linear + attention)


def child(kind: str, length: int, features: bool, model: str) -> dict[str, Any]:
    """One measurement, in this process (the bench runs it in a fresh one)."""
    import torch

    torch.manual_seed(0)
    ids = torch.randint(100, 40000, (length,)).tolist()
    if kind == "train":
        from posttrain.config import AlgorithmConfig, BatchConfig, ModelConfig, TrainerConfig
        from posttrain.train import Learner, Sample

        trainer = TrainerConfig(
            lr=1e-6,
            gradient_checkpointing=features,
            logprob_chunk_tokens=1024 if features else length,
            share_prompt_prefix=False,
        )
        learner = Learner(
            ModelConfig(spec=model),
            trainer,
            AlgorithmConfig(),
            batch_cfg=BatchConfig(micro_batch_tokens=length),
        )
        half = length // 2
        sample = Sample(
            ids, [0] * half + [1] * (length - half), [0.0] * half + [-10.0] * (length - half), 1.0, 0
        )
        if not features:  # the 4-D mask of the packed layout, as before a lone sequence kept the padded one
            from posttrain.train import batch as batch_mod

            plain = batch_mod.make_inputs

            def packed_mask(token_ids, lengths, packed, pad_id=0):
                inputs = plain(token_ids, lengths, packed, pad_id)
                if inputs.attention_mask.dim() == 2:
                    n = inputs.attention_mask.shape[1]
                    causal = torch.ones(n, n, dtype=torch.bool).tril()
                    inputs.attention_mask = (causal[None] & inputs.attention_mask.bool()[:, None, :])[:, None]
                return inputs

            batch_mod.make_inputs = packed_mask
            import posttrain.train.learner as learner_mod

            learner_mod.make_inputs = packed_mask
        loaded = _rss_bytes()
        t0 = time.perf_counter()
        learner.step([sample])
        seconds = time.perf_counter() - t0
    else:
        from posttrain.engine import GenerationRequest, PagedEngine, SamplingParams
        from posttrain.models import load_policy, load_tokenizer

        tok = load_tokenizer(model)
        engine = PagedEngine(
            load_policy(model),
            tok,
            block_size=16,
            num_blocks=length // 16 + 8,
            max_model_len=length + 16,
            max_num_batched_tokens=2048 if features else length,
        )
        loaded = _rss_bytes()
        t0 = time.perf_counter()
        engine.generate([GenerationRequest(ids, SamplingParams(temperature=0.0, max_tokens=1))])
        seconds = time.perf_counter() - t0
    peak = _peak_bytes()
    return {"seconds": seconds, "peak_bytes": peak, "over_load_bytes": peak - loaded}


def saved_bytes_and_seconds(forward: Any) -> tuple[int, float]:
    """Bytes autograd keeps for backward while `forward()` runs, and seconds of it plus the backward of
    its sum."""
    import torch

    saved = 0

    def pack(t: Any) -> Any:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    out.sum().backward()
    return saved, time.perf_counter() - t0


def _ring_worker(rank: int, world: int, init: str, length: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from posttrain.longctx.ring import ring_attention, shard

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)
    q = torch.randn(1, RING_HEADS, length, RING_HEAD_DIM, generator=torch.Generator().manual_seed(0))
    local = [shard(q, 2, world, rank).requires_grad_() for _ in range(3)]
    saved, seconds = saved_bytes_and_seconds(lambda: ring_attention(*local, length=length, causal=True))
    with open(f"{out_dir}/ring{rank}.json", "w") as fh:
        json.dump({"saved_bytes": saved, "seconds": seconds}, fh)
    dist.destroy_process_group()


def ring_memory(length: int, worlds: list[int]) -> dict[str, Any]:
    """Bytes one rank keeps for backward (the largest over ranks) and seconds of forward + backward of
    causal ring attention over `length` tokens, per number of gloo processes; world 1 is plain attention
    (the softmax kept for backward, as the math kernel does)."""
    import tempfile

    import torch
    import torch.multiprocessing as mp

    out: dict[str, Any] = {"saved_bytes_per_rank": {}, "seconds": {}}
    q = torch.randn(1, RING_HEADS, length, RING_HEAD_DIM).requires_grad_()
    mask = torch.ones(length, length, dtype=torch.bool).tril()

    def plain() -> Any:
        scores = (q @ q.transpose(-1, -2)) / RING_HEAD_DIM**0.5
        return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ q

    out["saved_bytes_per_rank"]["1"], out["seconds"]["1"] = saved_bytes_and_seconds(plain)
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(
                _ring_worker,
                args=(world, f"file://{tmp}/rdv", length, tmp),
                nprocs=world,
                start_method="fork",
            )
            ranks = [json.loads(open(f"{tmp}/ring{r}.json").read()) for r in range(world)]
        out["saved_bytes_per_rank"][str(world)] = max(r["saved_bytes"] for r in ranks)
        out["seconds"][str(world)] = max(r["seconds"] for r in ranks)
    return out


def _measure(kind: str, length: int, features: bool, model: str, timeout_s: float) -> dict[str, Any] | None:
    code = (
        "import json, sys; from posttrain.bench.longctx import child; "
        f"print(json.dumps(child({kind!r}, {length}, {features}, {model!r})))"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        oom = out.returncode == -9 or "MemoryError" in out.stderr or "out of memory" in out.stderr
        return {"error": f"exit {out.returncode}: {last[:200]}", "out_of_memory": oom}
    return json.loads(out.stdout.strip().splitlines()[-1])


def fits(run: dict[str, Any] | None, machine_bytes: int = MACHINE_BYTES) -> bool | None:
    """Whether a measured training step fitted the machine: True when it finished under `machine_bytes`,
    False when it went over or died out of memory (MemoryError, or SIGKILL: the OOM killer's signal),
    None when it was not run or failed otherwise (timed out, killed, crashed): not known."""
    if run is None:
        return None
    if "error" in run:
        return False if run.get("out_of_memory") else None
    return bool(run["peak_bytes"] < machine_bytes)


def main(opts: Any) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    lengths = parse_lengths(opts.lengths)
    if opts.baseline_max_tokens < 0:
        raise BenchUsageError("--baseline-max-tokens must be >= 0")
    ring = ring_memory(opts.ring_tokens, [2, 4]) if opts.ring_tokens else None
    rows: dict[str, dict[int, Any]] = {}
    for kind in ("train", "prefill"):
        for features in (True, False):
            key = f"{kind}_{'features' if features else 'baseline'}"
            rows[key] = {}
            for n in lengths:
                if not features and n > opts.baseline_max_tokens:
                    continue
                rows[key][n] = _measure(kind, n, features, opts.model, opts.timeout_s)

    def figure(key: str, field: str) -> dict[str, Any]:
        return {str(n): (r.get(field) if r else None) for n, r in rows[key].items()}

    result: dict[str, Any] = {
        "model": opts.model,
        "lengths": lengths,
        "peak_train_bytes": figure("train_features", "peak_bytes"),
        "peak_train_bytes_baseline": figure("train_baseline", "peak_bytes"),
        "train_over_load_bytes": figure("train_features", "over_load_bytes"),
        "train_over_load_bytes_baseline": figure("train_baseline", "over_load_bytes"),
        "train_s": figure("train_features", "seconds"),
        "train_s_baseline": figure("train_baseline", "seconds"),
        "prefill_s": figure("prefill_features", "seconds"),
        "prefill_s_baseline": figure("prefill_baseline", "seconds"),
        "peak_prefill_bytes": figure("prefill_features", "peak_bytes"),
        "peak_prefill_bytes_baseline": figure("prefill_baseline", "peak_bytes"),
        "errors": {
            f"{k}@{n}": r["error"] for k, per in rows.items() for n, r in per.items() if r and "error" in r
        },
        "load_avg_1m": os.getloadavg()[0],
    }
    if ring is not None:
        result["ring_tokens"] = opts.ring_tokens
        result["ring_saved_bytes_per_rank"] = ring["saved_bytes_per_rank"]
        result["ring_s"] = ring["seconds"]
    for key in ("train_over_load_bytes", "train_s", "prefill_s"):
        base, mine = result[f"{key}_baseline"], result[key]
        result[f"{key}_baseline_ratio"] = {n: base[n] / mine[n] for n in base if base.get(n) and mine.get(n)}
    per_token = {n: s / int(n) for n, s in result["prefill_s"].items() if s}
    if "32768" in per_token and "4096" in per_token:
        result["prefill_per_token_32k_over_4k"] = per_token["32768"] / per_token["4096"]
    try:
        from posttrain.models import load_policy

        config = load_policy(opts.model).config  # after every child: the parent's memory is not measured
    except Exception as err:  # a model whose config cannot be read still gets its measurements
        result["errors"]["prefill_flops"] = f"{type(err).__name__}: {err}"[:200]
    else:
        flops = {str(n): prefill_flops_per_token(config, n) for n in lengths}
        result["prefill_flops_per_token"] = flops
        if "32768" in flops and "4096" in flops:
            result["prefill_flop_ratio_32k_over_4k"] = flops["32768"] / flops["4096"]
    result["fits_32k"] = fits(rows["train_features"].get(32768))

    table = Table(title=f"long context: {opts.model} (load {result['load_avg_1m']:.1f})")
    for col in ("tokens", "train peak GB", "baseline", "train s", "baseline", "prefill s", "baseline"):
        table.add_column(col)

    def cell(v: Any, scale: float = 1.0) -> str:
        return "-" if v is None else f"{v / scale:.2f}"

    for n in map(str, lengths):
        table.add_row(
            n,
            cell(result["peak_train_bytes"].get(n), 2**30),
            cell(result["peak_train_bytes_baseline"].get(n), 2**30),
            cell(result["train_s"].get(n)),
            cell(result["train_s_baseline"].get(n)),
            cell(result["prefill_s"].get(n)),
            cell(result["prefill_s_baseline"].get(n)),
        )
    Console().print(table)
    for where, why in result["errors"].items():
        Console().print(f"{where}: {why}")
    return result
