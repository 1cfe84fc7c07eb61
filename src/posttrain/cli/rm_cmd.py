"""`posttrain rm train` — a reward model (scalar head, Bradley-Terry loss) on preference pairs from a
JSONL file or sampled from an environment by verifier outcome, into a run directory whose
reward_model/ is a HF folder; `posttrain rm serve RUN_DIR` — that model behind an HTTP scoring API."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import typer
from rich.markup import escape

from posttrain.cli.common import (
    EXIT_RUNTIME,
    EXIT_USAGE,
    console,
    err_console,
    fail,
    load_config_or_exit,
    source_sets,
)

app = typer.Typer(help="Reward models: train on preference pairs, serve over HTTP.", no_args_is_help=True)


@dataclass
class PreparedPairs:
    cfg: Any
    run: Any
    tokenizer: Any
    train: list
    heldout: list
    stats: dict
    sampler: Any = None  # online DPO: the PairSampler that sampled the pairs samples every round


def prepare_pair_run(
    config: str | None, sets: list[str], name: str | None, overwrite: bool, online: bool = False
) -> PreparedPairs:
    """Load the config, the tokenizer and the pairs, create the run dir. Exits 2 on a bad config, bad
    data or an existing run dir. `online`: the run may be online DPO (dpo.rounds > 1), whose sampler
    is kept for its rounds."""
    from posttrain.models import ModelNotFoundError, load_tokenizer, resolve
    from posttrain.orchestrator.offline.pairs import PairDataError, build_pairs, drop_long, resolve_lr_decay
    from posttrain.telemetry.rundir import RunDir, check_run_name

    if name is not None:
        try:
            check_run_name(name)
        except ValueError as err:
            fail(f"--name: {err}", EXIT_USAGE)
    cfg = load_config_or_exit(config, sets)
    if cfg.pairs.data is None and cfg.pairs.from_env is None:
        fail(
            "no pairs: give --data FILE.jsonl or --from-env DOMAIN (or pairs.data / pairs.from_env)",
            EXIT_USAGE,
        )
    rounds = cfg.dpo.rounds if online else 1
    sampler = None
    try:
        resolve(cfg.model.spec)
        tokenizer = load_tokenizer(cfg.model.spec)
        if rounds > 1:
            from posttrain.orchestrator.offline.dpo import check_online
            from posttrain.orchestrator.offline.pairs import PairSampler

            check_online(cfg)
            sampler = PairSampler(cfg, tokenizer)
        train, heldout, stats = build_pairs(cfg, tokenizer, sampler)
    except PairDataError as err:
        fail(str(err), EXIT_USAGE)
    except (KeyError, ValueError, ModelNotFoundError) as err:
        fail(f"cannot build the pairs: {err}", EXIT_USAGE)
    train, skipped = drop_long(train, cfg.pairs.max_seq_tokens)
    heldout, skipped_held = drop_long(heldout, cfg.pairs.max_seq_tokens)
    if not train:
        fail(
            f"no training pair fits pairs.max_seq_tokens={cfg.pairs.max_seq_tokens} ({skipped} skipped)",
            EXIT_USAGE,
        )
    stats = {**stats, "pairs/skipped_long": float(skipped + skipped_held)}
    resolve_lr_decay(cfg, len(train), rounds)
    try:
        run = RunDir.create(cfg.telemetry.run_dir, name or cfg.telemetry.name, overwrite=overwrite)
    except (FileExistsError, ValueError) as err:
        fail(str(err), EXIT_USAGE)
    return PreparedPairs(cfg, run, tokenizer, train, heldout, stats, sampler)


def open_pair_run(resume: str, given: dict[str, Any]) -> tuple[Any, Any]:
    """(config, run dir) of the pair run to resume in `resume`. The run goes on with its saved config and
    pairs, so the options in `given` that would change them exit 2, as does a directory that is not a run."""
    from posttrain.config import ConfigError, load_config
    from posttrain.telemetry.rundir import RunDir

    clash = [opt for opt, value in given.items() if value]
    if clash:
        fail(
            f"--resume continues the run with its saved config and pairs; drop {', '.join(clash)}",
            EXIT_USAGE,
        )
    try:
        run = RunDir.open(resume)
        cfg = load_config(run.config)
    except (FileNotFoundError, ConfigError) as err:
        fail(f"cannot resume the run: {err}", EXIT_USAGE)
    return cfg, run


def run_pairs(job: Any, prepared: PreparedPairs | None, what: str) -> None:
    """Train `job` on the prepared pairs, or resume it from its run directory's newest valid checkpoint
    (prepared None: exit 2 without the run's pairs, 1 without a usable checkpoint); print the outcome."""
    from posttrain.orchestrator.checkpoint import CheckpointError
    from posttrain.orchestrator.offline.pairs import PairDataError

    if prepared is not None:
        report(job.train(prepared.train, prepared.heldout, prepared.stats), prepared.run, what)
        return
    try:
        (train, heldout, stats), warnings = job.load()
    except PairDataError as err:
        fail(f"cannot resume the run: {err}", EXIT_USAGE)
    except CheckpointError as err:
        fail(str(err), EXIT_RUNTIME)
    for warning in warnings:
        err_console.print(f"[yellow]warning:[/] {escape(warning)}")
    console.print(f"resumed {job.run_dir.path} at step {job.step}")
    report(job.train(train, heldout, stats), job.run_dir, what)


def report(summary: dict, run: Any, what: str) -> None:
    """Print a pair run's outcome; exit 128 + signal when it was stopped."""
    if summary["interrupted"]:
        sig = summary["signal"]
        console.print(
            f"stopped by signal {sig} at step {summary['step']}; checkpoint saved in {run.checkpoints}"
        )
        raise typer.Exit(128 + int(sig))
    last = summary["last"]
    held = ""
    if "heldout/accuracy" in last:
        start = summary["heldout_start"].get("accuracy", 0.0)
        held = f", held-out pairwise accuracy {start:.3f} -> {last['heldout/accuracy']:.3f} on {summary['heldout_pairs']} pairs"
    console.print(
        f"done: {summary['step']} steps on {summary['train_pairs']} pairs, train loss {last['train/loss']:.3f}"
        f"{held}; {what} at {summary['exported']}; metrics in {run.metrics}"
    )


@app.command("train")
def train(
    config: str = typer.Argument(None, help="YAML config; omit for the defaults"),
    set_: list[str] = typer.Option(None, "--set", help="override, e.g. --set trainer.lr=1e-5"),
    name: str = typer.Option(None, "--name", help="run name (directory under telemetry.run_dir)"),
    data: str = typer.Option(None, "--data", help="JSONL preference pairs (pairs.data)"),
    from_env: str = typer.Option(None, "--from-env", help="sample pairs from this domain (pairs.from_env)"),
    levels: str = typer.Option(None, "--levels", help="--from-env difficulties, e.g. 0,1 (pairs.levels)"),
    n: int = typer.Option(None, "--n", min=1, help="--from-env training tasks (pairs.n)"),
    resume: str = typer.Option(None, "--resume", help="continue the run in this directory"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing run directory"),
    no_progress: bool = typer.Option(False, "--no-progress", help="no live progress display"),
) -> None:
    """Train a reward model: model.spec's decoder with a scalar head, Bradley-Terry loss on pairs.

    Data: --data FILE.jsonl with {"prompt": str or [messages], "chosen": str or [messages], "rejected":
    likewise} rows; or --from-env DOMAIN [--levels 0] [--n 64]: pairs.samples_per_task completions per
    task sampled by the engine, a verifier success paired with a failure. Prints the held-out pairwise
    accuracy before and after; the model goes to RUN_DIR/reward_model (AutoModelForSequenceClassification).
    --resume RUN_DIR goes on from the run's newest checkpoint, on its saved config and pairs."""
    from posttrain.models import load_tokenizer
    from posttrain.orchestrator.offline.rm import rm_run

    prepared = None
    if resume:
        given = {"CONFIG": config, "--set": set_, "--name": name, "--data": data, "--from-env": from_env}
        cfg, run = open_pair_run(resume, {**given, "--levels": levels, "--n": n, "--overwrite": overwrite})
        tokenizer = load_tokenizer(cfg.model.spec)
    else:
        sets = list(set_ or []) + source_sets("pairs", data, from_env, levels, n)
        prepared = prepare_pair_run(config, sets, name, overwrite)
        cfg, run, tokenizer = prepared.cfg, prepared.run, prepared.tokenizer
    try:
        job = rm_run(cfg, run, tokenizer, show_progress=not no_progress and cfg.telemetry.progress)
    except (KeyError, ValueError) as err:
        fail(f"cannot start the run: {err}", EXIT_USAGE)
    run_pairs(job, prepared, "reward model")


@app.command("serve")
def serve(
    run_dir: str = typer.Argument(..., help="a `posttrain rm train` run dir, or a reward model HF folder"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to bind"),
    port: int = typer.Option(8001, "--port", min=0, max=65535, help="TCP port"),
    max_batch: int = typer.Option(
        256, "--max-batch", min=1, help="most sequences in one request (413 above)"
    ),
) -> None:
    """Serve a reward model over HTTP: POST /score {"token_ids": [[...], ...]} -> {"scores": [...]};
    GET /health gives the tokenizer fingerprint RL runs check (reward.url). Stops on Ctrl-C / SIGTERM."""
    import uvicorn

    from posttrain.models import load_tokenizer
    from posttrain.rollout import RewardModelError, make_reward_app
    from posttrain.rollout.reward_model import reward_model_path
    from posttrain.train import load_reward_model

    try:
        folder = reward_model_path(run_dir)
        model, tokenizer = load_reward_model(folder), load_tokenizer(str(folder))
    except (RewardModelError, OSError, ValueError) as err:
        fail(str(err), EXIT_USAGE)
    app_ = make_reward_app(model, tokenizer, name=str(folder), max_batch=max_batch)
    console.print(f"reward model {folder} at http://{host}:{port} (POST /score, GET /health)")
    uvicorn.run(app_, host=host, port=port, log_level="warning")


def register(app_: typer.Typer) -> None:
    app_.add_typer(app, name="rm")
