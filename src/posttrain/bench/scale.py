"""`posttrain bench scale`: weight-sync time per transport for the embedded model, against the memory
bandwidth measured in the same run.

Transports (`orchestrator.rl.weight_sync`): `in_process` (the tensors copied into a live paged engine),
`shared_file` (a push into a folder on /dev/shm, then the read, verification and load into the same
engine, as an engine in another process does), `shared_file_transport` (the same push and verified read,
without the engine's load: what the transport itself costs), `broadcast` (torch.distributed over gloo
between two processes on 127.0.0.1: the wire time of the push, process start excluded) and `lora` (a
rank-R adapter push through shared_file, merged at the receiver). The baseline is a plain copy of the
same bytes into preallocated buffers (`memcpy`): what moving the weights once costs on this machine.
Each figure is the median of `--repeats`.

With `--ray-steps N`: N RL steps of the default recipe on the model with the local backend (engine in
process, in-process weights, sync), with the Ray backend colocated (one engine actor on every CPU,
shared-file weights, sync) and with the Ray backend disaggregated (one engine actor on 1 CPU, async with
one step of staleness), same seed; `ray_overhead_frac` = median colocated Ray step time / local - 1 and
`ray_async_vs_local` = median async Ray step time / local, the first step (start-up) left out. Null
without `--ray-steps`.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

import posttrain.orchestrator.rl.weight_sync as ws
from posttrain.train.distributed import init_local_gloo


def _median_s(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _broadcast_worker(
    rank: int, port: int, weights: dict[str, torch.Tensor] | None, repeats: int, out: Any
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    init_local_gloo(rank, 2, port, timeout_s=120)
    transport = ws.Broadcast(src=0)

    class Sink:  # the receiver's engine: keeps the tensors, as load_weights would copy them
        def load_weights(self, tensors: dict, version: int | None = None) -> None:
            self.tensors = tensors

    receiver = ws.Receiver(Sink())
    times = []
    for v in range(1, repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            transport.push(ws.full_update(weights or {}, v))
        else:
            transport.push(None, receiver)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 1:
        out["broadcast_s"] = statistics.median(times)
    dist.destroy_process_group()


def _broadcast_s(weights: dict[str, torch.Tensor], repeats: int) -> float:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        procs = [
            ctx.Process(target=_broadcast_worker, args=(r, port, weights if r == 0 else None, repeats, out))
            for r in (0, 1)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        if "broadcast_s" not in out:
            raise RuntimeError("the broadcast benchmark's processes did not report")
        return float(out["broadcast_s"])


def _step_seconds(model: str, steps: int, run_root: str, name: str, extra: list[str]) -> list[float]:
    from posttrain.config import load_config, save_config
    from posttrain.orchestrator.rl import RLRun
    from posttrain.telemetry import RunDir, read_metrics

    cfg = load_config(
        None,
        [
            f"model.spec={model}",
            f"orchestrator.steps={steps}",
            f"telemetry.run_dir={run_root}",
            "telemetry.progress=false",
            "telemetry.tensorboard=false",
            "curriculum.probe_every=0",
            "orchestrator.checkpoint_every=0",
            *extra,
        ],
    )
    run_dir = RunDir.create(cfg.telemetry.run_dir, name)
    save_config(cfg, run_dir.config)
    run = RLRun(cfg, run_dir)
    try:
        run.train()
    finally:
        run.close()
    return [float(r["timeline/step_s"]) for r in read_metrics(run_dir.metrics)]


def _ray_overhead(opts: Any) -> dict:
    if not opts.ray_steps:
        return {"ray_overhead_frac": None, "ray_note": "not measured (--ray-steps 0)"}
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        return {"ray_overhead_frac": None, "ray_note": "not measured: the [ray] extra is not installed"}
    root = tempfile.mkdtemp(prefix="posttrain-bench-scale-runs-")
    try:
        local = _step_seconds(opts.model, opts.ray_steps + 1, root, "local", [])
        ray = _step_seconds(
            opts.model,
            opts.ray_steps + 1,
            root,
            "ray",
            [
                "placement.backend=ray",
                "placement.weight_sync=shared_file",
                f"placement.engine_cpus={os.cpu_count() or 1}",
            ],
        )
        # disaggregated: the engine actor on one CPU generates the next batch while the learner, in
        # this process, updates on the current one (async, one step of staleness)
        ray_async = _step_seconds(
            opts.model,
            opts.ray_steps + 1,
            root,
            "ray-async",
            [
                "placement.backend=ray",
                "placement.weight_sync=shared_file",
                "placement.engine_cpus=1",
                "orchestrator.mode=async",
                "orchestrator.max_staleness=1",
            ],
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med_local, med_ray = statistics.median(local[1:]), statistics.median(ray[1:])
    med_async = statistics.median(ray_async[1:])
    return {
        "ray_overhead_frac": med_ray / med_local - 1.0,
        "ray_step_s": med_ray,
        "local_step_s": med_local,
        "ray_async_step_s": med_async,
        "ray_async_vs_local": med_async / med_local,
        "ray_steps": opts.ray_steps,
        "ray_note": f"colocated sync: one engine actor with {os.cpu_count()} CPUs; disaggregated async: one "
        f"engine actor with 1 CPU, max_staleness 1; median of {opts.ray_steps} steps after the first",
    }


def main(opts: Any) -> dict:
    """Run the benchmark with the options of `posttrain bench scale` (see its --help)."""
    from rich.console import Console
    from rich.table import Table

    from posttrain.config import EngineConfig
    from posttrain.engine import make_engine
    from posttrain.models import load_policy, load_tokenizer, wrap_lora

    console = Console(stderr=True)
    model = load_policy(opts.model, dtype=opts.dtype)
    tokenizer = load_tokenizer(opts.model)
    engine = make_engine(EngineConfig(dtype=opts.dtype, num_kv_blocks=64), model, tokenizer)
    weights = {k: v.detach() for k, v in model.state_dict().items()}  # tied tensors stay tied
    update = ws.full_update(weights, 1)
    nbytes = update.nbytes
    unique, _ = ws.dedupe(weights)
    buffers = {k: torch.empty_like(v) for k, v in unique.items()}

    def memcpy() -> None:
        for k, v in unique.items():
            buffers[k].copy_(v)

    version = iter(range(2, 10**9))

    def in_process() -> None:
        engine.load_weights(weights, version=next(version))

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    folder = tempfile.mkdtemp(prefix="posttrain-bench-scale-", dir=shm)
    try:
        shared = ws.SharedFile(folder)
        receiver = ws.Receiver(engine)

        def shared_file() -> None:
            shared.push(ws.full_update(weights, next(version)))
            shared.pull(receiver)

        def shared_file_transport() -> None:
            shared.push(ws.full_update(weights, next(version)))
            shared.read()

        lora_model = wrap_lora(
            load_policy(opts.model, dtype=opts.dtype),
            rank=opts.lora_rank,
            alpha=2.0 * opts.lora_rank,
            dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        )
        lora_probe = ws.lora_update(lora_model, 0)
        lora_receiver = ws.Receiver(engine, base=ws.lora_base(lora_model))
        lora_shared = ws.SharedFile(os.path.join(folder, "lora"))

        def lora() -> None:
            lora_shared.push(ws.lora_update(lora_model, next(version)))
            lora_shared.pull(lora_receiver)

        console.print(f"[dim]measuring {nbytes / 1e6:.0f} MB of {opts.model} weights ({opts.dtype}) ...[/]")
        runners = {
            "memcpy": memcpy,
            "in_process": in_process,
            "shared_file": shared_file,
            "shared_file_transport": shared_file_transport,
            "lora": lora,
        }
        for fn in runners.values():
            fn()  # warm: page faults, allocator
        seconds = {name: _median_s(fn, opts.repeats) for name, fn in runners.items()}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if not opts.skip_broadcast:
        console.print("[dim]measuring the gloo broadcast between two processes ...[/]")
        seconds["broadcast"] = _broadcast_s(weights, opts.repeats)
    lora_bytes = lora_probe.nbytes
    moved = {name: (lora_bytes if name == "lora" else nbytes) for name in seconds}
    rates = {name: moved[name] / s for name, s in seconds.items()}
    load = os.getloadavg()[0]
    table = Table(
        title=f"weight sync: {opts.model} {opts.dtype}, {nbytes / 1e6:.0f} MB (LoRA r={opts.lora_rank}: "
        f"{lora_bytes / 1e6:.1f} MB), median of {opts.repeats}, load {load:.1f}"
    )
    for col in ("transport", "seconds", "GB/s", "vs memcpy"):
        table.add_column(col)
    for name, s in seconds.items():
        table.add_row(name, f"{s:.3f}", f"{rates[name] / 1e9:.2f}", f"{seconds['memcpy'] / s:.2f}x")
    console.print(table)
    return {
        "model": opts.model,
        "dtype": opts.dtype,
        "weight_bytes": nbytes,
        "lora_bytes": lora_bytes,
        "repeats": opts.repeats,
        "weight_sync_s": {k: v for k, v in seconds.items() if k != "memcpy"},
        "memcpy_s": seconds["memcpy"],
        "bytes_per_s": {k: v for k, v in rates.items() if k != "memcpy"},
        "memcpy_bytes_per_s": rates["memcpy"],
        "shared_file_frac_of_memcpy": rates["shared_file"] / rates["memcpy"],
        "shared_file_transport_frac_of_memcpy": rates["shared_file_transport"] / rates["memcpy"],
        **_ray_overhead(opts),
        "load_avg_1m": load,
        "cpu_count": os.cpu_count(),
    }
