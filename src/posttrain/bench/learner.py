"""`posttrain bench learner`: tokens/s of `Learner.update` (the RL step) and of `Learner.sft_step` (the
supervised step, the same sequences with the same loss mask) on the embedded 135M model.

Variants: full vs LoRA, fp32 vs bf16 autocast, packed vs padded, on one batch (default 32 sequences of
up to 256 tokens, lengths uniform in [L/4, L]); with `--grpo G`, groups of G sequences sharing a prompt
and a third kind, `shared` (the prompt runs once per group). Tokens/s always counts every sequence's
tokens, so sharing shows as more tokens/s (and its roofline fraction is an effective one: it can
exceed what the positions actually computed would reach). The roofline is a square matmul's GFLOP/s measured in
the same run; training is counted as 6 x parameters FLOPs per token. Besides wall-clock tokens/s it
reports tokens per CPU-second of this process, the steadier figure on a shared machine. Does not
measure generation.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch

from posttrain.config import AlgorithmConfig, BatchConfig, ModelConfig, TrainerConfig
from posttrain.train.batch import Sample, build_batch
from posttrain.train.learner import Learner

TRL_REF_S_PER_STEP = 14.0  # TRL 1.16 GRPOTrainer, 8 completions x 48 tokens, this CPU (issue 5)


def matmul_gflops(dtype: torch.dtype, n: int = 1024, repeats: int = 5) -> float:
    """Median GFLOP/s of an n x n x n matmul in `dtype` (2 n^3 FLOPs each)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e9


