"""A front end's process (``brigade serve``'s supervisor spawns ``api_server_count`` of them,
``brigade.server.processes``): HTTP on the listening socket it inherits, requests to the
engine, or routed over the engine replicas (``brigade.server.data_parallel``).

It leaves the terminal's process group (signals come from the supervisor) and exits by itself
when the supervisor is gone. An engine that exits while it starts, or that it cannot reach,
makes it exit with ``EXIT_ENGINE_DEAD``; a config or model error, with ``EXIT_STARTUP_ERROR``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import multiprocessing.sharedctypes
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from brigade.errors import EngineDeadError
from brigade.server.bucket_store import SharedBuckets
from brigade.server.engine_process import freeze_startup_heap, remove_from_run_dir, watch_parent
from brigade.server.health import AliveFlags, FrontendRoster
from brigade.server.lifecycle import EXIT_ENGINE_DEAD, EXIT_STARTUP_ERROR

if TYPE_CHECKING:
    from brigade.config import EngineConfig
    from brigade.interfaces import Checkpoint
    from brigade.registry import Registry
    from brigade.server.engine_client import EngineClient
    from brigade.server.engine_link import FrontendKeys
    from brigade.server.request_streams import RequestStreams

__all__ = ["FrontendShares", "frontend_shares", "run_frontend_process"]

log = structlog.get_logger("brigade.server")


@dataclasses.dataclass(frozen=True)
class FrontendShares:
    """What the front ends of one server share (all None with a single front end: its own
    registry, limiter and liveness are the server's)."""

    metrics_dir: str | None = None
    """Where their metrics meet (``brigade.server.metrics``)."""
    rate_limit_db: str | None = None
    """The rate limiter's database, when a limit is on (``SharedBuckets``)."""
    frontends_alive: AliveFlags | None = None
    """One flag per front end; the supervisor clears a front end's when it exits."""


def frontend_shares(rundir: str, count: int, config: EngineConfig) -> FrontendShares:
    """What ``count`` front ends of one server share, made in its run directory ``rundir``
    (before they start)."""
    if count == 1:
        return FrontendShares()
    settings = config["server"].settings
    metrics_dir = os.path.join(rundir, "metrics")
    os.mkdir(metrics_dir)
    rate_limit_db = None
    if settings.requests_per_minute or settings.tokens_per_minute:
        os.mkdir(os.path.join(rundir, "ratelimit"))
        rate_limit_db = os.path.join(rundir, "ratelimit", "buckets.sqlite")
        SharedBuckets.create(rate_limit_db)
    alive = multiprocessing.sharedctypes.RawArray(ctypes.c_byte, [1] * count)
    return FrontendShares(metrics_dir, rate_limit_db, alive)


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
    rate_limit_db: str | None = None,
    frontends_alive: AliveFlags | None = None,
) -> None:
    """A front end's entry (``multiprocessing`` spawn target): HTTP on ``sock``, requests to
    the engine at ``addresses[0]``, or routed over the replicas at ``addresses`` (processes
    ``engine_pids`` on this machine, or remote ones, None, reached with ``keys``); its metrics
    shared with the other front ends in ``metrics_dir``, which the supervisor put in this
    process's environment (``brigade.server.metrics``), its rate limits in the database
    ``rate_limit_db`` (``brigade.server.bucket_store``); ``frontends_alive``: one flag per
    front end, which the supervisor clears when that one exits (``brigade.server.health``)."""
    os.setpgrp()  # signals come from the supervisor, not from the terminal
    _exit_with_supervisor(parent_pid, metrics_dir, rate_limit_db)
    from brigade.server.logs import configure_logging
    from brigade.server.serve import frontend_state, run_http

    configure_logging()
    structlog.contextvars.bind_contextvars(frontend=index)
    registry, config, checkpoint = _open_model_or_exit(config_path, overrides)
    clients = _connect_or_exit(config, index, addresses, engine_pids, keys)
    state = frontend_state(
        config,
        registry,
        _routed(clients, registry, config),
        checkpoint,
        metrics_dir=metrics_dir,
        rate_limit_db=rate_limit_db,
        frontends=None if frontends_alive is None else FrontendRoster(frontends_alive),
    )
    freeze_startup_heap()
    sys.exit(run_http(state, config, sock, announce=index == 0))


def _exit_with_supervisor(
    parent_pid: int, metrics_dir: str | None, rate_limit_db: str | None
) -> None:
    """Exit when the supervisor is gone, removing what it would have removed, were it killed:
    the shared folders."""
    shared = [Path(metrics_dir)] if metrics_dir is not None else []
    if rate_limit_db is not None:
        shared.append(Path(rate_limit_db).parent)
    watch_parent(parent_pid, leave=lambda: _remove_all(shared))


def _open_model_or_exit(
    config_path: str | None, overrides: list[str]
) -> tuple[Registry, EngineConfig, Checkpoint]:
    """The plugins, the config and the model's checkpoint (its tokenizer checked), or exit
    with ``EXIT_STARTUP_ERROR`` on a config or model error."""
    from brigade.assemble import open_model
    from brigade.config import load_config
    from brigade.errors import BrigadeError
    from brigade.models.checkpoint import require_tokenizer
    from brigade.registry import default_registry

    try:
        registry = default_registry()
        config = load_config(config_path, registry, overrides=overrides)
        checkpoint = open_model(config)
        require_tokenizer(checkpoint)  # read while the engine loads its weights
    except BrigadeError as exc:  # the engine says the same; one line each is enough
        print(f"brigade: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_STARTUP_ERROR)
    return registry, config, checkpoint


def _connect_or_exit(
    config: EngineConfig,
    index: int,
    addresses: Sequence[str],
    engine_pids: Sequence[int | None],
    keys: FrontendKeys | None,
) -> list[EngineClient]:
    """Front end ``index``'s link to each engine, or exit with ``EXIT_ENGINE_DEAD`` when one
    is gone or cannot be reached."""
    from brigade.server.engine_client import EngineClient

    settings = config["server"].settings
    try:
        return [
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


def _routed(
    clients: list[EngineClient], registry: Registry, config: EngineConfig
) -> RequestStreams:
    """The one engine, or the replicas behind the configured router."""
    if len(clients) == 1:
        return clients[0]
    from brigade.interfaces import RouterParams
    from brigade.server.data_parallel import ReplicatedEngine

    info = clients[0].info
    component = registry.get("router", config.plugin("router") or "round-robin")
    router = component.factory(
        RouterParams(len(clients), info.page_size, info.num_pages), config["router"].options
    )
    return ReplicatedEngine(clients, router)  # type: ignore[return-value]


def _remove_all(paths: Sequence[Path]) -> None:
    for path in paths:
        remove_from_run_dir(path)
