"""Running the app: the listening socket bound before anything loads (a port in use is a clear error
before minutes of loading), resolve MODEL_OR_RUN (a model spec, an HF folder, a .gguf, or a run directory whose
trained policy is exported as it is for `posttrain eval`), load it into the config's engine in the
background (the server answers 503 meanwhile), and a uvicorn server whose SIGTERM drains: new
requests get 503, in-flight ones finish, then it exits 0 (a second signal exits at once).
"""

from __future__ import annotations

import errno
import logging
import signal
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from posttrain.config import RunConfig, load_config
from posttrain.serve.app import ModelEntry, ServeState

log = logging.getLogger("posttrain.serve")


class BindError(OSError):
    """The server's address cannot be listened on; the message says which and what to do."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), as uvicorn binds it (SO_REUSEADDR: a port in TIME_WAIT is free,
    one another process listens on is not). BindError says whether the port is taken or the host wrong."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        if err.errno == errno.EADDRINUSE:
            raise BindError(
                err.errno,
                f"{where} is already in use (another process listens there); stop it or pick another --port",
            ) from None
        raise BindError(
            err.errno, f"cannot listen on {where}: {err.strerror}; check --host and --port"
        ) from None
    sock.set_inheritable(True)
    return sock


@dataclass
class ModelSource:
    spec: str  # what models/ loads
    name: str  # the name clients send as `model`
    cfg: RunConfig


def resolve_source(
    model_or_run: str, cfg: RunConfig, overrides: list[str], name: str | None = None
) -> ModelSource:
    """A run directory (holds config.yaml) serves its trained policy under its own config (plus
    `overrides`); anything else is a model spec for models/, served under `cfg`. Raises
    ModelNotFoundError / ConfigError for what does not exist or does not parse."""
    from posttrain.models import resolve

    path = Path(model_or_run).expanduser()
    if (path / "config.yaml").is_file():
        run_cfg = load_config(path / "config.yaml", overrides)
        policy = path / "policy"
        if not (policy / "config.json").is_file():
            from posttrain.orchestrator.eval.export import export_run

            export_run(path, policy)
        return ModelSource(str(policy), name or path.resolve().name, run_cfg)
    resolve(model_or_run)
    return ModelSource(model_or_run, name or model_or_run, cfg)


SERVE_MODES = ("standard", "fast", "both")


def load_entries(source: ModelSource, mode: str = "standard") -> list[ModelEntry]:
    """Load weights and tokenizer once and build the engine (`engine.backend`, the paged one by default)
    per mode: standard runs `engine` as configured, fast runs it with `serve.fast` set over it, both
    serves the two from one process as NAME and NAME-fast."""
    from posttrain.engine import make_engine
    from posttrain.longctx.rope import apply_rope_scaling
    from posttrain.models import load_policy, load_tokenizer

    if mode not in SERVE_MODES:
        raise ValueError(f"mode must be one of {', '.join(SERVE_MODES)}, got '{mode}'")
    cfg = source.cfg
    tokenizer = load_tokenizer(source.spec)
    model = apply_rope_scaling(
        load_policy(source.spec, dtype=cfg.engine.dtype, seed=cfg.seed), cfg.model.rope_scaling
    )
    wanted = [
        ("standard", source.name, cfg.engine),
        ("fast", f"{source.name}-fast", cfg.serve.fast_engine(cfg.engine)),
    ]
    if mode != "both":
        wanted = [(m, source.name, e) for m, _, e in wanted if m == mode]
    entries = []
    for m, name, engine_cfg in wanted:
        engine = make_engine(engine_cfg, model, tokenizer, seed=cfg.seed)
        max_len = getattr(engine, "max_model_len", engine_cfg.max_model_len)
        # hf and vllm refuse json_schema: their forced tool choices are prefill and prompt only
        constrained = engine_cfg.backend == "paged"
        entries.append(
            ModelEntry(name, engine, tokenizer, mode=m, max_model_len=max_len, constrained=constrained)
        )
    return entries


class DrainingServer(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT starting a drain instead of closing connections under running streams."""

    def __init__(self, config: uvicorn.Config, state: ServeState) -> None:
        super().__init__(config)
        self.serve_state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn re-raises captured signals after shutdown (the exit status would be -15); not recorded here
        if self.serve_state.status == "draining":
            log.warning("second signal %s: exiting without waiting", signal.Signals(sig).name)
            self.should_exit = self.force_exit = True
            return
        log.info(
            "signal %s: draining %d in-flight request(s)",
            signal.Signals(sig).name,
            self.serve_state.in_flight,
        )
        self.serve_state.begin_drain()

    async def on_tick(self, counter: int) -> bool:
        if self.serve_state.drained() or self.serve_state.status == "failed":
            self.should_exit = True
        return await super().on_tick(counter)


def run_server(
    app: Any,
    state: ServeState,
    sock: socket.socket,
    loader: Any = None,
    log_level: str = "info",
) -> DrainingServer:
    """Serve `app` on `sock` (from `bind_socket`) until drained; `loader()` (-> list of ModelEntry) runs
    in a thread meanwhile. Returns the server (its `serve_state.status` says whether loading failed)."""
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=False, timeout_graceful_shutdown=30
    )
    server = DrainingServer(config, state)
    if loader is not None:

        def load() -> None:
            try:
                for entry in loader():
                    state.add_model(entry)
                log.info("ready: %s", ", ".join(state.models))
            except Exception as err:
                log.exception("loading the model failed")
                state.fail(f"{type(err).__name__}: {err}")

        threading.Thread(target=load, name="posttrain-serve-load", daemon=True).start()
    server.run(sockets=[sock])
    return server
