"""``brigade serve``: assemble the engine, start the HTTP server, shut down gracefully."""

from __future__ import annotations

import signal
import socket
from typing import Any

import structlog

from brigade.config import EngineConfig, load_config
from brigade.engine import EngineCore
from brigade.errors import BrigadeError
from brigade.models.checkpoint import require_tokenizer
from brigade.registry import Registry, default_registry
from brigade.server.app import ServerState, create_app
from brigade.server.async_engine import AsyncEngine
from brigade.server.frontend import Frontend
from brigade.server.logs import configure_logging
from brigade.server.metrics import ServerMetrics
from brigade.server.ratelimit import RateLimiter
from brigade.startup import startup_banner

__all__ = ["build_state", "serve"]


def build_state(config: EngineConfig, registry: Registry) -> ServerState:
    """Load the model and every component; start the engine thread."""
    settings = config["server"].settings
    engine = EngineCore(config, registry)
    tokenizer = require_tokenizer(engine.checkpoint)
    detokenizer = registry.get("detokenizer", config.plugin("detokenizer")).factory(
        tokenizer, config["detokenizer"].options
    )
    model_name = settings.served_model_name or engine.checkpoint.name
    metrics = ServerMetrics(model_name)
    metrics.set_components(config.components)
    async_engine = AsyncEngine(engine, max_waiting_requests=settings.max_waiting_requests)
    return ServerState(
        async_engine=async_engine,
        frontend=Frontend(async_engine, detokenizer, metrics),
        tokenizer=tokenizer,
        settings=settings,
        model_name=model_name,
        metrics=metrics,
        limiter=RateLimiter(settings.requests_per_minute, settings.tokens_per_minute),
    )


def serve(config_path: str | None, overrides: list[str]) -> int:
    """Run the server until SIGTERM/SIGINT; running requests get ``shutdown_timeout_s``."""
    import uvicorn

    configure_logging()
    log = structlog.get_logger("brigade.server")
    registry = default_registry()
    config = load_config(config_path, registry, overrides=overrides)
    # Take the port before loading the model: a busy port fails in a second, not a minute.
    sock = _listen(config["server"].settings.host, config["server"].settings.port)
    state = build_state(config, registry)
    settings = state.settings
    engine = state.async_engine.engine
    kv = engine.kv.stats()
    log.info(
        "engine_ready",
        components=config.components,
        model=str(engine.model_dir),
        served_model_name=state.model_name,
        kv_pages=kv.num_pages,
        page_size=engine.batch.page_size,
        kv_tokens=kv.num_pages * engine.batch.page_size,
        max_model_len=engine.max_model_len,
        load_time_s=round(engine.load_time_s, 2),
    )
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(state),
            host=settings.host,
            port=settings.port,
            log_level="warning",
            timeout_graceful_shutdown=int(settings.shutdown_timeout_s) or None,
            lifespan="off",
        )
    )
    print(startup_banner(engine), flush=True)
    _print_example(settings.host, settings.port, state.model_name, bool(settings.api_keys))

    original = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: Any) -> None:
        state.shutting_down = True  # /health turns 503, new requests are refused
        log.info("shutdown_requested", signal=signum)
        server.handle_exit(signum, frame)

    signal.signal(signal.SIGTERM, on_term)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, original)
        state.async_engine.shutdown()
        log.info("server_stopped")
    return 0


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise BrigadeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def _print_example(host: str, port: int, model: str, auth: bool) -> None:
    key = ' -H "Authorization: Bearer $BRIGADE_API_KEY"' if auth else ""
    print(
        f"Brigade is serving {model!r} on http://{host}:{port}  (Ctrl-C to stop)\n"
        f"  curl http://{host}:{port}/v1/chat/completions{key} -H 'Content-Type: "
        f"application/json' \\\n"
        f'    -d \'{{"model": "{model}", "messages": [{{"role": "user", "content": '
        f'"Hello!"}}], "max_tokens": 32}}\'',
        flush=True,
    )
