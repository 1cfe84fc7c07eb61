"""`posttrain bench engine`: generated tok/s of the paged engine vs HF `generate`, in one run.

The baseline is `model.generate` as a user would call it (`HFGenerate`): one left-padded batch per
workload, HF's own sampling, and the sampled tokens' logprobs (which RL needs, and which ours returns)
from one vectorised log-softmax per sequence over the logits HF returns — not the per-token Python
loop and per-row samplers that the `hf` backend (`HFEngine`) runs for its seeding and stop handling.

Workloads (random-token prompts, temperature 1, EOS ignored so both engines generate the same
number of tokens): rollout (8 prompts of 50-500 tokens x 4 samples, 128 new), serving (32 distinct
prompts of 50-500 tokens, 64 new), decode-only (1 and 64 sequences, 8-token prompts, 128 new),
each in float32 and bfloat16. The machine's matmul GFLOP/s is measured in the same run to give the
fraction of the compute roofline (2 x parameters FLOPs per token); its memory read bandwidth too, for
batch-1 decode, which must read every weight once per token (the bandwidth roofline is bandwidth /
weight bytes, for ours and for HF). Decode rows also report the decode phase alone (tokens after each
request's first, over the time after the last first token), since the generated tok/s includes the
prompts' prefill. Medians over --repeats. With --weight-quants (e.g. none,int8,int4) each dtype also runs
the engine on quantized weights (`engine.weight_quant`; HF is not rerun): its rows report the ratio to the
same dtype's unquantized engine, its bandwidth roofline counts the quantized weight bytes, and the greedy
agreement with the unquantized engine on 32 fixed text prompts x 64 tokens is measured.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.engine.model_runner import onednn_packing_works
from posttrain.engine.paged import PagedEngine
from posttrain.engine.types import Completion, GenerationOutput, GenerationRequest, SamplingParams


class HFGenerate:
    """HF `generate` as a baseline for the bench's workloads: the requests share their sampling params but
    for the seed (HF draws for the whole batch from the global generator, seeded once per batch), sample
    at a temperature with top_p = 1 and top_k = 0, and ignore EOS, so every row has max_tokens tokens."""

    def __init__(self, model: Any, tokenizer: Any, max_batch_size: int = 64) -> None:
        self.model, self.tokenizer, self.max_batch_size = model, tokenizer, max_batch_size
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad)

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationOutput]:
        p = requests[0].params
        if any(dataclasses.replace(r.params, seed=p.seed) != p for r in requests) or not p.ignore_eos:
            raise ValueError(
                "HFGenerate takes requests that share their sampling params (but the seed) and ignore EOS"
            )
        if p.seed is not None:
            torch.manual_seed(p.seed)
        per_call = max(1, self.max_batch_size // p.n)
        out: list[GenerationOutput] = []
        for k in range(0, len(requests), per_call):
            out += self._batch(requests[k : k + per_call], p)
        return out

    @torch.inference_mode()
    def _batch(self, reqs: list[GenerationRequest], p: SamplingParams) -> list[GenerationOutput]:
        t0 = time.perf_counter()
        width = max(len(r.prompt_token_ids) for r in reqs)
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(reqs):
            ids[i, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids) :] = 1
        eos = [self.model.config.vocab_size]  # an id never sampled: no stop
        sampling = (
            dict(do_sample=True, temperature=p.temperature, top_p=1.0, top_k=0)
            if p.temperature > 0
            else (dict(do_sample=False, temperature=None, top_p=None, top_k=None))
        )
        gen = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=p.max_tokens,
            num_return_sequences=p.n,
            return_dict_in_generate=True,
            output_logits=True,
            pad_token_id=self.pad_id,
            eos_token_id=eos,
            **sampling,
        )
        ttft = time.perf_counter() - t0
        new = gen.sequences[:, width:]
        logits = torch.stack(gen.logits, dim=1)  # (rows, new tokens, vocab)
        results = []
        for i, r in enumerate(reqs):
            comps = []
            for j in range(p.n):
                row = i * p.n + j
                scaled = logits[row].float() / (p.temperature if p.temperature > 0 else 1.0)
                lps = torch.log_softmax(scaled, -1).gather(-1, new[row].unsqueeze(-1)).squeeze(-1)
                comps.append(Completion(new[row].tolist(), lps.tolist(), "", "length"))
            results.append(GenerationOutput(f"hf-{i}", list(r.prompt_token_ids), comps, ttft))
        return results


@dataclass
class Workload:
    name: str
    prompt_lengths: list[int]
    n: int
    max_tokens: int


def workloads(quick: bool, seed: int) -> list[Workload]:
    g = torch.Generator().manual_seed(seed)

    def lengths(k: int) -> list[int]:
        return torch.randint(50, 501, (k,), generator=g).tolist()

    if quick:
        return [
            Workload("rollout", lengths(4), 4, 32),
            Workload("serving", lengths(8), 1, 16),
            Workload("decode_1", [8], 1, 32),
            Workload("decode_64", [8] * 64, 1, 16),
        ]
    return [
        Workload("rollout", lengths(8), 4, 128),
        Workload("serving", lengths(32), 1, 64),
        Workload("decode_1", [8], 1, 128),
        Workload("decode_64", [8] * 64, 1, 128),
    ]


def requests_for(w: Workload, seed: int) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(seed + 1)
    reqs = []
    for i, n in enumerate(w.prompt_lengths):
        prompt = torch.randint(3, 49152, (n,), generator=g).tolist()
        params = SamplingParams(
            temperature=1.0, max_tokens=w.max_tokens, n=w.n, seed=seed + i, ignore_eos=True
        )
        reqs.append(GenerationRequest(prompt, params))
    return reqs


def matmul_gflops(dtype: torch.dtype, size: int = 1024, seconds: float = 1.0) -> float:
    """Best sustained GFLOP/s of a square matmul on this machine, now: the faster of torch.mm and the
    pre-packed oneDNN GEMM the engine uses on CPU (where it runs), so the roofline is the machine's best."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    kernels = [lambda: torch.mm(a, b)]
    if onednn_packing_works(torch.device("cpu"), dtype):
        packed = torch.ops.mkldnn._reorder_linear_weight(b, size)
        kernels.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    best = 0.0
    for kernel in kernels:
        kernel()
        end = time.perf_counter() + seconds / len(kernels)
        while time.perf_counter() < end:
            t = time.perf_counter()
            for _ in range(4):
                kernel()
            best = max(best, 4 * 2 * size**3 / (time.perf_counter() - t) / 1e9)
    return best