def make_samples(
    n: int, max_len: int, vocab: int, fixed: bool, seed: int = 0, group: int = 0
) -> list[Sample]:
    """`n` sequences of up to `max_len` tokens, the first quarter of each a prompt. With `group` > 0
    they come in GRPO groups of that size whose members share one prompt (a quarter of the longest)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    if group > 0:
        for i in range(n):
            if i % group == 0:
                prompt_ids = torch.randint(0, vocab, (max(1, max_len // 4),), generator=g).tolist()
            gen = int(torch.randint(max(1, max_len // 8), max_len - len(prompt_ids) + 1, (1,), generator=g))
            ids = prompt_ids + torch.randint(0, vocab, (gen,), generator=g).tolist()
            out.append(
                Sample(ids, [0] * len(prompt_ids) + [1] * gen, [0.0] * len(ids), float(i % 2), i // group)
            )
        return out
    for i in range(n):
        length = max_len if fixed else int(torch.randint(max_len // 4, max_len + 1, (1,), generator=g))
        prompt = max(1, length // 4)
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        mask = [0] * prompt + [1] * (length - prompt)
        out.append(Sample(ids, mask, [0.0] * length, float(i % 2), i // 8))
    return out


def _fresh_learner(mcfg: ModelConfig, tcfg: TrainerConfig, base: Any, micro_batch_tokens: int) -> Learner:
    """A learner of one variant on a fresh copy of the same weights."""
    return Learner(
        mcfg,
        tcfg,
        AlgorithmConfig(tis_cap=None),
        model=copy.deepcopy(base),
        batch_cfg=BatchConfig(micro_batch_tokens=micro_batch_tokens),
    )


def _prepared_batch(learner: Learner, samples: list[Sample], old_logprobs: torch.Tensor) -> Any:
    batch = build_batch(samples, learner.device)
    batch.old_logprobs = old_logprobs
    g = torch.Generator().manual_seed(1)
    batch.advantages = torch.randn(batch.size, 1, generator=g).expand_as(batch.loss_mask) * batch.loss_mask
    return batch


def main(opts: Any) -> dict:
    """Run the benchmark with the options of `posttrain bench learner` (see its --help)."""
    from rich.console import Console
    from rich.table import Table

    from posttrain.models import load_policy

    if opts.threads:
        torch.set_num_threads(opts.threads)
    n = opts.seqs or (8 if opts.quick else 32)
    length = opts.seq_len or (128 if opts.quick else 256)

    console = Console(stderr=True)
    base = load_policy(opts.spec)
    vocab = base.config.vocab_size
    params = sum(p.numel() for p in base.parameters())
    samples = make_samples(n, length, vocab, opts.fixed_length, group=opts.grpo)
    tokens = sum(len(s.token_ids) for s in samples)
    gflops = {"fp32": matmul_gflops(torch.float32), "bf16": matmul_gflops(torch.bfloat16)}

    # old logprobs once (fp32, unchanged model): every variant starts at ratio 1 from the same weights
    probe = Learner(
        ModelConfig(spec=opts.spec), TrainerConfig(), AlgorithmConfig(tis_cap=None), model=copy.deepcopy(base)
    )
    old_lp = probe.compute_logprobs(build_batch(samples))
    del probe

    kinds = ("packed", "padded", "shared") if opts.grpo else ("packed", "padded")
    all_variants = [f"{m}-{d}-{k}" for m in ("full", "lora") for d in ("fp32", "bf16") for k in kinds]
    wanted = all_variants if opts.variants == "all" else opts.variants.split(",")
    unknown = [v for v in wanted if v not in all_variants]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(all_variants)}")

    # variants run round-robin, one update each per round, so a shared machine's load drifts over all
    # of them alike; each run starts from a fresh copy of the same weights; medians are reported
    times: dict[str, list[float]] = {name: [] for name in wanted}
    cpu_times: dict[str, list[float]] = {name: [] for name in wanted}
    sft_times: dict[str, list[float]] = {name: [] for name in wanted if not name.endswith("-shared")}
    pads: dict[str, float] = {}
    for rnd in range(opts.repeats):
        for name in wanted:
            mode, dtype, packing = name.split("-")
            mcfg = ModelConfig(spec=opts.spec, lora_rank=opts.lora_rank if mode == "lora" else 0)
            tcfg = TrainerConfig(
                lr=1e-6,
                bf16_autocast=dtype == "bf16",
                packing=packing == "packed",
                share_prompt_prefix=packing == "shared",
            )

            learner = _fresh_learner(mcfg, tcfg, base, opts.micro_batch_tokens)
            batch = _prepared_batch(learner, samples, old_lp)
            t0, c0 = time.perf_counter(), time.process_time()
            m = learner.update(batch)
            times[name].append(time.perf_counter() - t0)
            cpu_times[name].append(time.process_time() - c0)
            pads[name] = m["padding_frac"]
            console.print(f"round {rnd + 1}/{opts.repeats} {name}: {tokens / times[name][-1]:.1f} tok/s")
            del learner, batch
            if name in sft_times:  # the supervised step of the same variant, from the same weights
                learner = _fresh_learner(mcfg, tcfg, base, opts.micro_batch_tokens)
                t0 = time.perf_counter()
                learner.sft_step(samples)
                sft_times[name].append(time.perf_counter() - t0)
                console.print(
                    f"round {rnd + 1}/{opts.repeats} {name} sft: {tokens / sft_times[name][-1]:.1f} tok/s"
                )
                del learner
    results: dict[str, dict[str, float]] = {}
    for name in wanted:
        wall = statistics.median(times[name])
        tps = tokens / wall
        results[name] = {
            "tokens_per_s": tps,
            "update_s": wall,
            "update_s_min": min(times[name]),
            "update_s_max": max(times[name]),
            "padding_frac": pads[name],
            "tokens_per_cpu_s": tokens / statistics.median(cpu_times[name]),
            "roofline_frac": 6 * params * tps / (gflops[name.split("-")[1]] * 1e9),
        }
        if name in sft_times:
            results[name]["sft_tokens_per_s"] = tokens / statistics.median(sft_times[name])

    best = max(results, key=lambda k: results[k]["tokens_per_s"])
    table = Table(title=f"Learner.update, {opts.spec}, {n} seqs x <= {length} tokens ({tokens} tokens)")
    for col in (
        "variant",
        "tokens/s",
        "update s (median)",
        "min..max s",
        "tokens/CPU-s",
        "padding",
        "roofline",
        "SFT tokens/s",
    ):
        table.add_column(col)
    for name, r in results.items():
        table.add_row(
            name,
            f"{r['tokens_per_s']:.1f}",
            f"{r['update_s']:.2f}",
            f"{r['update_s_min']:.1f}..{r['update_s_max']:.1f}",
            f"{r['tokens_per_cpu_s']:.1f}",
            f"{r['padding_frac']:.1%}",
            f"{r['roofline_frac']:.1%}",
            f"{r['sft_tokens_per_s']:.1f}" if "sft_tokens_per_s" in r else "-",
        )
    console.print(table)
    console.print(
        f"matmul roofline: fp32 {gflops['fp32']:.1f} GFLOP/s, bf16 {gflops['bf16']:.1f} GFLOP/s; threads {torch.get_num_threads()}"
    )

    out: dict[str, Any] = {
        "best_tokens_per_s": results[best]["tokens_per_s"],
        "best_variant": best,
        "roofline_frac": results[best]["roofline_frac"],
        "matmul_gflops_fp32": gflops["fp32"],
        "matmul_gflops_bf16": gflops["bf16"],
        "params": params,
        "sequences": n,
        "max_seq_len": length,
        "tokens": tokens,
        "threads": torch.get_num_threads(),
        "repeats": opts.repeats,
    }
    for name, r in results.items():
        key = name.replace("-", "_")
        out[f"{key}_tokens_per_s"] = r["tokens_per_s"]
        out[f"{key}_roofline_frac"] = r["roofline_frac"]
        out[f"{key}_padding_frac"] = r["padding_frac"]
        out[f"{key}_tokens_per_cpu_s"] = r["tokens_per_cpu_s"]
        if "sft_tokens_per_s" in r:
            out[f"{key}_sft_tokens_per_s"] = r["sft_tokens_per_s"]
            out[f"{key}_sft_over_update"] = r["sft_tokens_per_s"] / r["tokens_per_s"]
    with_sft = [k for k in results if "sft_tokens_per_s" in results[k]]
    if with_sft:
        best_sft = max(with_sft, key=lambda k: results[k]["sft_tokens_per_s"])
        out["best_sft_tokens_per_s"] = results[best_sft]["sft_tokens_per_s"]
        out["best_sft_variant"] = best_sft
    for mode in ("full", "lora"):
        for dtype in ("fp32", "bf16"):
            pk, pd = f"{mode}-{dtype}-packed", f"{mode}-{dtype}-padded"
            if pk in results and pd in results:
                out[f"{mode}_{dtype}_packed_over_padded"] = (
                    results[pk]["tokens_per_s"] / results[pd]["tokens_per_s"]
                )
                out[f"{mode}_{dtype}_packed_over_padded_cpu"] = (
                    results[pk]["tokens_per_cpu_s"] / results[pd]["tokens_per_cpu_s"]
                )
            ps = f"{mode}-{dtype}-shared"
            if ps in results and pd in results:
                out[f"{mode}_{dtype}_shared_over_padded"] = (
                    results[ps]["tokens_per_s"] / results[pd]["tokens_per_s"]
                )
    # the update time of one TRL-shaped batch (8 x 48 generated tokens) against TRL's whole step (which
    # also generates): an upper bound on our update's share, not a like-for-like step comparison
    mode, dtype, packing = best.split("-")
    trl = make_samples(8, 64, vocab, fixed=True, seed=2)
    for s in trl:
        s.loss_mask = [0] * 16 + [1] * 48
    learner = Learner(
        ModelConfig(spec=opts.spec, lora_rank=opts.lora_rank if mode == "lora" else 0),
        TrainerConfig(
            lr=1e-6,
            bf16_autocast=dtype == "bf16",
            packing=packing == "packed",
            share_prompt_prefix=packing == "shared",
        ),
        AlgorithmConfig(tis_cap=None),
        model=copy.deepcopy(base),
    )
    t0 = time.perf_counter()
    learner.step(trl)
    out["trl_shape_step_s"] = time.perf_counter() - t0
    out["trl_ref_step_s"] = TRL_REF_S_PER_STEP
    console.print(
        f"learner.step on 8 x (16 + 48) tokens: {out['trl_shape_step_s']:.2f} s (TRL's whole GRPO step: {TRL_REF_S_PER_STEP} s)"
    )
    return out
