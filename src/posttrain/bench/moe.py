"""`posttrain bench moe`: decode tok/s of the upcycled MoE against dense models at equal active and at
equal total parameters, on the paged engine, in one run.

Models: the MoE is `--model` upcycled in process (`--experts` copies of its MLP, top `--top-k`); the
dense baselines share its attention, embeddings and depth with an MLP `top_k` times as wide (the MoE's
active parameters per token) and `experts` times as wide (its total parameters), random weights (speed
does not depend on their values); the original dense model is reported too. Workloads: decode of
`--batch` sizes, 8-token random prompts, `--new-tokens` tokens each, EOS ignored; figures are the
decode phase's tok/s (tokens after each request's first over the time after the last first token),
medians over `--repeats` repeats (each builds every model in turn, one in memory at a time), per
`--dtypes` and `--weight-quants`. Ratios are the MoE's tok/s over each baseline's medians.

Routing replay (`--replay-samples N`, 0 to skip): the upcycled MoE samples N completions (8 arithmetic
chat prompts, N / 8 samples each, temperature 1, `--replay-tokens` tokens) on the engine in bfloat16, and
the Learner in float32 scores them twice, routing freely and replaying the engine's routing: the
fraction of (token, layer) top-k sets that differ (`routing_mismatch`) and the behaviour-vs-learner
log-ratio spread on the sampled tokens (mean and max |log ratio|, KL k3), for both, on the same samples.
At `--expert-noise 0` every expert is the same copy, so which ones run does not change the output and
replay cannot move the log ratios; `--expert-noise` > 0 perturbs the replay MoE's copies (relative to
each weight's std, as `posttrain models upcycle --expert-noise`) so the experts differ, as after training.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from posttrain.bench import BenchUsageError
from posttrain.bench.engine import run_once
from posttrain.engine.paged import PagedEngine
from posttrain.engine.quant import WEIGHT_QUANTS
from posttrain.engine.types import GenerationRequest, SamplingParams


def _csv(text: str, allowed: tuple[str, ...], name: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if not items or bad:
        raise BenchUsageError(f"--{name} takes a comma list of {', '.join(allowed)}; got {text!r}")
    return items


def _ints(text: str, name: str) -> list[int]:
    try:
        items = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        items = []
    if not items or any(x < 1 for x in items):
        raise BenchUsageError(f"--{name} takes a comma list of positive integers; got {text!r}")
    return items


def widened(dense: Any, factor: int) -> Any:
    """A dense model like `dense` with an MLP `factor` times as wide (random weights)."""
    from transformers import AutoModelForCausalLM

    from posttrain.models.loading import quiet_transformers

    config = type(dense.config).from_dict(dense.config.to_dict())
    config.intermediate_size = dense.config.intermediate_size * factor
    with quiet_transformers(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def replay_figures(moe: Any, tok: Any, spec: str, samples: int, max_tokens: int, seed: int) -> dict[str, Any]:
    """Routing mismatch and importance-ratio spread of the float32 Learner against the bfloat16 engine's
    samples of `moe`, with free and with replayed routing (see the module docstring)."""
    from posttrain.algos.importance import mismatch_metrics
    from posttrain.config import AlgorithmConfig, ModelConfig, MoeTrainConfig, TrainerConfig
    from posttrain.models import encode_messages
    from posttrain.train import Learner, Sample, build_batch

    g = torch.Generator().manual_seed(seed)
    per = max(1, samples // 8)
    pairs = torch.randint(10, 99, (8, 2), generator=g).tolist()
    prompts = [
        encode_messages(tok, [{"role": "user", "content": f"What is {a} + {b}? Answer with the number."}])
        for a, b in pairs
    ]
    engine = PagedEngine(moe, tok, dtype="bfloat16", num_blocks=8 * per * (-(-(64 + max_tokens) // 16)) + 64)
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, n=per, seed=seed)
    outs = engine.generate([GenerationRequest(p, params) for p in prompts])
    del engine
    data = []
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        for c in out.completions:
            mask = [0] * len(p) + [1] * len(c.token_ids)
            data.append(Sample(p + c.token_ids, mask, [0.0] * len(p) + c.logprobs, 0.0, i, routing=c.routing))
    batch = build_batch(data)
    out: dict[str, Any] = {"samples": len(data), "tokens": int(batch.loss_mask.sum())}
    for name, replay in (("free", False), ("replay", True)):
        learner = Learner(
            ModelConfig(spec=spec),
            TrainerConfig(bf16_autocast=False, moe=MoeTrainConfig(routing_replay=replay)),
            AlgorithmConfig(),
            model=moe,
        )
        lp = learner.compute_logprobs(data)
        assert learner.moe is not None
        routing = learner.moe.pop_metrics()
        spread = mismatch_metrics(lp, batch.behavior_logprobs, batch.loss_mask, None, None)
        out[name] = {"routing_mismatch": routing["moe/routing_mismatch"], **spread}
        del learner
    return out


def main(opts: Any) -> dict:
    """Run the benchmark with the options of `posttrain bench moe` (see its --help)."""
    from rich.console import Console
    from rich.table import Table

    from posttrain.models import load_policy, load_tokenizer
    from posttrain.models.upcycle import upcycle

    dtypes = _csv(opts.dtypes, ("float32", "bfloat16"), "dtypes")
    quants = _csv(opts.weight_quants, WEIGHT_QUANTS, "weight-quants")
    batches = _ints(opts.batch, "batch")
    if opts.new_tokens < 2 or opts.repeats < 1 or opts.replay_samples < 0 or opts.replay_tokens < 1:
        raise BenchUsageError(
            "--new-tokens must be >= 2, --repeats >= 1, --replay-samples >= 0 and --replay-tokens >= 1"
        )
    if opts.expert_noise < 0:
        raise BenchUsageError(f"--expert-noise must be >= 0, got {opts.expert_noise}")
    try:
        dense = load_policy(opts.model)
        tok = load_tokenizer(opts.model)
        moe = upcycle(dense, opts.experts, opts.top_k)
    except ValueError as err:
        raise BenchUsageError(str(err)) from None
    moe_cfg = moe.config
    per_expert = 3 * moe_cfg.hidden_size * dense.config.intermediate_size * moe_cfg.num_hidden_layers
    builders = {
        "moe": lambda: upcycle(dense, opts.experts, opts.top_k),
        "dense_equal_active": lambda: widened(dense, opts.top_k),
        "dense_equal_total": lambda: widened(dense, opts.experts),
        "dense_original": lambda: dense,
    }
    params = {"moe": _params(moe), "dense_original": _params(dense)}
    del moe
    g = torch.Generator().manual_seed(opts.seed)
    blocks = max(batches) * -(-(8 + opts.new_tokens) // 16) + 8  # the KV pool the largest batch needs
    sampling = SamplingParams(temperature=0.0, max_tokens=opts.new_tokens, ignore_eos=True)
    workloads = {b: [torch.randint(3, 49152, (8,), generator=g).tolist() for _ in range(b)] for b in batches}
    runs: dict[tuple[str, str, int, str], list[float]] = {}
    # one model's weights and engine at a time (the upcycled 135M is 1.5 GB in float32), rebuilt for every
    # repeat so the models' measurements interleave in time
    for _ in range(opts.repeats):
        for name, build in builders.items():
            model = build()
            params.setdefault(name, _params(model))
            for dtype in dtypes:
                for quant in quants:
                    engine = PagedEngine(
                        model,
                        tok,
                        dtype=dtype,
                        weight_quant=quant,
                        num_blocks=blocks,
                        max_num_seqs=max(batches),
                    )
                    engine.generate([GenerationRequest(workloads[batches[0]][0], sampling)])  # warm-up
                    for b in batches:
                        reqs = [GenerationRequest(p, sampling) for p in workloads[b]]
                        runs.setdefault((dtype, quant, b, name), []).append(
                            run_once(engine, reqs)["decode_tok_s"]
                        )
                    del engine
            del model
    active = params["moe"] - (opts.experts - opts.top_k) * per_expert
    rows: list[dict[str, Any]] = []
    for dtype in dtypes:
        for quant in quants:
            for b in batches:
                tok_s = {name: statistics.median(runs[(dtype, quant, b, name)]) for name in builders}
                rows.append(
                    {
                        "dtype": dtype,
                        "weight_quant": quant,
                        "batch": b,
                        **{f"{name}_tok_s": v for name, v in tok_s.items()},
                        "moe_over_dense_equal_active": tok_s["moe"] / tok_s["dense_equal_active"],
                        "moe_over_dense_equal_total": tok_s["moe"] / tok_s["dense_equal_total"],
                        "moe_over_dense_original": tok_s["moe"] / tok_s["dense_original"],
                    }
                )
    table = Table(
        "dtype", "weights", "batch", "moe tok/s", "= active", "= total", "original", "/ active", "/ total"
    )
    for r in rows:
        table.add_row(
            r["dtype"],
            r["weight_quant"],
            str(r["batch"]),
            f"{r['moe_tok_s']:.1f}",
            f"{r['dense_equal_active_tok_s']:.1f}",
            f"{r['dense_equal_total_tok_s']:.1f}",
            f"{r['dense_original_tok_s']:.1f}",
            f"{r['moe_over_dense_equal_active']:.2f}",
            f"{r['moe_over_dense_equal_total']:.2f}",
        )
    console = Console()
    replay = None
    if opts.replay_samples > 0:
        replay = replay_figures(
            upcycle(dense, opts.experts, opts.top_k, expert_noise=opts.expert_noise, seed=opts.seed),
            tok,
            opts.model,
            opts.replay_samples,
            opts.replay_tokens,
            opts.seed,
        )
    console.print(
        f"MoE: {opts.model} upcycled, {opts.experts} experts, top {opts.top_k}: {params['moe'] / 1e6:.1f}M "
        f"parameters, {active / 1e6:.1f}M active; dense baselines {params['dense_equal_active'] / 1e6:.1f}M "
        f"(= active) and {params['dense_equal_total'] / 1e6:.1f}M (= total); decode tok/s, median of "
        f"{opts.repeats}"
    )
    console.print(table)
    if replay is not None:
        console.print(
            f"routing replay, {replay['samples']} samples ({replay['tokens']} tokens), bf16 engine vs fp32 "
            f"Learner, expert noise {opts.expert_noise}:"
        )
        for name in ("free", "replay"):
            r = replay[name]
            console.print(
                f"  {name:6s} routing mismatch {r['routing_mismatch']:.4f}, mean |log ratio| "
                f"{r['mismatch_abs_log_ratio']:.4f}, max {r['mismatch_max_abs_log_ratio']:.3f}, k3 {r['mismatch_kl_k3']:.5f}"
            )
    return {
        "model": opts.model,
        "experts": opts.experts,
        "top_k": opts.top_k,
        "new_tokens": opts.new_tokens,
        "repeats": opts.repeats,
        "params": {**params, "moe_active": active},
        "rows": rows,
        "replay": replay,
        "expert_noise": opts.expert_noise,
    }
