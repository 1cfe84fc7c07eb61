"""`posttrain bench sandbox|engine|learner|rl|retention|curriculum|serve|scale|ci-fix|docs|longctx|envs|vision-probe [OPTIONS] [--json]`: benchmarks that measure their
baseline in the same run. Each is a command with its own options (`posttrain bench NAME --help`); the
benchmarks themselves live in `posttrain.bench`, one module each, and return their named figures, which
`--json` prints as one object on stdout's last line.
"""

from __future__ import annotations

import importlib
from enum import StrEnum
from types import SimpleNamespace
from typing import Any

import typer

from posttrain.cli.common import EXIT_USAGE, fail, print_json_last

app = typer.Typer(
    help="Benchmarks against their baselines, measured in the same run.",
    no_args_is_help=True,
    rich_markup_mode=None,
)

JSON = typer.Option(False, "--json", help="print one JSON object with the figures, last line of stdout")


def _run(name: str, json_out: bool, **options: Any) -> dict[str, Any]:
    from posttrain.bench import BenchUsageError

    module = importlib.import_module(f"posttrain.bench.{name}")
    try:
        result = module.main(SimpleNamespace(**options))
    except BenchUsageError as err:
        fail(str(err), EXIT_USAGE)
    if json_out:
        print_json_last(result)
    return result


def run_bench(name: str, args: list[str]) -> dict[str, Any]:
    """Run `posttrain bench NAME ARGS...` in this process and return its figures (for tests and scripts);
    a usage error exits with SystemExit(2) after printing its message, as the CLI does."""
    from typer.main import get_command

    command = get_command(app)
    try:
        result = command.main([name, *args], prog_name="posttrain bench", standalone_mode=False)
    except Exception as err:  # click's usage errors: print them as the CLI would
        show = getattr(err, "show", None)
        if show is None:
            raise
        show()
        raise SystemExit(getattr(err, "exit_code", EXIT_USAGE)) from None
    if isinstance(result, int):  # a typer.Exit(code) from the command
        raise SystemExit(result)
    return result


@app.command("sandbox")
def sandbox(
    seconds: float = typer.Option(1.5, "--seconds", min=0.01, help="duration of each measurement"),
    repeats: int = typer.Option(3, "--repeats", min=1, help="interleaved repeats; medians are reported"),
    clients: int = typer.Option(0, "--clients", min=0, help="concurrent clients (0: 2 x pool size)"),
    pool_size: int = typer.Option(0, "--pool-size", min=0, help="workers per profile (0: the CPU count)"),
    skip_numpy: bool = typer.Option(False, "--skip-numpy", help="leave out the numpy-import workload"),
    service_clients: int = typer.Option(
        64, "--service-clients", min=0, help="clients of the HTTP service and fleet load test (0: skip it)"
    ),
    json_out: bool = JSON,
) -> dict[str, Any]:
    """Executions/s and latency of the warm jailed pool vs one bwrap per execution and plain subprocess,
    and of the pool behind the HTTP service and a fleet of two services."""
    return _run(
        "sandbox",
        json_out,
        seconds=seconds,
        repeats=repeats,
        clients=clients,
        pool_size=pool_size,
        skip_numpy=skip_numpy,
        service_clients=service_clients,
    )


@app.command("engine")
def engine(
    model: str = typer.Option("smollm2-135m", "--model", help="model spec"),
    quick: bool = typer.Option(False, "--quick", help="fewer prompts and tokens (a minute or two)"),
    dtypes: str = typer.Option("float32,bfloat16", "--dtypes", help="comma list of float32, bfloat16"),
    workloads: str = typer.Option("rollout,serving,decode_1,decode_64", "--workloads", help="comma list"),
    weight_quants: str = typer.Option(
        "none",
        "--weight-quants",
        help="comma list of none, int8, int4: the engine also on quantized weights (engine.weight_quant), "
        "with its ratio to the unquantized engine and its greedy agreement with it",
    ),
    repeats: int = typer.Option(1, "--repeats", min=1, help="interleaved repeats; medians are reported"),
    no_hf: bool = typer.Option(
        False, "--no-hf", help="skip the HF generate baseline (ratios are then absent)"
    ),
    seed: int = typer.Option(0, "--seed"),
    json_out: bool = JSON,
) -> dict[str, Any]:
    """Generated tok/s of the paged engine vs HF generate, with compute and bandwidth rooflines."""
    return _run(
        "engine",
        json_out,
        model=model,
        quick=quick,
        dtypes=dtypes,
        workloads=workloads,
        weight_quants=weight_quants,
        repeats=repeats,
        no_hf=no_hf,
        seed=seed,
    )


