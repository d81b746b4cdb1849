"""Tensor-parallel ranks as Ray actors (``[executor] distributed_executor_backend = "ray"``).

Rank 0 stays in the engine's process. Ranks 1..N-1 are actors, one per bundle of a placement
group (``PACK``: on as few nodes as fit; a bundle is one CPU, or one GPU and one CPU on CUDA).
Each actor connects back to rank 0 over TCP (``multiprocessing.connection`` with a random
key), says which rank it is, then runs the same ``tp_worker.run_rank`` loop a spawned process
runs: rank 0's messages and the ranks' replies travel exactly as over a
pipe, so nothing else in the executor knows the difference. The rendezvous store and the
collectives use each node's address as Ray reports it.

Ray is an extra (``pip install 'brigade-llm[ray]'``); ``RAY_ADDRESS`` names the cluster,
else Ray starts a local one for this process. ``stop`` kills every actor and removes the
placement group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from brigade.interfaces import ConfigError
from brigade.plugins.executors.tp_ranks import RankLauncher, RankSpec, poll_connections

__all__ = ["RayLauncher"]

PLACEMENT_TIMEOUT_S = 120.0
"""How long the ranks' placement group may wait for free CPUs or GPUs on the cluster."""


class RayLauncher(RankLauncher):
    """Ranks 1..N-1 as Ray actors in a placement group (see the module docstring)."""

    def __init__(self) -> None:
        try:
            import ray
        except ImportError:
            raise ConfigError(
                '[executor] distributed_executor_backend = "ray" needs Ray: pip install '
                "'brigade-llm[ray]' (or use \"mp\": processes on this machine)"
            ) from None
        self._ray = ray
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init(log_to_driver=False)  # RAY_ADDRESS names a cluster; without it, a local one
        self.host = ray.util.get_node_ip_address()
        self.connections: list[Connection] = []
        """Rank k's connection at index k - 1, once every rank has connected."""
        self._arrived: dict[int, Connection] = {}
        self._actors: list[Any] = []
        self._runs: dict[Any, int] = {}
        """Each actor's running ``serve`` call -> its rank; the call ends when the rank does."""
        self._group: Any = None
        self._listener: Listener | None = None
        self._accepting: threading.Thread | None = None

    def start(self, specs: list[RankSpec]) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        authkey = os.urandom(16)
        self._listener = Listener((self.host, 0), authkey=authkey)
        self._accepting = threading.Thread(
            target=self._accept, args=(len(specs),), name="brigade-tp-accept", daemon=True
        )
        self._accepting.start()
        gpus = 1 if specs and specs[0].backend == "nccl" else 0
        bundle = {"CPU": 1, "GPU": gpus} if gpus else {"CPU": 1}
        self._group = placement_group([bundle] * len(specs), strategy="PACK")
        self._ray.get(self._group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        actor_class: Any = self._ray.remote(_RankActor)
        for index, spec in enumerate(specs):
            strategy = PlacementGroupSchedulingStrategy(
                self._group, placement_group_bundle_index=index
            )
            actor = actor_class.options(
                num_cpus=1, num_gpus=gpus, scheduling_strategy=strategy
            ).remote()
            self._actors.append(actor)
            self._runs[actor.serve.remote(spec, self._listener.address, authkey)] = spec.rank

    def _accept(self, count: int) -> None:
        """Take each rank's connection as it comes; a rank names itself first."""
        listener = self._listener
        while listener is not None and len(self._arrived) < count:
            try:
                connection = listener.accept()
                rank = pickle.loads(connection.recv_bytes())
            except (OSError, EOFError):  # closed by stop(), or a rank died while connecting
                return
            self._arrived[rank] = connection
            if len(self._arrived) == count:
                self.connections = [self._arrived[r] for r in sorted(self._arrived)]

    def send(self, message: bytes) -> None:
        if len(self.connections) != len(self._runs):
            raise BrokenPipeError("not every tensor-parallel rank has connected")
        for connection in self.connections:
            connection.send_bytes(message)

    def poll(self, timeout_s: float) -> list[tuple[int, Any]]:
        if len(self.connections) == len(self._runs):
            return poll_connections(self.connections, timeout_s)
        time.sleep(min(timeout_s, 0.05))  # still connecting: their "hello" comes after
        return []

    def dead(self) -> str | None:
        if not self._runs:
            return None
        ended, _ = self._ray.wait(list(self._runs), num_returns=1, timeout=0)
        for run in ended:
            rank = self._runs[run]
            try:
                self._ray.get(run)
            except self._ray.exceptions.RayError as error:
                return f"tensor-parallel rank {rank} (a Ray actor) failed: {error}"
            return f"tensor-parallel rank {rank} (a Ray actor) exited"
        return None

    def stop(self, timeout_s: float) -> None:
        from ray.util.placement_group import remove_placement_group

        for connection in self.connections:
            with contextlib.suppress(OSError):
                connection.send_bytes(pickle.dumps(("shutdown", ())))
        if self._runs:
            self._ray.wait(list(self._runs), num_returns=len(self._runs), timeout=timeout_s)
        for actor in self._actors:
            self._ray.kill(actor)
        if self._group is not None:
            remove_placement_group(self._group)
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        for connection in [*self.connections, *self._arrived.values()]:
            connection.close()
        self.connections, self._arrived, self._actors, self._runs = [], {}, [], {}
        self._group = None
        if self._started_ray:
            self._ray.shutdown()
            self._started_ray = False


class _RankActor:
    """A rank's host in Ray (wrapped by ``ray.remote`` in :meth:`RayLauncher.start`)."""

    def serve(self, spec: RankSpec, address: Any, authkey: bytes) -> None:
        """Connect to rank 0, then run the rank until it is told to stop."""
        import ray

        from brigade.plugins.executors.tp_worker import run_rank

        if spec.backend == "nccl":  # Ray shows the actor its one GPU as device 0
            spec = dataclasses.replace(
                spec, options=dataclasses.replace(spec.options, device="cuda:0")
            )
        connection = Client(address, authkey=authkey)
        connection.send_bytes(pickle.dumps(spec.rank))
        run_rank(spec, connection, ray.util.get_node_ip_address())
