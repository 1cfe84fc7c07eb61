"""`posttrain bench rl`: per-step wall time of our RL loop against TRL's GRPOTrainer at equal settings
(the embedded 135M model, 8 completions of up to 48 new tokens per step, one prompt per step, math
tasks), both measured in this run, at the same precision (`--dtype`; TRL's bf16 is its CPU autocast).
With `--mode async` ours overlaps generation with the update and trains on trajectories up to
`--max-staleness` updates old, while TRL's GRPOTrainer is on-policy: that ratio is not like for like and
is reported under its own name (`ratio_async_vs_trl_onpolicy`, `like_for_like: false`). TRL's own async
trainer (AsyncGRPOTrainer) streams rollouts from a vLLM server over NCCL, so it cannot run on a CPU.
Also prints a hardware floor of our step from the bandwidth and matmul rate measured in the same run
(`step_floor_s`), so a target below what this machine can do shows as such. TRL is an optional benchmark dependency (`pip install trl`); when
it is missing a reference figure (about 14 s/step on this machine kind) is printed, marked as not
measured in this run, and no ratio is claimed.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

from rich.console import Console
from rich.table import Table

TRL_REFERENCE_S = 14.0  # TRL's step measured earlier on this machine kind


def _ours(
    steps: int,
    completions: int,
    new_tokens: int,
    dtype: str,
    seed: int,
    mode: str = "sync",
    staleness: int = 1,
    lag: str = "fixed",
    checkpoint_every: int = 0,
) -> list[dict[str, Any]]:
    from posttrain.config import load_config
    from posttrain.orchestrator.rl import RLRun
    from posttrain.telemetry import RunDir, read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            None,
            [
                f"seed={seed}",
                "model.spec=smollm2-135m",
                f"engine.dtype={dtype}",
                f"engine.max_new_tokens={new_tokens}",
                "envs.domains=[{name: math, difficulties: [0]}]",
                f"batch.samples_per_prompt={completions}",
                "batch.prompts_per_step=1",
                f"orchestrator.steps={steps}",
                f"orchestrator.checkpoint_every={checkpoint_every}",
                "curriculum.probe_every=0",
                "telemetry.progress=false",
                "telemetry.tensorboard=false",
                f"telemetry.run_dir={tmp}",
                f"trainer.bf16_autocast={dtype == 'bfloat16'}",
                f"orchestrator.mode={mode}",
                f"orchestrator.max_staleness={staleness}",
                f"orchestrator.async_lag={lag}",
            ],
        )
        run = RunDir.create(tmp, "bench")
        rl = RLRun(cfg, run, show_progress=False)
        try:
            rl.train()
        finally:
            rl.close()
        rows = read_metrics(run.metrics)
    return rows


def step_floor_s(
    rows: list[dict[str, Any]], params: int, dtype: str, bandwidth_gbs: float, matmul_gflops: float
) -> float:
    """A lower bound of our step on this machine: every decode step reads all weights once (the
    longest completion sets the number of decode steps), and the update costs 6 x params FLOPs per
    position it computes, at the measured matmul rate. Prefill, the optimizer and attention are left
    out, so the true floor is higher."""
    weight_bytes = params * (2 if dtype == "bfloat16" else 4)
    floors = []
    for r in rows:
        decode = r["rollout/max_response_tokens"] * weight_bytes / (bandwidth_gbs * 1e9)
        computed = r["train/update_tokens"] * (1.0 - r.get("train/shared_prefix_frac", 0.0))
        floors.append(decode + 6 * params * computed / (matmul_gflops * 1e9))
    return statistics.median(floors[1:] or floors)


def _trl(steps: int, completions: int, new_tokens: int, dtype: str, seed: int) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.envs import get_domain
    from posttrain.envs.domains.math import score_math
    from posttrain.models import ensure_embedded, load_tokenizer

    torch.manual_seed(seed)
    domain = get_domain("math")
    tasks = [domain.task("train", 0, i, seed=seed) for i in range(steps)]
    data = Dataset.from_list(
        [
            {"prompt": [{"role": m.role, "content": m.content} for m in t.prompt], "meta_index": i}
            for i, t in enumerate(tasks)
        ]
    )

    def reward(prompts: list, completions: list, meta_index: list, **_: Any) -> list[float]:
        out = []
        for c, i in zip(completions, meta_index, strict=True):
            text = c[0]["content"] if isinstance(c, list) else c
            out.append(score_math(text, tasks[i].meta)[0])
        return out

    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
            times.append(time.perf_counter() - self.t0)

    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=completions,
            num_generations=completions,
            max_completion_length=new_tokens,
            max_steps=steps,
            learning_rate=1e-6,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            bf16=dtype == "bfloat16",  # autocast on CPU, as ours
            seed=seed,
            temperature=1.0,
            beta=0.0,
            shuffle_dataset=False,
        )
        trainer = GRPOTrainer(
            model=str(ensure_embedded()),
            reward_funcs=reward,
            args=args,
            train_dataset=data,
            processing_class=load_tokenizer("smollm2-135m"),
            callbacks=[StepTimer()],
        )
        trainer.train()
    return times


def main(ns: Any) -> dict[str, Any]:
    """Run the benchmark with the options of `posttrain bench rl` (see its --help)."""
    console = Console()
    import torch

    from posttrain.bench.engine import mem_read_gb_s
    from posttrain.bench.learner import matmul_gflops
    from posttrain.models import load_policy

    rows = _ours(
        ns.steps,
        ns.completions,
        ns.new_tokens,
        ns.dtype,
        ns.seed,
        ns.mode,
        ns.max_staleness,
        ns.async_lag,
        ns.checkpoint_every,
    )
    ours = [r["timeline/step_s"] for r in rows]  # the final step's checkpoint is not in step_s
    ours_s = statistics.median(ours[1:] or ours)
    params = sum(p.numel() for p in load_policy("smollm2-135m").parameters())
    bandwidth = mem_read_gb_s()
    gflops = matmul_gflops(torch.bfloat16 if ns.dtype == "bfloat16" else torch.float32)
    floor_s = step_floor_s(rows, params, ns.dtype, bandwidth, gflops)
    trl_s: float | None = None
    trl_note = "measured in this run"
    if not ns.no_trl:
        try:
            trl_times = _trl(ns.steps, ns.completions, ns.new_tokens, ns.dtype, ns.seed)
            trl_s = statistics.median(trl_times[1:] or trl_times)
        except ImportError as err:
            trl_note = (
                f"not measured ({err.name} not installed: pip install trl); reference {TRL_REFERENCE_S} s"
            )
    table = Table("system", "per-step s (median, after warm-up)", "steps")
    label = (
        "posttrain (sync, on-policy)"
        if ns.mode == "sync"
        else (f"posttrain (async, staleness <= {ns.max_staleness}, {ns.async_lag} lag)")
    )
    table.add_row(label, f"{ours_s:.2f}", " ".join(f"{t:.2f}" for t in ours))
    if trl_s is not None:
        table.add_row(
            "TRL GRPOTrainer (sync, on-policy)", f"{trl_s:.2f}", " ".join(f"{t:.2f}" for t in trl_times)
        )
    else:
        table.add_row("TRL GRPOTrainer", trl_note, "")
    console.print(table)
    console.print(
        f"hardware floor of a serial step on this machine: {floor_s:.2f} s (weights read once per decode step at "
        f"{bandwidth:.1f} GB/s + 6 x params FLOPs per computed position at {gflops:.0f} GFLOP/s); ours is "
        f"{ours_s / floor_s:.1f}x the floor"
    )
    if trl_s is not None and trl_s / 3 < floor_s:
        console.print(
            f"a third of TRL's step ({trl_s / 3:.2f} s) is below that floor: no implementation reaches it here"
        )
    result: dict[str, Any] = {
        "ours_step_s": ours_s,
        "ours_steps_s": ours,
        "completions": ns.completions,
        "new_tokens": ns.new_tokens,
        "dtype": ns.dtype,
        "mode": ns.mode,
        "max_staleness": ns.max_staleness if ns.mode == "async" else 0,
        "async_lag": ns.async_lag if ns.mode == "async" else None,
        "checkpoint_every": ns.checkpoint_every,
        "trl_step_s": trl_s,
        "trl_note": trl_note,
        # like for like only when both are on-policy; async (stale by up to k updates) is named apart
        "like_for_like": ns.mode == "sync",
        ("ratio_vs_trl" if ns.mode == "sync" else "ratio_async_vs_trl_onpolicy"): (trl_s / ours_s)
        if trl_s
        else None,
        "floor_step_s": floor_s,
        "ours_over_floor": ours_s / floor_s,
        "memory_bandwidth_gbs": bandwidth,
        "matmul_gflops": gflops,
        "phase_s": {
            k: statistics.median([r.get(f"timeline/{k}_s", 0.0) for r in (rows[1:] or rows)])
            for k in ("generate", "update", "weight_sync", "idle")
        },
    }
    if trl_s and ns.mode == "sync":
        console.print(
            f"posttrain step time is {ours_s / trl_s:.2f}x TRL's ({trl_s / ours_s:.2f}x faster), both on-policy"
        )
    elif trl_s:
        console.print(
            f"posttrain async step time is {ours_s / trl_s:.2f}x TRL's on-policy step ({trl_s / ours_s:.2f}x): not like "
            f"for like, ours trains on trajectories up to {ns.max_staleness} update(s) old; TRL's AsyncGRPOTrainer "
            "needs a vLLM server on CUDA and cannot run here"
        )
    return result
