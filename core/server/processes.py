"""``brigade serve`` with the engine in its own process: the supervisor and the front ends.

The process started by ``brigade serve`` binds the port, then supervises (it serves no HTTP):

- one engine process (``brigade.server.engine_process``), the ZMQ ROUTER at an ``ipc://``
  socket in a private temporary directory;
- ``[server] api_server_count`` front-end processes, each a uvicorn server accepting on the
  inherited listening socket (one port, one accept queue) with an ``EngineClient``. With more
  than one, their metrics meet in a ``metrics`` folder of the run directory, so that every
  front end's ``/metrics`` answers for the whole server (``brigade.server.metrics``).

All are started with ``multiprocessing``'s spawn method, in their own process groups so that
a terminal's Ctrl-C reaches the supervisor alone, which forwards SIGINT/SIGTERM to the front
ends (first signal: drain, second: stop at once, as in ``brigade.server.lifecycle``), then
stops the engine once every front end has left. A front end notices the engine's death
itself (pidfd) and exits with ``EXIT_ENGINE_DEAD`` after answering 503 for a moment; a front
end that exits unexpectedly makes the supervisor stop the others. Engine and front ends exit
on their own when the supervisor disappears. The supervisor's exit status is the worst of
its children's (1 when the engine or a front end died).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import structlog

from brigade.server.engine_process import remove_from_run_dir, run_engine_process, watch_parent
from brigade.server.lifecycle import DEAD_LINGER_S, EXIT_ENGINE_DEAD, EXIT_OK, EXIT_STARTUP_ERROR
from brigade.server.metrics import MULTIPROCESS_ENV, forget_process

if TYPE_CHECKING:
    from brigade.config import EngineConfig
    from brigade.server.request_streams import RequestStreams

__all__ = ["run_frontend_process", "supervise"]

log = structlog.get_logger("brigade.server")

STOP_ENGINE_S = 10.0
"""After the front ends have left, how long the engine may take to stop before SIGKILL."""
FRONTEND_EXIT_S = DEAD_LINGER_S + 10.0
"""With the engine dead, how long the front ends may take to exit before SIGKILL."""
_WAIT_S = 0.5


def supervise(
    config_path: str | None, overrides: list[str], config: EngineConfig, sock: socket.socket
) -> int:
    """Start the engine(s) and the front ends on ``sock``; wait for them; the exit status.
    With ``[router] data_parallel_size = N`` there are N engine processes (replicas), and
    every front end routes over all of them."""
    settings = config["server"].settings
    num_replicas = config["router"].settings.data_parallel_size
    context = multiprocessing.get_context("spawn")
    rundir = tempfile.mkdtemp(prefix="brigade-")
    addresses = [f"ipc://{rundir}/engine-{replica}" for replica in range(num_replicas)]
    metrics_dir = None  # one front end: its own registry is the server's
    if settings.api_server_count > 1:
        metrics_dir = os.path.join(rundir, "metrics")
        os.mkdir(metrics_dir)
    me = os.getpid()
    engines: list[BaseProcess] = [
        context.Process(
            target=run_engine_process,
            args=(config_path, overrides, address, me),
            kwargs={"replica": replica, "num_replicas": num_replicas},
            name="brigade-engine" if num_replicas == 1 else f"brigade-engine-{replica}",
        )
        for replica, address in enumerate(addresses)
    ]
    frontends: list[BaseProcess] = []
    try:
        for engine in engines:
            engine.start()
        pids = [engine.pid for engine in engines]
        # Spawn copies this environment as each front end starts, before it imports anything
        # (one front end: the variable unset, whatever the supervisor's environment says).
        with _environment(MULTIPROCESS_ENV, metrics_dir):
            for index in range(settings.api_server_count):
                frontend = context.Process(
                    target=run_frontend_process,
                    args=(config_path, overrides, index, sock, addresses, pids, me, metrics_dir),
                    name=f"brigade-frontend-{index}",
                )
                frontend.start()
                frontends.append(frontend)
        sock.close()  # the front ends hold their own copies
        log.info(
            "processes_started",
            engine_pids=pids,
            frontend_pids=[p.pid for p in frontends],
            addresses=addresses,
            metrics_dir=metrics_dir,
        )
        return Supervisor(engines, frontends, metrics_dir).run()
    finally:
        for process in [*frontends, *engines]:
            if process.is_alive():  # only after a failure in this function itself
                process.kill()
                process.join()
        shutil.rmtree(rundir, ignore_errors=True)


@contextlib.contextmanager
def _environment(name: str, value: str | None) -> Iterator[None]:
    """The environment variable ``name`` set to ``value`` (None: unset) inside, as before after."""
    previous = os.environ.pop(name, None)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
        if previous is not None:
            os.environ[name] = previous


class Supervisor:
    """Waits on its children's sentinels; forwards signals; decides the exit status. An
    engine replica that exits while others run is logged (the front ends take it out of
    rotation); the last one's exit stops the server. A front end that exits leaves the
    shared metrics (``metrics_dir``) with its counts but without its gauges."""

    def __init__(
        self,
        engines: list[BaseProcess],
        frontends: list[BaseProcess],
        metrics_dir: str | None = None,
    ) -> None:
        self.engines = engines
        self.frontends = frontends
        self.metrics_dir = metrics_dir
        self.exit_code = EXIT_OK
        self._stopping = False
        self._failed = False
        self._kill_deadline: float | None = None

    def run(self) -> int:
        handled = (signal.SIGINT, signal.SIGTERM)
        originals = {sig: signal.signal(sig, self._forward) for sig in handled}
        try:
            self._wait_for_frontends()
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)
        self._stop_engine()
        log.info("server_stopped", exit_code=self.exit_code)
        return self.exit_code

    def _forward(self, sig: int, frame: FrameType | None) -> None:
        self._stopping = True
        for process in self.frontends:
            if process.exitcode is None and process.pid is not None:
                os.kill(process.pid, sig)

    def _wait_for_frontends(self) -> None:
        engines_seen: set[int] = set()
        reported: set[int] = set()
        while any(p.exitcode is None for p in self.frontends):
            sentinels = [p.sentinel for p in self.frontends if p.exitcode is None]
            sentinels += [p.sentinel for p in self.engines if p.exitcode is None]
            multiprocessing.connection.wait(sentinels, timeout=_WAIT_S)
            for replica, engine in enumerate(self.engines):
                if engine.exitcode is not None and replica not in engines_seen:
                    engines_seen.add(replica)
                    self._engine_exited(replica, engine)
            for index, process in enumerate(self.frontends):
                if process.exitcode is not None and index not in reported:
                    reported.add(index)
                    if self.metrics_dir is not None and process.pid is not None:
                        forget_process(self.metrics_dir, process.pid)
                    self._frontend_exited(index, process.exitcode)
            if self._kill_deadline is not None and time.monotonic() > self._kill_deadline:
                for process in self.frontends:
                    if process.exitcode is None:
                        log.error("frontend_killed", pid=process.pid)
                        process.kill()

    def _engines_dead(self) -> bool:
        return all(engine.exitcode is not None for engine in self.engines)

    def _engine_exited(self, replica: int, engine: BaseProcess) -> None:
        code = engine.exitcode
        if self._stopping and code == 0:
            return
        # The front ends see it too (pidfd): they fail its requests; when no replica is left
        # they answer 503 and exit.
        log.critical("engine_process_exited", replica=replica, exit_code=code, pid=engine.pid)
        self.exit_code = max(
            self.exit_code, EXIT_STARTUP_ERROR if code == EXIT_STARTUP_ERROR else EXIT_ENGINE_DEAD
        )
        if code == EXIT_STARTUP_ERROR and not self._stopping:
            self._forward(signal.SIGTERM, None)  # a replica that cannot load: none will
        if self._engines_dead() or code == EXIT_STARTUP_ERROR:
            self._kill_deadline = time.monotonic() + FRONTEND_EXIT_S

    def _frontend_exited(self, index: int, code: int | None) -> None:
        if code == EXIT_OK and self._stopping:
            return
        if code is not None and code > 0:
            self.exit_code = max(self.exit_code, code)
        else:  # killed by a signal, or gone without being asked
            self.exit_code = max(self.exit_code, EXIT_ENGINE_DEAD)
        if self._stopping or self._failed or self._engines_dead():
            return
        self._failed = True
        log.critical("frontend_exited", frontend=index, exit_code=code, stopping_the_others=True)
        self._forward(signal.SIGTERM, None)
        self._kill_deadline = time.monotonic() + FRONTEND_EXIT_S

    def _stop_engine(self) -> None:
        for engine in self.engines:
            if engine.exitcode is None:
                engine.terminate()  # SIGTERM: it stops after its current step
        deadline = time.monotonic() + STOP_ENGINE_S
        for engine in self.engines:
            engine.join(max(0.0, deadline - time.monotonic()))
            if engine.exitcode is None:
                log.error("engine_killed", pid=engine.pid)
                engine.kill()
                engine.join()


def run_frontend_process(
    config_path: str | None,
    overrides: list[str],
    index: int,
    sock: socket.socket,
    addresses: list[str],
    engine_pids: list[int],
    parent_pid: int,
    metrics_dir: str | None = None,
) -> None:
    """A front end's entry (``multiprocessing`` spawn target): HTTP on ``sock``, requests to
    the engine at ``addresses[0]``, or routed over the replicas at ``addresses``; its metrics
    shared with the other front ends in ``metrics_dir``, which the supervisor put in this
    process's environment (``brigade.server.metrics``)."""
    os.setpgrp()  # signals come from the supervisor, not from the terminal
    if metrics_dir is None:
        watch_parent(parent_pid)
    else:  # what the supervisor would have removed
        watch_parent(parent_pid, leave=lambda: remove_from_run_dir(Path(metrics_dir)))
    from brigade.assemble import open_model
    from brigade.config import load_config
    from brigade.errors import BrigadeError, EngineDeadError
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
    sys.exit(run_http(state, config, sock, announce=index == 0))