@app.command("learner")
def learner(
    quick: bool = typer.Option(False, "--quick", help="8 sequences of up to 128 tokens"),
    seqs: int | None = typer.Option(
        None, "--seqs", min=1, help="sequences per update (default 32; --quick 8)"
    ),
    seq_len: int | None = typer.Option(
        None, "--seq-len", min=2, help="longest sequence (default 256; --quick 128)"
    ),
    fixed_length: bool = typer.Option(False, "--fixed-length", help="all sequences exactly --seq-len long"),
    repeats: int = typer.Option(3, "--repeats", min=1, help="rounds over the variants (median reported)"),
    micro_batch_tokens: int = typer.Option(4096, "--micro-batch-tokens", min=1),
    lora_rank: int = typer.Option(16, "--lora-rank", min=1),
    spec: str = typer.Option("smollm2-135m", "--spec", help="model spec"),
    variants: str = typer.Option(
        "all", "--variants", help="comma list like full-fp32-packed,lora-bf16-padded"
    ),
    threads: int = typer.Option(0, "--threads", min=0, help="torch threads (0: leave as is)"),
    grpo: int = typer.Option(
        0,
        "--grpo",
        min=0,
        metavar="G",
        help="GRPO-shaped batch: groups of G sharing a prompt; adds the '-shared' variants",
    ),
    json_out: bool = JSON,
) -> dict[str, Any]:
    """Tokens/s of Learner.update and of the SFT step: full/LoRA, fp32/bf16, packed/padded, against the matmul roofline."""
    return _run(
        "learner",
        json_out,
        quick=quick,
        seqs=seqs,
        seq_len=seq_len,
        fixed_length=fixed_length,
        repeats=repeats,
        micro_batch_tokens=micro_batch_tokens,
        lora_rank=lora_rank,
        spec=spec,
        variants=variants,
        threads=threads,
        grpo=grpo,
    )


