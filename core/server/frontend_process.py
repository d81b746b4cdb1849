"""A front end's process (``brigade serve``'s supervisor spawns ``api_server_count`` of them,
``brigade.server.processes``): HTTP on the listening socket it inherits, requests to the
engine, or routed over the engine replicas (``brigade.server.data_parallel``).

It leaves the terminal's process group (signals come from the supervisor) and exits by itself
when the supervisor is gone. An engine that exits while it starts, or that it cannot reach,
makes it exit with ``EXIT_ENGINE_DEAD``; a config or model error, with ``EXIT_STARTUP_ERROR``.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from brigade.errors import EngineDeadError
from brigade.server.engine_process import freeze_startup_heap, remove_from_run_dir, watch_parent
from brigade.server.lifecycle import EXIT_ENGINE_DEAD, EXIT_STARTUP_ERROR

if TYPE_CHECKING:
    from brigade.server.engine_link import FrontendKeys
    from brigade.server.request_streams import RequestStreams

__all__ = ["run_frontend_process"]

log = structlog.get_logger("brigade.server")


def run_frontend_process(
    config_path: str | None,
    overrides: list[str],
    index: int,
    sock: socket.socket,
    addresses: list[str],
    *,
    engine_pids: list[int | None],
    parent_pid: int,
    metrics_dir: str | None = None,
    keys: FrontendKeys | None = None,
) -> None:
    """A front end's entry (``multiprocessing`` spawn target): HTTP on ``sock``, requests to
    the engine at ``addresses[0]``, or routed over the replicas at ``addresses`` (processes
    ``engine_pids`` on this machine, or remote ones, None, reached with ``keys``); its metrics
    shared with the other front ends in ``metrics_dir``, which the supervisor put in this
    process's environment (``brigade.server.metrics``)."""
    os.setpgrp()  # signals come from the supervisor, not from the terminal
    if metrics_dir is None:
        watch_parent(parent_pid)
    else:  # what the supervisor would have removed
        watch_parent(parent_pid, leave=lambda: remove_from_run_dir(Path(metrics_dir)))
    from brigade.assemble import open_model
    from brigade.config import load_config
    from brigade.errors import BrigadeError
    from brigade.models.checkpoint import require_tokenizer
    from brigade.registry import default_registry
    from brigade.server.engine_client import EngineClient
    from brigade.server.logs import configure_logging
    from brigade.server.serve import frontend_state, run_http

    configure_logging()
    structlog.contextvars.bind_contextvars(frontend=index)
    try:
        registry = default_registry()
        config = load_config(config_path, registry, overrides=overrides)
        settings = config["server"].settings
        checkpoint = open_model(config)
        require_tokenizer(checkpoint)  # read while the engine loads its weights
    except BrigadeError as exc:  # the engine says the same; one line each is enough
        print(f"brigade: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_STARTUP_ERROR)
    try:
        clients = [
            EngineClient.connect(
                address,
                engine_pid,
                frontend=index,
                max_waiting_requests=settings.max_waiting_requests,
                step_timeout_s=settings.engine_step_timeout_s,
                keys=keys,
            )
            for address, engine_pid in zip(addresses, engine_pids, strict=True)
        ]
    except EngineDeadError as exc:
        log.critical("engine_dead", reason=str(exc), exit_code=EXIT_ENGINE_DEAD)
        sys.exit(EXIT_ENGINE_DEAD)
    streams: RequestStreams = clients[0]
    if len(clients) > 1:
        from brigade.interfaces import RouterParams
        from brigade.server.data_parallel import ReplicatedEngine

        info = clients[0].info
        component = registry.get("router", config.plugin("router") or "round-robin")
        router = component.factory(
            RouterParams(len(clients), info.page_size, info.num_pages), config["router"].options
        )
        streams = ReplicatedEngine(clients, router)  # type: ignore[assignment]
    state = frontend_state(config, registry, streams, checkpoint, metrics_dir=metrics_dir)
    freeze_startup_heap()
    sys.exit(run_http(state, config, sock, announce=index == 0))