def mem_read_gb_s(megabytes: int = 512, repeats: int = 7) -> float:
    """Memory read bandwidth now, in GB/s: the better of two streaming reads of a float32 buffer far larger
    than the caches (a sum, and a matrix-vector product like batch-1 decode's), each a median of `repeats`."""
    n = megabytes * 2**20 // 4
    x = torch.ones(n)
    w, vec = x.view(-1, 1024), torch.ones(1024)
    best = 0.0
    for read in (lambda: x.sum(), lambda: torch.mv(w, vec)):
        read()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            read()
            times.append(time.perf_counter() - t)
        best = max(best, 4 * n / statistics.median(times) / 1e9)
    return best


AGREEMENT_PROMPTS = [
    f"{stem} {topic}"
    for stem in (
        "Write a short paragraph about",
        "Explain to a child",
        "List three facts about",
        "Question: what is the most important thing to know about",
    )
    for topic in (
        "the water cycle.",
        "prime numbers.",
        "how a bicycle works.",
        "the history of Rome.",
        "sorting a list in Python.",
        "photosynthesis.",
        "the moon.",
        "compound interest.",
    )
]


def greedy_agreement(ref: Any, other: Any, tokenizer: Any, max_tokens: int = 64) -> dict[str, float]:
    """Greedy tokens of `other` vs `ref` on AGREEMENT_PROMPTS: the fraction generated before the first
    difference (what a user sees unchanged) and the fraction equal position by position."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    reqs = [GenerationRequest(tokenizer(p)["input_ids"], params) for p in AGREEMENT_PROMPTS]
    a = [o.completions[0].token_ids for o in ref.generate(reqs)]
    b = [o.completions[0].token_ids for o in other.generate(reqs)]
    total = sum(len(x) for x in a)
    prefix = sum(
        next((i for i, (s, t) in enumerate(zip(x, y, strict=True)) if s != t), len(x))
        for x, y in zip(a, b, strict=True)
    )
    same = sum(s == t for x, y in zip(a, b, strict=True) for s, t in zip(x, y, strict=True))
    return {"prefix": prefix / total, "positional": same / total}


def run_once(engine: Any, reqs: list[GenerationRequest]) -> dict:
    t = time.perf_counter()
    outs = engine.generate(reqs)
    wall = time.perf_counter() - t
    tokens = sum(len(c.token_ids) for o in outs for c in o.completions)
    completions = sum(len(o.completions) for o in outs)
    last_first_token_s = max(o.ttft_s for o in outs)
    decode_s = wall - last_first_token_s
    return {
        "tok_s": tokens / wall,
        "wall_s": wall,
        "tokens": tokens,
        "ttft_s": statistics.median(o.ttft_s for o in outs),
        # after every request's first token (prefills done): the decode phase alone
        "decode_tok_s": (tokens - completions) / decode_s if decode_s > 0 else 0.0,
    }


def main(opts: Any) -> dict:
    """Run the benchmark with the options of `posttrain bench engine` (see its --help)."""
    from rich.console import Console
    from rich.table import Table

    from posttrain.models import load_policy, load_tokenizer

    console = Console(stderr=True)
    tokenizer = load_tokenizer(opts.model)
    chosen = set(opts.workloads.split(","))
    result: dict[str, Any] = {
        "model": opts.model,
        "quick": opts.quick,
        "repeats": opts.repeats,
        "torch_threads": torch.get_num_threads(),
    }
    table = Table(title=f"engine benchmark ({opts.model}, medians of {opts.repeats})")
    for col in (
        "dtype",
        "weights",
        "workload",
        "paged tok/s",
        "HF tok/s",
        "ratio",
        "paged TTFT s",
        "HF latency s",
        "roofline",
    ):
        table.add_column(col)
    for dtype_name in opts.dtypes.split(","):
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
        sfx = "" if dtype_name == "float32" else "_bf16"
        gflops = matmul_gflops(dtype)
        result[f"matmul_gflops{sfx}"] = gflops
        model = load_policy(opts.model, dtype=dtype_name)
        params = sum(p.numel() for p in model.parameters())
        result["params"] = params
        roofline_tok_s = gflops * 1e9 / (2 * params)
        result[f"roofline_tok_s{sfx}"] = roofline_tok_s
        paged = PagedEngine(
            model,
            tokenizer,
            dtype=dtype_name,
            num_blocks=2048,
            max_num_seqs=64,
            max_num_batched_tokens=2048,
            max_model_len=2048,
            seed=opts.seed,
        )
        hf = HFGenerate(model, tokenizer, max_batch_size=64)
        warm = [GenerationRequest([5, 6, 7, 8], SamplingParams(max_tokens=4, ignore_eos=True))]
        if not opts.no_hf:
            hf.generate(warm)
        _run_dtype(opts, model, tokenizer, paged, hf, dtype_name, chosen, result, table, console)
        del paged, hf, model
    console.print(table)
    console.print(
        f"matmul GFLOP/s: fp32 {result.get('matmul_gflops', 0):.0f}, bf16 {result.get('matmul_gflops_bf16', 0):.0f}; "
        f"memory read GB/s: {result.get('mem_read_gb_s', result.get('mem_read_gb_s_bf16', 0)):.1f}; "
        "the machine is shared with other work, so figures are noisy"
    )
    return result


def _run_dtype(
    opts: Any,
    model: Any,
    tokenizer: Any,
    base: PagedEngine,
    hf: HFGenerate,
    dtype_name: str,
    chosen: set[str],
    result: dict[str, Any],
    table: Any,
    console: Any,
) -> None:
    """The chosen workloads on one dtype: the unquantized engine (vs HF), then each --weight-quants variant."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    dsfx = "" if dtype_name == "float32" else "_bf16"
    quants = [q for q in getattr(opts, "weight_quants", "none").split(",") if q]
    if "none" not in quants:
        quants = ["none", *quants]  # the baseline of the ratios
    params = result["params"]
    gflops = result[f"matmul_gflops{dsfx}"]
    warm = [GenerationRequest([5, 6, 7, 8], SamplingParams(max_tokens=4, ignore_eos=True))]
    for wq in quants:
        sfx = dsfx if wq == "none" else f"{dsfx}_{wq}"
        if wq == "none":
            paged = base
        else:
            paged = PagedEngine(
                model,
                tokenizer,
                dtype=dtype_name,
                weight_quant=wq,
                num_blocks=2048,
                max_num_seqs=64,
                max_num_batched_tokens=2048,
                max_model_len=2048,
                seed=opts.seed,
            )
            agree = greedy_agreement(base, paged, tokenizer)
            result[f"greedy_agree_prefix{sfx}"] = agree["prefix"]
            result[f"greedy_agree_positional{sfx}"] = agree["positional"]
            console.print(
                f"  {dtype_name} {wq} vs {dtype_name}: greedy agreement {agree['prefix']:.1%} before the first "
                f"difference, {agree['positional']:.1%} position by position (32 prompts x 64 tokens)"
            )
        paged.generate(warm)
        run_hf = wq == "none" and not opts.no_hf
        for w in workloads(opts.quick, opts.seed):
            if w.name not in chosen:
                continue
            reqs = requests_for(w, opts.seed)
            ours, theirs = [], []
            for _ in range(opts.repeats):
                paged.reset_stats()
                ours.append(run_once(paged, reqs))
                if run_hf:
                    theirs.append(run_once(hf, reqs))
            med = {
                k: statistics.median(r[k] for r in ours)
                for k in ("tok_s", "ttft_s", "wall_s", "decode_tok_s")
            }
            key = {"decode_1": "1", "decode_64": "64"}.get(w.name, w.name)
            result[f"paged_tok_s_{key}{sfx}"] = med["tok_s"]
            result[f"paged_ttft_s_{key}{sfx}"] = med["ttft_s"]
            row = [dtype_name, wq, w.name, f"{med['tok_s']:.1f}"]
            if wq != "none" and f"paged_tok_s_{key}{dsfx}" in result:
                ratio = med["tok_s"] / result[f"paged_tok_s_{key}{dsfx}"]
                result[f"ratio_vs_unquantized_{key}{sfx}"] = ratio
                row += ["-", f"{ratio:.2f}x vs {dtype_name}", f"{med['ttft_s']:.2f}", "-"]
            elif theirs:
                hf_tok_s = statistics.median(r["tok_s"] for r in theirs)
                hf_wall = statistics.median(r["wall_s"] for r in theirs)
                result[f"hf_tok_s_{key}{sfx}"] = hf_tok_s
                result[f"hf_latency_s_{key}{sfx}"] = hf_wall
                result[f"ratio_vs_hf_{key}{sfx}"] = med["tok_s"] / hf_tok_s
                row += [
                    f"{hf_tok_s:.1f}",
                    f"{med['tok_s'] / hf_tok_s:.2f}x",
                    f"{med['ttft_s']:.2f}",
                    f"{hf_wall:.2f}",
                ]
            else:
                row += ["-", "-", f"{med['ttft_s']:.2f}", "-"]
            if w.name == "decode_1":
                # batch 1 reads every weight once per token: its roofline is memory bandwidth / weight bytes
                bw = mem_read_gb_s()
                weight_bytes = (
                    sum(p.numel() * p.element_size() for p in model.parameters())
                    if wq == "none"
                    else paged.runner.weight_bytes()  # the GEMM weights a token reads, quantized
                )
                bw_tok_s = bw * 1e9 / weight_bytes
                result[f"mem_read_gb_s{sfx}"] = bw
                result[f"weight_bytes{sfx}"] = weight_bytes
                result[f"bw_roofline_tok_s_1{sfx}"] = bw_tok_s
                result[f"bw_roofline_frac_1{sfx}"] = med["tok_s"] / bw_tok_s
                if theirs:
                    result[f"hf_bw_roofline_frac_1{sfx}"] = result[f"hf_tok_s_1{sfx}"] / bw_tok_s
            if w.name.startswith("decode"):
                # re-measure the matmul rate next to the decode run (the machine's load changes)
                gflops = max(gflops, matmul_gflops(dtype))
                result[f"matmul_gflops{sfx}"] = gflops
                roofline_tok_s = gflops * 1e9 / (2 * params)
                result[f"roofline_tok_s{sfx}"] = roofline_tok_s
                frac = med["tok_s"] / roofline_tok_s
                result[f"roofline_frac_{key}{sfx}"] = frac
                # generated tok/s above includes the prompts' prefill in the wall time; this is decode alone
                result[f"paged_decode_tok_s_{key}{sfx}"] = med["decode_tok_s"]
                result[f"roofline_frac_decode_{key}{sfx}"] = med["decode_tok_s"] / roofline_tok_s
                if w.name == "decode_1":
                    hf_part = (
                        f", HF {result[f'hf_bw_roofline_frac_1{sfx}']:.0%}"
                        if f"hf_bw_roofline_frac_1{sfx}" in result
                        else ""
                    )
                    row.append(f"{result[f'bw_roofline_frac_1{sfx}']:.0%} of bandwidth{hf_part}")
                else:
                    row.append(f"{frac:.0%}")
            else:
                row.append("")
            if w.name == "serving":
                stats = paged.kv_stats()
                result[f"kv_waste_frac{sfx}"] = stats["peak_waste_frac"]
            if w.name == "rollout":
                stats = paged.kv_stats()
                result[f"rollout_peak_blocks{sfx}"] = stats["peak_blocks_allocated"]
                result[f"rollout_fork_shared_blocks{sfx}"] = stats["fork_shared_blocks"]
            table.add_row(*row)
            console.print(
                f"  {dtype_name} {wq} {w.name}: paged {med['tok_s']:.1f} tok/s"
                + (f", HF {result[f'hf_tok_s_{key}{sfx}']:.1f} tok/s" if theirs else "")
            )
        if paged is not base:
            del paged
