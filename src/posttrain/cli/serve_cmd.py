"""`posttrain serve MODEL_OR_RUN`: an OpenAI-compatible API over the engine (posttrain.serve)."""

from __future__ import annotations

import logging

import typer

from posttrain.cli.common import EXIT_RUNTIME, EXIT_USAGE, fail, load_config_or_exit


def serve(
    model: str = typer.Argument(
        ..., metavar="MODEL_OR_RUN", help="model spec, HF folder, .gguf or run directory"
    ),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port", min=0, max=65535),
    api_key: str = typer.Option(
        None, "--api-key", envvar="POSTTRAIN_API_KEY", help="require `Authorization: Bearer KEY` on /v1/*"
    ),
    max_queue: int = typer.Option(256, "--max-queue", min=0, help="requests waiting for a slot before 429"),
    max_running: int = typer.Option(
        None, "--max-running", min=1, help="requests in the engine at once (default: engine.max_num_seqs)"
    ),
    mode: str = typer.Option(
        "standard",
        "--mode",
        help="standard (engine as configured), fast (serve.fast over it: int4 weights, an int8 head, "
        "prompt-lookup speculation by default), or both (NAME and NAME-fast from one process)",
    ),
    name: str = typer.Option(
        None, "--served-model-name", help="the `model` clients send (default: MODEL_OR_RUN)"
    ),
    default_max_tokens: int = typer.Option(
        None,
        "--default-max-tokens",
        min=1,
        help="max_tokens when a request gives none (default: the rest of the context)",
    ),
    max_body_mb: float = typer.Option(4.0, "--max-body-mb", min=0.001, help="largest request body accepted"),
    config: str = typer.Option(None, "--config", help="config for the engine when MODEL_OR_RUN is not a run"),
    set_: list[str] = typer.Option(None, "--set", help="config override, e.g. engine.max_model_len=2048"),
    log_level: str = typer.Option("info", "--log-level"),
) -> None:
    """Serve a model behind an OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/models,
    /health, /metrics. SIGTERM drains in-flight requests, then exits 0."""
    from posttrain.config import ConfigError
    from posttrain.models import ModelNotFoundError
    from posttrain.serve import (
        SERVE_MODES,
        BindError,
        ServeSettings,
        ServeState,
        bind_socket,
        create_app,
        load_entries,
        resolve_source,
        run_server,
    )

    if mode not in SERVE_MODES:
        fail(f"--mode must be one of {', '.join(SERVE_MODES)}, got '{mode}'", EXIT_USAGE)
    cfg = load_config_or_exit(config, set_)
    try:  # before anything loads: a taken port is found in a second, not after the model
        sock = bind_socket(host, port)
    except BindError as err:
        fail(str(err.strerror), EXIT_RUNTIME)
    try:
        source = resolve_source(model, cfg, set_ or [], name)
    except (ModelNotFoundError, ConfigError) as err:
        fail(str(err), EXIT_USAGE)
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO), format="%(message)s")
    settings = ServeSettings(
        api_key=api_key,
        max_queue=max_queue,
        max_running=max_running or source.cfg.engine.max_num_seqs,
        max_body_bytes=int(max_body_mb * 1024 * 1024),
        default_max_tokens=default_max_tokens,
    )
    state = ServeState(settings)
    server = run_server(create_app(state=state), state, sock, lambda: load_entries(source, mode), log_level)
    if state.status == "failed":
        fail(f"serving stopped: {state.error}", EXIT_RUNTIME)
    if not server.started:
        fail(f"the server did not start on {host}:{port} (see the log above)", EXIT_RUNTIME)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
