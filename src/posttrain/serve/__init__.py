"""The OpenAI-compatible server over the engine: the app and its model registry (app.py), the wire
format (protocol.py), chat/tool rendering and parsing (chat.py), the Responses API over the chat path
(responses.py), Prometheus metrics and access logs (metrics.py), and the draining uvicorn runner with
the socket bound before model loading (server.py). Implements no inference.

    state = ServeState(ServeSettings(api_key=None, max_queue=256))
    app = create_app(state=state)
    state.add_model(ModelEntry("tiny:llama", engine, tokenizer, mode="standard"))
"""

from posttrain.serve.app import MODES, ModelEntry, ServeSettings, ServeState, create_app
from posttrain.serve.server import (
    SERVE_MODES,
    BindError,
    DrainingServer,
    ModelSource,
    bind_socket,
    load_entries,
    resolve_source,
    run_server,
)

__all__ = [
    "MODES",
    "SERVE_MODES",
    "BindError",
    "DrainingServer",
    "ModelEntry",
    "ModelSource",
    "ServeSettings",
    "ServeState",
    "bind_socket",
    "create_app",
    "load_entries",
    "resolve_source",
    "run_server",
]
