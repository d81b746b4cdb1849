"""The engine process: ``EngineCore``'s step loop (``brigade.server.engine_loop``) behind
a ZMQ ROUTER socket at an ``ipc://`` address of the supervisor's run directory.

The process ignores SIGINT (the supervisor decides when the engine stops), stops after its
current step on SIGTERM, and exits by itself when its parent (the supervisor) is gone.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import structlog
import torch
import zmq

from brigade.engine import EngineCore
from brigade.errors import BrigadeError
from brigade.server.engine_loop import EngineLoop
from brigade.server.lifecycle import EXIT_STARTUP_ERROR

__all__ = [
    "engine_threads",
    "freeze_startup_heap",
    "load_engine",
    "open_engine_socket",
    "remove_from_run_dir",
    "run_engine_process",
    "watch_parent",
]

PARENT_POLL_S = 0.2


def watch_parent(parent_pid: int, leave: Callable[[], None] | None = None) -> None:
    """Exit this process at once (status 1) when ``parent_pid`` is no longer its parent:
    a supervisor killed with SIGKILL must not leave an engine or a front end behind. ``leave``
    runs first, best effort: what the supervisor would have removed."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        if leave is not None:
            with contextlib.suppress(Exception):
                leave()
        os._exit(1)

    threading.Thread(target=watch, name="brigade-parent-watch", daemon=True).start()


def freeze_startup_heap() -> None:
    """Move every object alive now (the imported modules, the model, the app: ~200,000 with
    torch and transformers) out of the garbage collector's sight, as vLLM's server does. A
    full collection then no longer walks them: in an engine process it took 150-160 ms (a
    stall in every stream) and made the interpreter's exit ~0.65 s longer. Called once, when
    a server process has finished starting."""
    gc.collect()
    gc.freeze()


def remove_ipc_address(address: str) -> None:
    """Unlink an ``ipc://`` address's socket file, and its folder once empty when it is the
    supervisor's private run directory (``brigade-*``)."""
    if address.startswith("ipc://"):
        remove_from_run_dir(Path(address.removeprefix("ipc://")))


def remove_from_run_dir(path: Path) -> None:
    """Remove a file or folder, then its folder once empty when that is the supervisor's
    private run directory (``brigade-*``). Every child that leaves behind a dead supervisor
    removes what it owned this way: whichever leaves last removes the run directory."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    if path.parent.name.startswith("brigade-"):
        with contextlib.suppress(OSError):  # another child's part is still there
            path.parent.rmdir()


def engine_threads(num_replicas: int = 1) -> int:
    """torch's CPU threads in an engine process: the cores this process may use, shared out
    among the replicas. The front ends are not given a core of their own: on SmolLM2 with 128
    streams on 2 cores, an engine on 1 thread served 0.58x the tok/s of one on 2, and
    0.64x the thread mode's (benchmarks/serving.py); only on a 2-layer random model, where
    the front ends' work outweighs the model's, did the spare core pay."""
    return max(1, len(os.sched_getaffinity(0)) // num_replicas)


def run_engine_process(
    config_path: str | None,
    overrides: list[str],
    address: str,
    parent_pid: int,
    *,
    replica: int = 0,
    num_replicas: int = 1,
) -> None:
    """The engine process's entry (``multiprocessing`` spawn target); ``replica`` of
    ``num_replicas`` data-parallel replicas (each one engine)."""
    os.setpgrp()  # a terminal's Ctrl-C reaches the supervisor only; it stops us in order
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch_parent(parent_pid, leave=lambda: remove_ipc_address(address))
    from brigade.server.logs import configure_logging

    configure_logging()
    try:
        engine = load_engine(
            config_path,
            overrides,
            replica=replica,
            num_replicas=num_replicas,
            threads=engine_threads(num_replicas),
        )
    except BrigadeError as exc:  # the model or the config: what the CLI says for it, and 2
        print(f"brigade: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_STARTUP_ERROR)
    freeze_startup_heap()
    context = zmq.Context()
    socket = open_engine_socket(context)
    socket.bind(address)
    loop = EngineLoop(engine, socket)
    signal.signal(signal.SIGTERM, lambda sig, frame: loop.stop())
    try:
        code = loop.run()
    finally:
        socket.close()
        context.term()
    sys.exit(code)


def load_engine(
    config_path: str | None,
    overrides: list[str],
    *,
    replica: int,
    num_replicas: int,
    threads: int,
) -> EngineCore:
    """Replica ``replica`` of ``num_replicas``'s engine, torch on ``threads`` CPU threads (an
    executor's own ``num_threads`` option still wins), its banner printed; ``BrigadeError``
    for the config or the model."""
    from brigade.config import load_config
    from brigade.registry import default_registry
    from brigade.startup import startup_banner

    if num_replicas > 1:
        structlog.contextvars.bind_contextvars(replica=replica)
        overrides = [*overrides, "router.data_parallel_size=1"]  # this process is one of them
    registry = default_registry()
    config = load_config(config_path, registry, overrides=overrides)
    torch.set_num_threads(threads)
    engine = EngineCore(config, registry)
    print(startup_banner(engine), flush=True)
    return engine


def open_engine_socket(context: zmq.Context[zmq.Socket[bytes]]) -> zmq.Socket[bytes]:
    """The engine's ROUTER, not yet bound: it never drops a step's updates for a slow front
    end, drops what is unsent when it closes, and refuses a message for a front end that is
    gone (``EHOSTUNREACH``: ``EngineLoop`` then aborts that front end's requests)."""
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.LINGER, 0)
    return socket
