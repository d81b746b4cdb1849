"""``brigade serve``: assemble the engine, start the HTTP server, shut down gracefully."""

from __future__ import annotations

import logging
import math
import socket

import structlog

from brigade.assemble import open_model
from brigade.config import EngineConfig, load_config
from brigade.engine import EngineCore
from brigade.errors import BrigadeError, ConfigError
from brigade.interfaces import Checkpoint
from brigade.limits import check_machine
from brigade.models.checkpoint import require_tokenizer
from brigade.registry import Registry, default_registry
from brigade.server.app import ServerState, create_app
from brigade.server.async_engine import AsyncEngine
from brigade.server.bucket_store import SharedBuckets
from brigade.server.engine_process import freeze_startup_heap
from brigade.server.frontend import Frontend
from brigade.server.health import FrontendRoster
from brigade.server.http import GuardedH11Protocol, ThrottledWarnings
from brigade.server.lifecycle import ABORT_GRACE_S, BrigadeServer
from brigade.server.liveness import MIN_STEP_TIMEOUT_S
from brigade.server.logs import configure_logging
from brigade.server.metrics import ServerMetrics
from brigade.server.ratelimit import RateLimiter
from brigade.server.request_streams import RequestStreams
from brigade.startup import startup_banner

__all__ = ["build_state", "frontend_state", "run_http", "serve"]


def build_state(config: EngineConfig, registry: Registry) -> ServerState:
    """Load the model and every component; start the engine thread (thread mode)."""
    engine = EngineCore(config, registry)
    engine.warm_up()
    settings = config["server"].settings
    async_engine = AsyncEngine(
        engine,
        max_waiting_requests=settings.max_waiting_requests,
        step_timeout_s=settings.engine_step_timeout_s,
    )
    return frontend_state(config, registry, async_engine, engine.checkpoint)


def frontend_state(
    config: EngineConfig,
    registry: Registry,
    engine: RequestStreams,
    checkpoint: Checkpoint | None = None,
    *,
    metrics_dir: str | None = None,
    rate_limit_db: str | None = None,
    frontends: FrontendRoster | None = None,
) -> ServerState:
    """What the HTTP handlers share, over ``engine`` (a thread or a process); the tokenizer is
    read from ``checkpoint`` (opened here when not given: it reads no weights). With several
    front-end processes, ``metrics_dir`` is where their metrics meet (``ServerMetrics``),
    ``rate_limit_db`` where their rate limits do (``SharedBuckets``; None: this process's
    own), and ``frontends`` says which of them are alive."""
    settings = config["server"].settings
    checkpoint = checkpoint or open_model(config)
    tokenizer = require_tokenizer(checkpoint)
    detokenizer = registry.get("detokenizer", config.plugin("detokenizer")).factory(
        tokenizer, config["detokenizer"].options
    )
    model_name = settings.served_model_name or checkpoint.name
    speculative = config["speculative"]
    metrics = ServerMetrics(
        model_name,
        names=settings.metrics_names,
        speculative_positions=(
            0 if speculative.plugin is None else speculative.settings.num_speculative_tokens
        ),
        multiprocess_dir=metrics_dir,
        num_engines=engine.num_engines,
        num_frontends=frontends.total if frontends is not None else 1,
    )
    metrics.set_components(config.components)
    if metrics_dir is not None:
        engine.on_snapshot = metrics.observe_snapshot_gauges
    return ServerState(
        async_engine=engine,
        frontend=Frontend(engine, detokenizer, metrics),
        tokenizer=tokenizer,
        settings=settings,
        model_name=model_name,
        metrics=metrics,
        limiter=RateLimiter(
            settings.requests_per_minute,
            settings.tokens_per_minute,
            store=None if rate_limit_db is None else SharedBuckets(rate_limit_db),
        ),
        frontends=frontends or FrontendRoster(),
    )


