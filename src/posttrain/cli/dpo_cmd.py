"""`posttrain dpo` — preference optimisation (DPO, IPO, SimPO) of the policy on the RL learner, on pairs
from a JSONL file or sampled from an environment by verifier outcome, into a run directory whose
policy/ `posttrain train` and `eval` load."""

from __future__ import annotations

import typer

from posttrain.cli.common import EXIT_USAGE, fail, source_sets
from posttrain.cli.rm_cmd import open_pair_run, prepare_pair_run, run_pairs


def dpo(
    config: str = typer.Argument(None, help="YAML config; omit for the defaults"),
    set_: list[str] = typer.Option(None, "--set", help="override, e.g. --set dpo.beta=0.1"),
    name: str = typer.Option(None, "--name", help="run name (directory under telemetry.run_dir)"),
    data: str = typer.Option(None, "--data", help="JSONL preference pairs (pairs.data)"),
    from_env: str = typer.Option(None, "--from-env", help="sample pairs from this domain (pairs.from_env)"),
    levels: str = typer.Option(None, "--levels", help="--from-env difficulties, e.g. 0,1 (pairs.levels)"),
    n: int = typer.Option(None, "--n", min=1, help="--from-env training tasks (pairs.n)"),
    loss: str = typer.Option(None, "--loss", help="dpo | ipo | simpo (dpo.loss)"),
    resume: str = typer.Option(None, "--resume", help="continue the run in this directory"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing run directory"),
    no_progress: bool = typer.Option(False, "--no-progress", help="no live progress display"),
) -> None:
    """Preference optimisation of model.spec (full or LoRA per model.lora_rank) against a frozen reference.

    Data as `posttrain rm train`: --data FILE.jsonl of {"prompt", "chosen", "rejected"} rows, or
    --from-env DOMAIN: sampled completions, a verifier success paired with a failure. The loss is
    dpo.loss with dpo.* hyperparameters; metrics log the implicit rewards of both responses, their
    margin and the pairwise accuracy, on the training batches and the held-out pairs. Online DPO:
    --set dpo.rounds=R with --from-env: after each round's steps, pairs.n new tasks are sampled from the
    policy as trained so far (their success rate logged as online/success_rate). --resume RUN_DIR goes on
    from an offline run's newest checkpoint, on its saved config and pairs."""
    from posttrain.orchestrator.offline.dpo import dpo_run

    prepared = None
    if resume:
        given = {"CONFIG": config, "--set": set_, "--name": name, "--data": data, "--from-env": from_env}
        given |= {"--levels": levels, "--n": n, "--loss": loss, "--overwrite": overwrite}
        cfg, run = open_pair_run(resume, given)
    else:
        sets = list(set_ or []) + source_sets("pairs", data, from_env, levels, n)
        if loss is not None:
            sets.append(f"dpo.loss={loss}")
        prepared = prepare_pair_run(config, sets, name, overwrite, online=True)
        cfg, run = prepared.cfg, prepared.run
    try:
        show = not no_progress and cfg.telemetry.progress
        job = dpo_run(cfg, run, show_progress=show, sampler=prepared.sampler if prepared else None)
    except (KeyError, ValueError) as err:
        fail(f"cannot start the run: {err}", EXIT_USAGE)
    run_pairs(job, prepared, "policy")


def register(app: typer.Typer) -> None:
    app.command("dpo")(dpo)
