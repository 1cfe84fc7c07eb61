"""`posttrain sft` — supervised fine-tuning on a JSONL chat dataset or an environment's reference
solutions, on the RL learner, into a run directory whose policy/ `posttrain train` and `eval` load."""

from __future__ import annotations

import typer

from posttrain.cli.common import EXIT_USAGE, console, fail, load_config_or_exit, source_sets


def sft(
    config: str = typer.Argument(
        None, help="YAML config (e.g. configs/sft_tools.yaml); omit for the defaults"
    ),
    set_: list[str] = typer.Option(None, "--set", help="override, e.g. --set trainer.lr=1e-4"),
    name: str = typer.Option(None, "--name", help="run name (directory under telemetry.run_dir)"),
    data: str = typer.Option(None, "--data", help="JSONL chat dataset (sft.data)"),
    from_env: str = typer.Option(
        None, "--from-env", help="train on this domain's reference solutions (sft.from_env)"
    ),
    levels: str = typer.Option(None, "--levels", help="--from-env difficulties, e.g. 0,1 (sft.levels)"),
    n: int = typer.Option(None, "--n", min=1, help="--from-env training examples (sft.n)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing run directory"),
    no_progress: bool = typer.Option(False, "--no-progress", help="no live progress display"),
) -> None:
    """Supervised fine-tuning: loss on the assistant tokens only (full or LoRA per model.lora_rank).

    Data: --data FILE.jsonl with {"messages": [...]} rows (roles system/user/assistant/tool, assistant
    tool_calls in the OpenAI shape, optional "tools") or {"prompt": ..., "completion": ...} rows; or
    --from-env DOMAIN [--levels 0,1] [--n 200]: the domain's reference solutions replayed through its
    environment (tool results between the turns). Epochs, steps, batch size and the held-out loss
    period are sft.*; the learning rate and its schedule trainer.*."""
    from posttrain.models import ModelNotFoundError, resolve
    from posttrain.orchestrator.offline.sft import SFTDataError, SFTRun, build_examples
    from posttrain.telemetry.rundir import RunDir, check_run_name
    from posttrain.train import learner_device

    if name is not None:
        try:
            check_run_name(name)
        except ValueError as err:
            fail(f"--name: {err}", EXIT_USAGE)
    sets = list(set_ or []) + source_sets("sft", data, from_env, levels, n)
    cfg = load_config_or_exit(config, sets)
    if cfg.sft.data is None and cfg.sft.from_env is None:
        fail(
            "no SFT data: give --data FILE.jsonl or --from-env DOMAIN (or sft.data / sft.from_env)",
            EXIT_USAGE,
        )
    try:
        learner_device(cfg.trainer.device)  # before the data is built and the run folder made
    except ValueError as err:
        fail(str(err), EXIT_USAGE)
    try:
        resolve(cfg.model.spec)
        train, heldout = build_examples(cfg)
    except SFTDataError as err:
        fail(str(err), EXIT_USAGE)
    except (KeyError, ValueError, ModelNotFoundError) as err:
        fail(f"cannot build the SFT data: {err}", EXIT_USAGE)
    try:
        run = RunDir.create(cfg.telemetry.run_dir, name or cfg.telemetry.name, overwrite=overwrite)
    except (FileExistsError, ValueError) as err:
        fail(str(err), EXIT_USAGE)
    job = SFTRun(cfg, run, show_progress=not no_progress and cfg.telemetry.progress)
    try:
        job.build(train, heldout)
    except SFTDataError as err:
        fail(str(err), EXIT_USAGE)
    except (KeyError, ValueError) as err:
        fail(f"cannot start the run: {err}", EXIT_USAGE)
    summary = job.train()
    if summary["interrupted"]:
        sig = summary["signal"]
        console.print(
            f"stopped by signal {sig} at step {summary['step']}; checkpoint saved in {run.checkpoints}"
        )
        raise typer.Exit(128 + int(sig))
    last = summary["last"]
    held = ""
    if "heldout/loss" in last:
        start = summary["heldout_loss_start"]
        held = f", held-out loss {start:.3f} -> {last['heldout/loss']:.3f}"
    skipped = (
        f" ({summary['skipped_long']} longer than sft.max_seq_tokens skipped)"
        if summary["skipped_long"]
        else ""
    )
    console.print(
        f"done: {summary['step']} steps on {summary['train_examples']} examples{skipped}, "
        f"train loss {last['train/loss']:.3f}{held}; policy at {run.path / 'policy'}; metrics in {run.metrics}"
    )


def register(app: typer.Typer) -> None:
    app.command("sft")(sft)
