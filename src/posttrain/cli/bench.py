"""`posttrain bench NAME [--json] [ARGS]`: benchmarks that measure against their baseline in one run.

Each benchmark lives with the package it measures and exposes `main(args: list[str]) -> dict`: it
prints a human table and returns the named figures; with --json they go on stdout's last line.
"""

from __future__ import annotations

import importlib

import typer

from posttrain.cli.common import EXIT_USAGE, fail, print_json_last

BENCHMARKS = {
    "sandbox": ("posttrain.sandbox.bench", "executions/s and latency of the sandbox pool vs subprocess and bwrap"),
    "engine": ("posttrain.engine.bench", "generation tok/s of the paged engine vs HF generate"),
    "learner": ("posttrain.train.bench", "tokens/s of Learner.update: full/LoRA, fp32/bf16, packed/padded"),
    "curriculum": ("posttrain.curriculum.bench", "adaptive domain sampling vs uniform, sec, dump (simulation)"),
    "rl": ("posttrain.orchestrator.bench", "per-step wall time of the RL loop vs TRL's GRPOTrainer figure"),
}


def bench(
    ctx: typer.Context,
    name: str = typer.Argument(..., help=f"one of: {', '.join(BENCHMARKS)}"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object with the figures, last"),
) -> None:
    """Run a benchmark; extra arguments go to the benchmark itself (try `-- --help`)."""
    if name not in BENCHMARKS:
        fail(f"unknown benchmark '{name}'; choose one of: {', '.join(BENCHMARKS)}", EXIT_USAGE)
    module_name, _ = BENCHMARKS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name == module_name:
            fail(f"benchmark '{name}' is not yet available in this version of posttrain")
        raise
    result = module.main(list(ctx.args))
    if json_out:
        print_json_last(result)