def serve(config_path: str | None, overrides: list[str]) -> int:
    """Run the server until SIGTERM/SIGINT or until its engine dies; returns the exit status
    (see ``brigade.server.lifecycle``: 0 stopped, 1 engine dead, 128 + signal forced).

    With ``[server] engine_process`` (the default) this process supervises an engine process
    and ``api_server_count`` front-end processes (``brigade.server.processes``); otherwise it
    serves HTTP itself with the engine on a thread."""
    configure_logging()
    registry = default_registry()
    config = load_config(config_path, registry, overrides=overrides)
    settings = config["server"].settings
    if settings.api_server_count > 1 and not settings.engine_process:
        raise ConfigError(
            f"{config.source}: [server] api_server_count = {settings.api_server_count} needs "
            "[server] engine_process = true (front ends share one engine process); set "
            "api_server_count = 1 or engine_process = true"
        )
    replicas = config["router"].settings.data_parallel_size
    if replicas > 1 and not settings.engine_process:
        raise ConfigError(
            f"{config.source}: [router] data_parallel_size = {replicas} needs [server] "
            "engine_process = true (each replica is an engine process); set "
            "data_parallel_size = 1 or engine_process = true"
        )
    timeout = settings.engine_step_timeout_s
    if 0 < timeout < MIN_STEP_TIMEOUT_S:
        raise ConfigError(
            f"{config.source}: [server] engine_step_timeout_s = {timeout:g} is too short "
            "to tell a hung engine from a busy machine; use 0 (no timeout) or at least "
            f"{MIN_STEP_TIMEOUT_S:g}"
        )
    # Take the port before loading the model: a busy port fails in a second, not a minute.
    sock = _listen(settings.host, settings.port)
    try:  # processes, the model's files against its config, memory: before any process starts
        check_machine(config, registry)
    except BrigadeError:
        sock.close()
        raise
    if settings.engine_process:
        from brigade.server.processes import supervise

        freeze_startup_heap()  # the plugins' imports: its exit would walk them for ~0.6 s
        return supervise(config_path, overrides, config, sock)
    state = build_state(config, registry)
    freeze_startup_heap()
    if isinstance(state.async_engine, AsyncEngine):
        print(startup_banner(state.async_engine.engine), flush=True)
    return run_http(state, config, sock, announce=True)


def run_http(
    state: ServerState, config: EngineConfig, sock: socket.socket, *, announce: bool
) -> int:
    """Serve HTTP on ``sock`` until stopped; the exit status. ``announce``: log the engine's
    figures and print a usage example (one front end does)."""
    import uvicorn

    log = structlog.get_logger("brigade.server")
    settings = state.settings
    info = state.async_engine.info
    if announce:
        log.info(
            "engine_ready",
            components=config.components,
            model=info.model_dir,
            served_model_name=state.model_name,
            kv_pages=info.num_pages,
            page_size=info.page_size,
            kv_tokens=info.num_pages * info.page_size,
            max_model_len=info.max_model_len,
            load_time_s=round(info.load_time_s, 2),
        )
    protocol = GuardedH11Protocol.with_limits(
        header_timeout_s=settings.header_timeout_s,
        keep_alive_timeout_s=settings.keep_alive_timeout_s,
        max_connections=settings.max_connections,
    )
    server = BrigadeServer(
        uvicorn.Config(
            create_app(state),
            host=settings.host,
            port=settings.port,
            http=protocol,
            log_level="warning",
            # Brigade drains first (shutdown_timeout_s); this bounds the answers' last writes.
            timeout_graceful_shutdown=math.ceil(ABORT_GRACE_S),
            timeout_keep_alive=math.ceil(settings.keep_alive_timeout_s),
            lifespan="off",
        ),
        state,
    )
    logging.getLogger("uvicorn.error").addFilter(ThrottledWarnings())
    state.async_engine.on_dead = server.engine_died
    if state.async_engine.dead is not None:  # died before the callback was set
        server.engine_died(state.async_engine.dead)
    if announce:
        _print_example(settings.host, settings.port, state.model_name, bool(settings.api_keys))
    try:
        server.run(sockets=[sock])
    finally:
        state.async_engine.shutdown()
        state.blocking.shutdown(wait=False, cancel_futures=True)
    log.info("server_stopped", exit_code=server.exit_code)
    return server.exit_code


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
