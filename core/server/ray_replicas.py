"""``brigade serve -dp N`` with ``[executor] distributed_executor_backend = "ray"``: the
engine replicas as Ray actors, one per bundle of a placement group spread over the cluster's
nodes (``brigade.ray_actors.spread_actors``, as ``brigade generate -dp N`` places its own).

The supervisor (``brigade.server.processes``) generates the run's CURVE keys, then each actor
loads its engine (``load_engine``, as an engine process does) and binds its ZMQ ROUTER on
``tcp://<its node's address>:<a free port>``, admitting only the front ends' key
(``brigade.server.engine_link``), and returns that address. Only then are the front ends
started, on those addresses; each actor's ``run`` call is the engine loop
(``brigade.server.engine_loop``): it returns when asked to stop, and fails when the actor or
its node dies, which the supervisor reads as an engine's exit (:class:`ActorEngine`).

Leaving :func:`actor_engines` kills every actor, removes the placement group and shuts Ray
down if the supervisor started it. A supervisor killed outright leaves nothing either: Ray
kills the actors and removes the group of a driver that is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import structlog
import zmq
from zmq.auth.thread import ThreadAuthenticator

from brigade.errors import BrigadeError, EngineDeadError
from brigade.ray_actors import require_ray, spread_actors
from brigade.replica_devices import ray_replica_gpus, ray_replica_overrides
from brigade.server.engine_link import EngineKeys, bind_tcp, secure_engine_socket
from brigade.server.engine_loop import EngineLoop
from brigade.server.engine_process import engine_threads, load_engine, open_engine_socket
from brigade.server.lifecycle import EXIT_ENGINE_DEAD

if TYPE_CHECKING:
    from brigade.config import EngineConfig

__all__ = ["ActorEngine", "EngineActor", "ReplicaEndpoint", "actor_engines"]

log = structlog.get_logger("brigade.server")


@dataclasses.dataclass(frozen=True)
class ReplicaEndpoint:
    """Where a replica's actor serves: what its ``start`` returns."""

    address: str
    """``tcp://host:port`` on the actor's node."""
    pid: int
    """The actor's process id, on its node."""
    node: str
    """The Ray node's id."""