class _Dtype(StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"


class _Mode(StrEnum):
    sync = "sync"
    async_ = "async"


class _Lag(StrEnum):
    fixed = "fixed"
    latest = "latest"


@app.command("rl")
def rl(
    steps: int = typer.Option(4, "--steps", min=1, help="steps per system (the first is warm-up)"),
    completions: int = typer.Option(8, "--completions", min=2, help="completions per step (one prompt)"),
    new_tokens: int = typer.Option(48, "--new-tokens", min=1),
    dtype: _Dtype = typer.Option(_Dtype.float32, "--dtype"),
    no_trl: bool = typer.Option(False, "--no-trl", help="skip the TRL GRPOTrainer baseline"),
    mode: _Mode = typer.Option(
        _Mode.sync,
        "--mode",
        help="sync is on-policy like TRL; async overlaps the next step's generation with the "
        "update and is reported apart (not like for like)",
    ),
    max_staleness: int = typer.Option(
        1, "--max-staleness", min=0, help="async: updates a trajectory may lag"
    ),
    async_lag: _Lag = typer.Option(
        _Lag.fixed,
        "--async-lag",
        help="async: exactly max-staleness behind (reproducible) or the newest weights",
    ),
    checkpoint_every: int = typer.Option(
        0, "--checkpoint-every", min=0, help="checkpoint period in steps (0: none)"
    ),
    seed: int = typer.Option(0, "--seed"),
    json_out: bool = JSON,
) -> dict[str, Any]:
    """Per-step wall time of the RL loop vs TRL's GRPOTrainer at equal settings, and this machine's floor."""
    return _run(
        "rl",
        json_out,
        steps=steps,
        completions=completions,
        new_tokens=new_tokens,
        dtype=dtype.value,
        no_trl=no_trl,
        mode=mode.value,
        max_staleness=max_staleness,
        async_lag=async_lag.value,
        checkpoint_every=checkpoint_every,
        seed=seed,
    )


@app.command("retention")
def retention(
    quick: bool = typer.Option(False, "--quick", help="a few steps and tasks (minutes), not the full recipe"),
    seeds: int = typer.Option(1, "--seeds", min=1, help="training seeds (each trains both settings)"),
    seed_start: int = typer.Option(0, "--seed-start", min=0),
    steps: int | None = typer.Option(None, "--steps", min=1, help="steps of the run without control"),
    n_eval: int | None = typer.Option(None, "--n-eval", min=1, help="held-out tasks per arm"),
    samples: int | None = typer.Option(
        None, "--samples", min=1, help="sampled evaluation: samples per task (pass@1 and pass@SAMPLES)"
    ),
    max_new_tokens: int | None = typer.Option(None, "--max-new-tokens", min=1),
    model: str = typer.Option("smollm2-135m", "--model"),
    trained: str | None = typer.Option(
        None, "--trained", help="the training mix (default: math:0,1;code.unit_tests:0)"
    ),
    retention_suites: str | None = typer.Option(
        None,
        "--retention",
        help="the suites the control watches: ';'-separated [label=]name[{options}]:levels, e.g. "
        "letters=math{datasets: [letter_counting]}:0 (default: math:2;code.unit_tests:1)",
    ),
    outside: str | None = typer.Option(
        None,
        "--outside",
        help="families in neither the mix nor the suites, as --retention (default: bench.retention.OUTSIDE: "
        "math:3, code.unit_tests:2, instruct.constraints:0-1 and three reasoning-gym families)",
    ),
    control: list[str] = typer.Option(
        [], "--control", help="KEY=VALUE of the control setting (repeatable; replaces the default set)"
    ),
    run_overrides: list[str] = typer.Option([], "--run-set", help="KEY=VALUE for both settings (repeatable)"),
    eval_seed: int = typer.Option(1000, "--eval-seed"),
    out: str | None = typer.Option(None, "--out", help="keep the runs (policies, metrics) under this folder"),
    reuse: bool = typer.Option(
        False, "--reuse", help="score the runs already saved under --out instead of training them"
    ),
    reuse_off: str | None = typer.Option(
        None,
        "--reuse-off",
        help="take the runs without control from this folder (a saved --out) and train only the control "
        "setting, e.g. to compare another --control against them",
    ),
    json_out: bool = JSON,
) -> dict[str, Any]:
    """The default recipe without and with retention control (same seed and token budget): trained gain,
    retention suites and outside families against the base model, pass@k, entropy, the issue's targets."""
    return _run(
        "retention",
        json_out,
        quick=quick,
        seeds=seeds,
        seed_start=seed_start,
        steps=steps,
        n_eval=n_eval,
        samples=samples,
        max_new_tokens=max_new_tokens,
        model=model,
        trained=trained,
        retention=retention_suites,
        outside=outside,
        control=control,
        run_overrides=run_overrides,
        eval_seed=eval_seed,
        out=out,
        reuse=reuse,
        reuse_off=reuse_off,
    )


class _Budget(StrEnum):
    tokens = "tokens"
    rollouts = "rollouts"


def _pooled(pool: bool, results: list[str] | None) -> list[str] | None:
    if results and not pool:
        fail(f"RESULT arguments ({results[0]}, ...) are read by --pool only", EXIT_USAGE)
    if pool and not results:
        fail("--pool needs at least one saved RESULT", EXIT_USAGE)
    return list(results) if pool else None


@app.command("curriculum")
def curriculum(
    seeds: int | None = typer.Option(
        None, "--seeds", help="simulated learners (default 32); --real: training seeds (default 2, --quick 1)"
    ),
    seed_start: int = typer.Option(
        0,
        "--seed-start",
        help="first seed (e.g. 400 for learners the defaults were "
        "not tuned on; --real: to add seeds to an earlier run)",
    ),
    samplers: str | None = typer.Option(
        None,
        "--samplers",
        help="comma list; must include uniform_by_domain "
        "(default: every sampler and the greedy oracle; oracle_plan on request)",
    ),
    groups_per_step: int | None = typer.Option(None, "--groups-per-step", help="simulation: groups per step"),
    layout: str = typer.Option(
        "default",
        "--layout",
        metavar="NAME|SPEC",
        help="simulated arms: a preset (default, idle_heavy, ...) or domain:level=role,...; with --real: "
        "default (the --domains arms) or many (25 arms: reasoning-gym families at several levels, "
        "code.unit_tests 0-2, tools.apis 0-3)",
    ),
    budget_steps: int | None = typer.Option(
        None, "--budget-steps", help="token budget in full batches at the mean rollout length"
    ),
    boot: int = typer.Option(2000, "--boot", min=1, help="bootstrap resamples"),
    plot: str | None = typer.Option(
        None, "--plot", help="write adaptive's domain shares (first seed) to this PNG"
    ),
    overrides: list[str] = typer.Option(
        [],
        "--set",
        metavar="KEY=VALUE",
        help="curriculum config override for every sampler, e.g. c=0.5 (repeatable)",
    ),
    free_probes: bool = typer.Option(False, "--free-probes", help="do not charge probe tokens to the budget"),
    hindsight: int = typer.Option(
        0,
        "--hindsight",
        metavar="ROUNDS",
        help="add hindsight_static: the best fixed mix per seed from ROUNDS x 24 runs",
    ),
    hindsight_phases: int = typer.Option(
        1, "--hindsight-phases", metavar="P", help="hindsight plans of P mixes, one per P-th of the budget"
    ),
    tune: int = typer.Option(
        0,
        "--tune",
        metavar="ROUNDS",
        help="run no table: search adaptive's settings (ROUNDS x 20 candidates) and print them",
    ),
    real: bool = typer.Option(
        False, "--real", help="adaptive vs uniform_by_domain on a real model through the loop"
    ),
    quick: bool = typer.Option(
        False, "--quick", help="--real: a small preset that finishes in a few minutes"
    ),
    model: str | None = typer.Option(None, "--model", help="--real: model spec (default smollm2-135m)"),
    domains: str | None = typer.Option(None, "--domains", help="--real: name:level[,level];..."),
    steps: int | None = typer.Option(
        None, "--steps", help="--real: uniform's training steps (default 40; quick 4)"
    ),
    prompts_per_step: int | None = typer.Option(
        None, "--prompts-per-step", help="--real: batch.prompts_per_step, groups per step (default 4)"
    ),
    samples_per_prompt: int | None = typer.Option(
        None,
        "--samples-per-prompt",
        help="--real: batch.samples_per_prompt, rollouts per group (default 8; quick 4)",
    ),
    n_eval: int | None = typer.Option(
        None, "--n-eval", help="--real: held-out tasks per arm (default 32; quick 8)"
    ),
    max_new_tokens: int | None = typer.Option(
        None, "--max-new-tokens", help="--real: default 128 (quick 64)"
    ),
    probe_every: int | None = typer.Option(
        None, "--probe-every", help="--real: probe period (default 5; quick 2)"
    ),
    probe_size: int | None = typer.Option(
        None, "--probe-size", help="--real: probe tasks per arm (default 16)"
    ),
    budget: _Budget | None = typer.Option(
        None,
        "--budget",
        help="--real: adaptive stops at uniform's tokens (default, probes charged) or after the same steps",
    ),
    eval_seed: int | None = typer.Option(
        None, "--eval-seed", help="--real: held-out task seed (default 1000)"
    ),
    out: str | None = typer.Option(
        None, "--out", help="--real: directory for the run folders (default: a temp dir)"
    ),
    keep_checkpoints: bool = typer.Option(
        False, "--keep-checkpoints", help="--real: keep each run's last checkpoint"
    ),
    run_overrides: list[str] = typer.Option(
        [], "--run-set", metavar="KEY=VALUE", help="--real: any run-config override (repeatable)"
    ),
    reuse_uniform: str | None = typer.Option(
        None,
        "--reuse-uniform",
        metavar="RESULT",
        help="--real: run only adaptive against a saved result's uniform runs",
    ),
    results: list[str] = typer.Argument(None, metavar="[RESULT]...", help="saved --real results, for --pool"),
    pool: bool = typer.Option(
        False,
        "--pool",
        help="run nothing: one report over the saved --real RESULTs given "
        "(a run root, its result.json, or a --json capture)",
    ),
    pool_any_config: bool = typer.Option(
        False, "--pool-any-config", help="with --pool: do not compare the adaptive runs' settings"
    ),
    compare: tuple[str, str] | None = typer.Option(
        None, "--compare", metavar="A B", help="run nothing: pair the adaptive runs of two saved results"
    ),
    json_out: bool = JSON,
) -> dict[str, Any]:
    """Adaptive domain sampling vs uniform, sec and dump: on the simulated learner (default) or a real model."""
    return _run(
        "curriculum",
        json_out,
        seeds=seeds,
        seed_start=seed_start,
        samplers=samplers,
        groups_per_step=groups_per_step,
        layout=layout,
        budget_steps=budget_steps,
        boot=boot,
        plot=plot,
        overrides=list(overrides),
        free_probes=free_probes,
        hindsight=hindsight,
        hindsight_phases=hindsight_phases,
        tune=tune,
        real=real,
        quick=quick,
        model=model,
        domains=domains,
        steps=steps,
        prompts_per_step=prompts_per_step,
        samples_per_prompt=samples_per_prompt,
        n_eval=n_eval,
        max_new_tokens=max_new_tokens,
        probe_every=probe_every,
        probe_size=probe_size,
        budget=budget.value if budget else None,
        eval_seed=eval_seed,
        out=out,
        keep_checkpoints=keep_checkpoints,
        run_overrides=list(run_overrides),
        reuse_uniform=reuse_uniform,
        pool=_pooled(pool, results),
        pool_any_config=pool_any_config,
        compare=list(compare) if compare else None,
    )


@app.command("serve")
def serve(
    model: str = typer.Option(
        "smollm2-135m", "--model", help="what `posttrain serve` serves (spec, folder, run)"
    ),
    clients: str = typer.Option("1,8,32", "--clients", help="comma list of concurrent client counts"),
    requests_per_client: int = typer.Option(
        2, "--requests-per-client", min=1, help="requests each client sends per level (closed loop)"
    ),
    max_tokens: int = typer.Option(128, "--max-tokens", min=1, help="max_tokens of every load request"),
    workloads: str = typer.Option("serving,agentic", "--workloads", help="comma list of serving, agentic"),
    repeats: int = typer.Option(1, "--repeats", min=1, help="interleaved repeats; medians are reported"),
    overrides: list[str] = typer.Option(
        [], "--set", metavar="KEY=VALUE", help="config override for the server, e.g. engine.max_num_seqs=32"
    ),
    skip_quality: bool = typer.Option(False, "--skip-quality", help="leave out agreement and accuracy"),
    quality_n: int = typer.Option(16, "--quality-n", min=1, help="held-out tasks per domain and difficulty"),
    suite: str = typer.Option(None, "--suite", help="held-out domains, comma list (default: the config's)"),
    agreement_prompts: int = typer.Option(32, "--agreement-prompts", min=1, help="greedy agreement prompts"),
    agreement_tokens: int = typer.Option(64, "--agreement-tokens", min=1, help="tokens per agreement prompt"),
    timeout_s: float = typer.Option(300.0, "--timeout-s", min=1.0, help="per-request limit (an error after)"),
    startup_timeout_s: float = typer.Option(600.0, "--startup-timeout-s", min=1.0, help="server load limit"),
    seed: int = typer.Option(0, "--seed", help="seed of the workloads' prompts"),
    json_out: bool = JSON,
) -> dict[str, Any]:
    """Output tok/s, TTFT, ITL and errors of `posttrain serve --mode both`, fast vs standard, under 1-32
    concurrent clients; greedy agreement, held-out accuracy delta; llama.cpp at batch 1 if installed."""
    return _run(
        "serve",
        json_out,
        model=model,
        clients=clients,
        requests_per_client=requests_per_client,
        max_tokens=max_tokens,
        workloads=workloads,
        repeats=repeats,
        overrides=list(overrides),
        skip_quality=skip_quality,
        quality_n=quality_n,
        suite=suite,
        agreement_prompts=agreement_prompts,
        agreement_tokens=agreement_tokens,
        timeout_s=timeout_s,
        startup_timeout_s=startup_timeout_s,
        seed=seed,
    )


@app.command("scale")
def scale(
    model: str = typer.Option("smollm2-135m", "--model", help="model spec"),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16"),
    repeats: int = typer.Option(5, "--repeats", min=1, help="repeats per transport; medians are reported"),
    lora_rank: int = typer.Option(16, "--lora-rank", min=1, help="rank of the LoRA adapter push"),
    skip_broadcast: bool = typer.Option(False, "--skip-broadcast", help="leave out the 2-process gloo run"),
    ray_steps: int = typer.Option(
        0,
        "--ray-steps",
        min=0,
        help="RL steps (after a first): local, Ray colocated sync, Ray disaggregated async (0: skip)",
    ),
    json_out: bool = JSON,
) -> dict[str, Any]:
    """Weight-sync seconds and bytes/s per transport (in-process, shared file, gloo broadcast, LoRA
    adapters) against a plain copy of the same bytes, measured in the same run."""
    if dtype not in ("float32", "bfloat16"):
        fail(f"--dtype must be float32 or bfloat16, got {dtype!r}", EXIT_USAGE)
    return _run(
        "scale",
        json_out,
        model=model,
        dtype=dtype,
        repeats=repeats,
        lora_rank=lora_rank,
        skip_broadcast=skip_broadcast,
        ray_steps=ray_steps,
    )


@app.command("ci-fix")
def ci_fix(
    models: list[str] = typer.Option(
        ["smollm2-135m"], "--model", help="in-process model: spec, HF folder or run dir (repeatable)"
    ),
    api_base: str = typer.Option(None, "--api-base", help="also score an OpenAI-compatible endpoint"),
    api_model: str = typer.Option(None, "--api-model", help="model name at --api-base"),
    api_key: str = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY"),
    suite: str = typer.Option(
        None, "--suite", help="the real-project suite folder (default benchmarks/ci_fix)"
    ),
    skip_suite: bool = typer.Option(False, "--skip-suite", help="only the held-out swe.ci_fix repositories"),
    levels: str = typer.Option("0,1,2", "--levels", help="swe.ci_fix levels, comma list"),
    swe_n: int = typer.Option(4, "--swe-n", min=0, help="held-out swe.ci_fix repositories per level"),
    max_turns: int = typer.Option(6, "--max-turns", min=1, help="assistant turns per attempt"),
    max_attempts: int = typer.Option(1, "--max-attempts", min=1, help="attempts per task"),
    timeout_s: float = typer.Option(300.0, "--timeout-s", min=1.0, help="limit per task"),
    overrides: list[str] = typer.Option([], "--set", metavar="KEY=VALUE", help="config override"),
    seed: int = typer.Option(0, "--seed", help="seed of the held-out swe.ci_fix tasks"),
    json_out: bool = JSON,
) -> dict[str, Any]:
    """Fix rate of `posttrain agent ci-fix` (patch verified on a fresh copy) with 95% intervals, attempts
    and wall time per fix, on held-out swe.ci_fix repos and the committed real-project suite."""
    from posttrain.bench.ci_fix import SUITE_DIR

    return _run(
        "ci_fix",
        json_out,
        models=list(models),
        api_base=api_base,
        api_model=api_model,
        api_key=api_key,
        suite=suite or str(SUITE_DIR),
        skip_suite=skip_suite,
        levels=levels,
        swe_n=swe_n,
        max_turns=max_turns,
        max_attempts=max_attempts,
        timeout_s=timeout_s,
        overrides=list(overrides),
        seed=seed,
    )


@app.command("docs")
def docs(
    n: int = typer.Option(8, "--n", min=1, help="generated reports (the issue's figure is 100)"),
    tokens: str = typer.Option("2048,4096,8192,32768", "--tokens", help="report lengths in tokens, cycled"),
    model: str = typer.Option("smollm2-135m", "--model", help="model spec of the in-process engine"),
    compare_model: str = typer.Option(
        None, "--compare-model", help="a second model (e.g. runs/docs-sft/policy) on the same documents"
    ),
    workers: int = typer.Option(2, "--workers", min=1, help="worker processes"),
    concurrency: int = typer.Option(1, "--concurrency", min=1, help="jobs in flight per worker"),
    backends: str = typer.Option(
        "sqlite,redis-postgres", "--backends", help="comma list: sqlite, redis-postgres"
    ),
    kill: bool = typer.Option(
        True, "--kill/--no-kill", help="SIGKILL a worker mid-job and start a replacement"
    ),
    visibility_s: float = typer.Option(
        30.0, "--visibility-timeout", min=1.0, help="seconds before a dead worker's job is re-leased"
    ),
    max_new_tokens: int = typer.Option(160, "--max-new-tokens", min=16),
    context_tokens: int = typer.Option(8192, "--context-tokens", min=512),
    timeout_s: float = typer.Option(3600.0, "--timeout-s", min=10.0, help="limit per backend"),
    seed: int = typer.Option(0, "--seed"),
    json_out: bool = JSON,
) -> dict[str, Any]:
    """Documents/min, p50/p99 job latency, field F1, lost and duplicates of the document pipeline on
    SQLite and on Redis + PostgreSQL, with a worker killed mid-run."""
    return _run(
        "docs",
        json_out,
        n=n,
        tokens=tokens,
        model=model,
        compare_model=compare_model,
        workers=workers,
        concurrency=concurrency,
        backends=backends,
        kill=kill,
        visibility_s=visibility_s,
        max_new_tokens=max_new_tokens,
        context_tokens=context_tokens,
        timeout_s=timeout_s,
        seed=seed,
    )


@app.command("longctx")
def longctx(
    lengths: str = typer.Option("1k,4k,16k,32k", "--lengths", help="sequence lengths, e.g. 1k,4k,16k,32k"),
    model: str = typer.Option("smollm2-135m", "--model", help="model spec"),
    baseline_max_tokens: int = typer.Option(
        4096, "--baseline-max-tokens", help="longest length also run without the memory features"
    ),
    timeout_s: float = typer.Option(3600.0, "--timeout-s", min=10.0, help="limit per measurement"),
    ring_tokens: int = typer.Option(
        4096, "--ring-tokens", min=0, help="ring attention over 1, 2, 4 processes at this length (0: skip)"
    ),
    json_out: bool = JSON,
) -> dict[str, Any]:
    """Peak memory and seconds of a training step and of a prefill against length, with the memory
    features (checkpointing, chunked logprobs, no L x L mask, chunked prefill) and without, measured in
    the same run."""
    return _run(
        "longctx",
        json_out,
        lengths=lengths,
        model=model,
        baseline_max_tokens=baseline_max_tokens,
        timeout_s=timeout_s,
        ring_tokens=ring_tokens,
    )


@app.command("envs")
def envs(
    seconds: float = typer.Option(20.0, "--seconds", help="closed-loop time of the CAD pool measurement"),
    clients: int = typer.Option(0, "--clients", min=0, help="concurrent episodes/scripts (0: 2 x pool size)"),
    pool_size: int = typer.Option(0, "--pool-size", min=0, help="sandbox workers per profile (0: CPU count)"),
    episodes: int = typer.Option(
        16, "--episodes", help="reference episodes per domain for verifier episodes/s"
    ),
    cad_tasks_per_level: int = typer.Option(
        4, "--cad-tasks-per-level", min=1, help="CAD tasks per level cycled"
    ),
    baseline_scripts: int = typer.Option(
        4, "--baseline-scripts", min=1, help="scripts run with an import each"
    ),
    samples: int = typer.Option(
        4, "--samples", help="base rate: samples per task at T=1 (0: skip the base rate)"
    ),
    tasks: int = typer.Option(8, "--tasks", help="base rate: held-out tasks per domain and level"),
    base_domains: str = typer.Option(
        "cad.modeling,scene.layout,docs.financial:0",
        "--base-domains",
        help="base rate: comma list of domains, each with :LEVEL+LEVEL or all its levels",
    ),
    model: str = typer.Option("smollm2-135m", "--model", help="base rate: model spec"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=16, help="base rate: tokens per reply"),
    seed: int = typer.Option(0, "--seed"),
    json_out: bool = JSON,
) -> dict[str, Any]:
    """Verifier episodes/s of every domain on its references, CAD scripts/s through the warm pool
    against an import per script, and the base model's accuracy per domain and level (T=1)."""
    return _run(
        "envs",
        json_out,
        seconds=seconds,
        clients=clients,
        pool_size=pool_size,
        episodes=episodes,
        cad_tasks_per_level=cad_tasks_per_level,
        baseline_scripts=baseline_scripts,
        samples=samples,
        tasks=tasks,
        base_domains=base_domains,
        model=model,
        max_new_tokens=max_new_tokens,
        seed=seed,
    )


@app.command("moe")
def moe(
    model: str = typer.Option("smollm2-135m", "--model", help="the dense model to upcycle (model spec)"),
    experts: int = typer.Option(4, "--experts", help="experts per layer of the upcycled MoE"),
    top_k: int = typer.Option(2, "--top-k", help="experts per token"),
    batch: str = typer.Option("1,8", "--batch", help="comma list of decode batch sizes"),
    new_tokens: int = typer.Option(64, "--new-tokens", help="tokens generated per sequence"),
    dtypes: str = typer.Option("float32", "--dtypes", help="comma list of float32, bfloat16"),
    weight_quants: str = typer.Option(
        "none,int8", "--weight-quants", help="comma list of none, int8, int8_weight_only, int4"
    ),
    repeats: int = typer.Option(3, "--repeats", help="interleaved repeats; medians are reported"),
    replay_samples: int = typer.Option(
        32, "--replay-samples", help="bf16 engine samples the Learner scores free and replayed (0: skip)"
    ),
    replay_tokens: int = typer.Option(48, "--replay-tokens", help="tokens per replay sample"),
    expert_noise: float = typer.Option(
        0.0, "--expert-noise", help="noise on the replay MoE's expert copies (relative to each weight's std)"
    ),
    seed: int = typer.Option(0, "--seed"),
    json_out: bool = JSON,
) -> dict[str, Any]:
    """Decode tok/s of the upcycled MoE vs dense models at equal active and equal total parameters; the
    engine-vs-Learner routing mismatch and log-ratio spread with free and with replayed routing."""
    return _run(
        "moe",
        json_out,
        model=model,
        experts=experts,
        top_k=top_k,
        batch=batch,
        new_tokens=new_tokens,
        dtypes=dtypes,
        weight_quants=weight_quants,
        repeats=repeats,
        replay_samples=replay_samples,
        replay_tokens=replay_tokens,
        expert_noise=expert_noise,
        seed=seed,
    )


@app.command("vision-probe")
def vision_probe(
    models: str = typer.Option(
        "graft",
        "--models",
        help="comma list of vision specs: graft (built with --seed), tiny:<family>, a VLM folder",
    ),
    domain: str = typer.Option("vision.shapes", "--domain", help="an image-question domain"),
    difficulty: int = typer.Option(0, "--difficulty", help="the domain's level"),
    train: int = typer.Option(384, "--train", help="train-split images the probe is fitted on"),
    heldout: int = typer.Option(192, "--heldout", help="held-out images it is scored on"),
    seed: int = typer.Option(0, "--seed"),
    json_out: bool = JSON,
) -> dict[str, Any]:
    """Held-out accuracy of a linear probe on a VLM's image features (mean-pooled and flat) and on the
    encoder's input pixels, against the constant answer."""
    return _run(
        "vision_probe",
        json_out,
        models=models,
        domain=domain,
        difficulty=difficulty,
        train=train,
        heldout=heldout,
        seed=seed,
    )
