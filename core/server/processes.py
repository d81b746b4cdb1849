"""``brigade serve`` with the engine in its own process: the supervisor and the front ends.

The process started by ``brigade serve`` binds the port, then supervises (it serves no HTTP):

- one engine process (``brigade.server.engine_process``), the ZMQ ROUTER at an ``ipc://``
  socket in a private temporary directory; with ``[router] data_parallel_size = N``, N of
  them, or, with ``[executor] distributed_executor_backend = "ray"``, N Ray actors at
  ``tcp://`` addresses protected with CURVE (``brigade.server.ray_replicas``);
- ``[server] api_server_count`` front-end processes, each a uvicorn server accepting on the
  inherited listening socket (one port, one accept queue) with an ``EngineClient``. With more
  than one, their metrics meet in a ``metrics`` folder of the run directory, so that every
  front end's ``/metrics`` answers for the whole server (``brigade.server.metrics``), their
  rate limits in a database in a ``ratelimit`` folder, so that a client's budget is the
  server's (``brigade.server.bucket_store``), and a flag per front end in shared memory says
  which are alive (``brigade.server.health``).

All are started with ``multiprocessing``'s spawn method, in their own process groups so that
a terminal's Ctrl-C reaches the supervisor alone, which forwards SIGINT/SIGTERM to the front
ends (first signal: drain, second: stop at once, as in ``brigade.server.lifecycle``), then
stops the engine once every front end has left. A front end notices the engine's death
itself (pidfd; a Ray actor's through its connection) and exits with ``EXIT_ENGINE_DEAD``
after answering 503 for a moment. A front end that dies is logged and its flag cleared; the
others go on serving (the listening socket is theirs too, so they take every new connection)
and report it in ``/health`` and ``/metrics``, and the engine aborts the dead one's requests.
Only a front end that cannot start (``EXIT_STARTUP_ERROR``) stops the others: none would.
Engine and front ends exit on their own when the supervisor disappears (Ray kills the actors
of a driver that is gone). The supervisor's exit status is the worst of its children's (1
when the engine or a front end died).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Iterator, Sequence
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import TYPE_CHECKING, Protocol

import structlog

from brigade.errors import EngineDeadError
from brigade.ray_actors import replicas_on_ray
from brigade.replica_devices import local_replica_overrides
from brigade.server.engine_process import run_engine_process
from brigade.server.frontend_process import FrontendShares, frontend_shares, run_frontend_process
from brigade.server.health import AliveFlags
from brigade.server.lifecycle import DEAD_LINGER_S, EXIT_ENGINE_DEAD, EXIT_OK, EXIT_STARTUP_ERROR
from brigade.server.metrics import MULTIPROCESS_ENV, forget_process

if TYPE_CHECKING:
    from brigade.config import EngineConfig
    from brigade.server.engine_link import FrontendKeys

__all__ = ["supervise"]

log = structlog.get_logger("brigade.server")

STOP_ENGINE_S = 10.0
"""After the front ends have left, how long the engine may take to stop before SIGKILL."""
FRONTEND_EXIT_S = DEAD_LINGER_S + 10.0
"""With the engine dead, how long the front ends may take to exit before SIGKILL."""
_WAIT_S = 0.5
_SPAWN = multiprocessing.get_context("spawn")


class EngineHandle(Protocol):
    """What the supervisor reads of an engine replica: a local process (``BaseProcess``) or
    a Ray actor's handle (``brigade.server.ray_replicas.ActorEngine``)."""

    @property
    def pid(self) -> int | None: ...
    @property
    def exitcode(self) -> int | None: ...
    @property
    def sentinel(self) -> int | None:
        """A descriptor ready when the engine exits; None: poll :attr:`exitcode`."""

    def terminate(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...
    def kill(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class Replicas:
    """The started engines and how front ends reach them, in replica order."""

    engines: Sequence[EngineHandle]
    addresses: list[str]
    pids: list[int | None]
    """Each engine's process id when it runs on this machine (watched through a pidfd)."""
    keys: FrontendKeys | None = None
    """The front ends' CURVE keys, for engines at ``tcp://`` addresses."""


def supervise(
    config_path: str | None, overrides: list[str], config: EngineConfig, sock: socket.socket
) -> int:
    """Start the engine(s) and the front ends on ``sock``; wait for them; the exit status.
    With ``[router] data_parallel_size = N`` there are N engines (replicas), and every front
    end routes over all of them."""
    settings = config["server"].settings
    rundir = tempfile.mkdtemp(prefix="brigade-")
    try:
        shared = frontend_shares(rundir, settings.api_server_count, config)
        with (
            _start_engines(config_path, overrides, config, rundir) as replicas,
            _start_frontends(
                config_path, overrides, sock, settings.api_server_count, replicas, shared
            ) as frontends,
        ):
            log.info(
                "processes_started",
                engine_pids=[engine.pid for engine in replicas.engines],
                frontend_pids=[p.pid for p in frontends],
                addresses=replicas.addresses,
                metrics_dir=shared.metrics_dir,
            )
            return Supervisor(
                replicas.engines, frontends, shared.metrics_dir, shared.frontends_alive
            ).run()
    except EngineDeadError as exc:  # a replica's Ray actor died while it loaded
        log.critical("engine_dead", reason=str(exc), exit_code=EXIT_ENGINE_DEAD)
        return EXIT_ENGINE_DEAD
    except KeyboardInterrupt:  # Ctrl-C while Ray actors load (the replicas are gone by now)
        log.info("server_stopped", exit_code=128 + signal.SIGINT)
        return 128 + signal.SIGINT
    finally:
        shutil.rmtree(rundir, ignore_errors=True)


@contextlib.contextmanager
def _start_engines(
    config_path: str | None, overrides: list[str], config: EngineConfig, rundir: str
) -> Iterator[Replicas]:
    """The replicas, started: Ray actors with ``-dp N > 1`` on the ray backend (loaded
    before this yields), else engine processes (still loading); stopped for good on leaving
    (the supervisor has stopped them in order unless something failed)."""
    num_replicas = config["router"].settings.data_parallel_size
    if num_replicas > 1 and replicas_on_ray(config):
        from brigade.server.engine_link import generate_keys
        from brigade.server.ray_replicas import actor_engines

        engine_keys, frontend_keys = generate_keys()
        with actor_engines(config_path, overrides, config, engine_keys) as actors:
            addresses = [actor.endpoint.address for actor in actors]
            yield Replicas(actors, addresses, [None] * num_replicas, frontend_keys)
        return
    addresses = [f"ipc://{rundir}/engine-{replica}" for replica in range(num_replicas)]
    devices = [local_replica_overrides(config, r, num_replicas) for r in range(num_replicas)]
    engines = [
        _SPAWN.Process(
            target=run_engine_process,
            args=(config_path, [*overrides, *devices[replica]], address, os.getpid()),
            kwargs={"replica": replica, "num_replicas": num_replicas},
            name="brigade-engine" if num_replicas == 1 else f"brigade-engine-{replica}",
        )
        for replica, address in enumerate(addresses)
    ]
    try:
        for engine in engines:
            engine.start()
        yield Replicas(engines, addresses, [engine.pid for engine in engines])
    finally:
        for engine in engines:
            if engine.is_alive():
                engine.kill()
                engine.join()


@contextlib.contextmanager
def _start_frontends(
    config_path: str | None,
    overrides: list[str],
    sock: socket.socket,
    count: int,
    replicas: Replicas,
    shared: FrontendShares,
) -> Iterator[list[BaseProcess]]:
    """``count`` front ends on ``sock`` (closed here: they hold their own
    copies), reaching ``replicas``, sharing ``shared``; any still running on leaving is
    killed (only after a failure in the supervisor itself)."""
    frontends: list[BaseProcess] = []
    try:
        # Spawn copies this environment as each front end starts, before it imports anything
        # (one front end: the variable unset, whatever the supervisor's environment says).
        with _environment(MULTIPROCESS_ENV, shared.metrics_dir):
            for index in range(count):
                frontend = _SPAWN.Process(
                    target=run_frontend_process,
                    args=(config_path, overrides, index, sock, replicas.addresses),
                    kwargs={
                        "engine_pids": replicas.pids,
                        "parent_pid": os.getpid(),
                        "metrics_dir": shared.metrics_dir,
                        "keys": replicas.keys,
                        "rate_limit_db": shared.rate_limit_db,
                        "frontends_alive": shared.frontends_alive,
                    },
                    name=f"brigade-frontend-{index}",
                )
                frontend.start()
                frontends.append(frontend)
        sock.close()
        yield frontends
    finally:
        for process in frontends:
            if process.is_alive():
                process.kill()
                process.join()


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
    rotation); the last one's exit stops the server. A front end that exits is logged and
    its flag in ``frontends_alive`` cleared while the others serve on; it leaves the shared
    metrics (``metrics_dir``) with its counts but without its gauges. The server stops when
    its last front end has exited."""

    def __init__(
        self,
        engines: Sequence[EngineHandle],
        frontends: list[BaseProcess],
        metrics_dir: str | None = None,
        frontends_alive: AliveFlags | None = None,
    ) -> None:
        self.engines = engines
        self.frontends = frontends
        self.metrics_dir = metrics_dir
        self.frontends_alive = frontends_alive
        self.exit_code = EXIT_OK
        self._stopping = False
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
        # Until every front end's exit is reported, not until each has exited: a sentinel is
        # ready a moment before its process can be reaped, and a last exit seen only by the
        # loop's condition would go unreported (its status lost).
        while len(reported) < len(self.frontends):
            sentinels = [p.sentinel for i, p in enumerate(self.frontends) if i not in reported]
            sentinels += [
                e.sentinel for e in self.engines if e.exitcode is None and e.sentinel is not None
            ]
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

    def _engine_exited(self, replica: int, engine: EngineHandle) -> None:
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
        if self.frontends_alive is not None:
            self.frontends_alive[index] = 0
        if code == EXIT_OK and self._stopping:
            return
        if code is not None and code > 0:
            self.exit_code = max(self.exit_code, code)
        else:  # killed by a signal, or gone without being asked
            self.exit_code = max(self.exit_code, EXIT_ENGINE_DEAD)
        if self._stopping or self._engines_dead():
            return
        alive = sum(process.exitcode is None for process in self.frontends)
        if code == EXIT_STARTUP_ERROR:  # its config or model: the others cannot start either
            log.critical("frontend_exited", frontend=index, exit_code=code, frontends_alive=alive)
            self._forward(signal.SIGTERM, None)
            self._kill_deadline = time.monotonic() + FRONTEND_EXIT_S
            return
        # The others serve on: the listening socket is theirs too. (With none left, the wait
        # ends and the server stops.)
        (log.error if alive else log.critical)(
            "frontend_exited",
            frontend=index,
            exit_code=code,
            frontends_alive=alive,
            frontends=len(self.frontends),
        )

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