class EngineActor:
    """One replica's engine in a Ray actor (made remote by :func:`actor_engines`, with room
    for two calls at once: ``stop`` arrives while ``run`` runs)."""

    def __init__(self) -> None:
        self._loop: EngineLoop | None = None
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._authenticator: ThreadAuthenticator | None = None

    def start(
        self,
        config_path: str | None,
        overrides: list[str],
        replica: int,
        num_replicas: int,
        threads: int,
        keys: EngineKeys,
    ) -> ReplicaEndpoint | str:
        """Load the engine and bind its socket: where the front ends reach it, or why it
        could not start (the config or the model, as ``brigade: error`` would say)."""
        import ray

        from brigade.server.logs import configure_logging

        configure_logging()
        try:
            engine = load_engine(
                config_path,
                overrides,
                replica=replica,
                num_replicas=num_replicas,
                threads=threads,
            )
        except BrigadeError as exc:
            return str(exc)
        self._context = zmq.Context()
        socket = open_engine_socket(self._context)
        self._authenticator = secure_engine_socket(self._context, socket, keys)
        address = bind_tcp(socket, ray.util.get_node_ip_address())
        self._loop = EngineLoop(engine, socket)
        return ReplicaEndpoint(address, os.getpid(), ray.get_runtime_context().get_node_id())

    def run(self) -> int:
        """Serve until :meth:`stop` (0) or until the engine dies (1)."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("EngineActor.run before a successful start")
        try:
            return loop.run()
        finally:
            loop.socket.close()
            if self._authenticator is not None:
                self._authenticator.stop()
            if self._context is not None:
                self._context.term()

    def stop(self) -> None:
        """Stop after the current step."""
        if self._loop is not None:
            self._loop.stop()


class ActorEngine:
    """The supervisor's handle on one replica's actor, read as it reads an engine process:
    :attr:`exitcode` is None while ``run`` runs, then its result (0: stopped when asked), or
    ``EXIT_ENGINE_DEAD`` when the actor or its node died. No :attr:`sentinel` to wait on: the
    supervisor looks again every half second."""

    sentinel: int | None = None

    def __init__(self, actor: Any, replica: int, endpoint: ReplicaEndpoint) -> None:
        self._ray = require_ray()
        self.actor = actor
        self.replica = replica
        self.endpoint = endpoint
        self.pid: int | None = endpoint.pid
        self._run = actor.run.remote()
        self._exitcode: int | None = None

    @property
    def exitcode(self) -> int | None:
        if self._exitcode is None:
            ended, _ = self._ray.wait([self._run], timeout=0)
            if ended:
                self._exitcode = self._result()
        return self._exitcode

    def _result(self) -> int:
        try:
            return int(self._ray.get(self._run))
        except self._ray.exceptions.RayError as exc:
            log.critical(
                "engine_actor_failed",
                replica=self.replica,
                node=self.endpoint.node,
                reason=_first_line(exc),
            )
            return EXIT_ENGINE_DEAD

    def terminate(self) -> None:
        """Ask the engine to stop after its current step."""
        self.actor.stop.remote()

    def join(self, timeout: float | None = None) -> None:
        self._ray.wait([self._run], timeout=timeout)

    def kill(self) -> None:
        self._ray.kill(self.actor)
        if self._exitcode is None:
            self._exitcode = -signal.SIGKILL


@contextlib.contextmanager
def actor_engines(
    config_path: str | None, overrides: list[str], config: EngineConfig, keys: EngineKeys
) -> Iterator[list[ActorEngine]]:
    """``config``'s ``[router] data_parallel_size`` engines in Ray actors (one GPU each on
    CUDA), loaded, bound and running, in replica order; gone, with their placement group, on
    leaving. ``BrigadeError`` when a replica cannot load (the config or the model);
    ``EngineDeadError`` when an actor dies while starting."""
    ray = require_ray()
    num_replicas = config["router"].settings.data_parallel_size
    threads = engine_threads(num_replicas)  # this machine's share, asked of every node
    overrides = [*overrides, *ray_replica_overrides(config)]
    with spread_actors(
        EngineActor,
        [threads] * num_replicas,
        gpus=lambda cluster_gpus: ray_replica_gpus(config, num_replicas, cluster_gpus),
        max_concurrency=2,
    ) as actors:
        starts = [
            actor.start.remote(config_path, overrides, replica, num_replicas, threads, keys)
            for replica, actor in enumerate(actors)
        ]
        endpoints: list[ReplicaEndpoint] = []
        for replica, start in enumerate(starts):
            try:
                result = ray.get(start)
            except ray.exceptions.RayTaskError as exc:  # it raised: the same on every try
                raise BrigadeError(
                    f"replica {replica} could not start in its Ray actor: "
                    f"{type(exc.cause).__name__}: {exc.cause}"
                ) from None
            except ray.exceptions.RayError as exc:  # the actor or its node died
                raise EngineDeadError(
                    f"replica {replica}'s Ray actor died while starting: {_first_line(exc)}"
                ) from None
            if isinstance(result, str):
                raise BrigadeError(result)
            endpoints.append(result)
        engines = [
            ActorEngine(actor, replica, endpoint)
            for replica, (actor, endpoint) in enumerate(zip(actors, endpoints, strict=True))
        ]
        log.info(
            "engine_actors_started",
            addresses=[e.address for e in endpoints],
            nodes=[e.node for e in endpoints],
            pids=[e.pid for e in endpoints],
        )
        yield engines


def _first_line(error: BaseException) -> str:
    """Ray's errors carry a traceback and advice after their first line."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
