"""The ranks of a tensor-parallel executor beyond rank 0, and the commands rank 0 sends them.

Rank 0 is the engine's own executor. It starts ranks 1..N-1 through a :class:`RankLauncher`
and, before each of its own calls that runs the model (``initialize_kv_cache``, ``execute``,
``execute_with_hidden_states``, ``copy_pages``), sends every rank the same call; then all ranks
run it in lockstep, meeting in the collectives inside the model
(``brigade.plugins.models.parallel``). Only rank 0 returns results, so nothing comes back
per step.

Commands travel over one pipe per rank as pickled bytes rather than as a broadcast in the
process group: a rank waits for its next command with no collective pending, so an engine
idle for hours hits no collective timeout, and a rank notices rank 0's exit (end of file)
without one. Host tensors are pickled as numpy arrays (:func:`encode`): a decode step's
``ModelInput`` then costs about 70 us to encode and decode instead of 700 us.

:class:`ProcessLauncher` runs the ranks as spawned processes on this machine; a Ray backend
would implement the same interface with actors.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import datetime
import io
import multiprocessing
import pickle
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from brigade.interfaces import ExecutorParams
    from brigade.plugins.executors.torch_executor import TorchExecutorOptions

__all__ = [
    "COLLECTIVE_TIMEOUT",
    "ProcessLauncher",
    "RankGroup",
    "RankLauncher",
    "RankSpec",
    "encode",
    "join_group",
    "poll_connections",
]

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)
"""How long a collective waits for a rank that neither answers nor dies (a rank that dies is
noticed at once: its sockets close)."""
START_TIMEOUT_S = 600.0
"""How long rank 0 waits for a rank to load its shard."""


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """What a rank needs to build its shard (picklable: it crosses to the rank's process)."""

    rank: int
    world_size: int
    store_port: int
    """Port of rank 0's rendezvous store on 127.0.0.1."""
    backend: str
    """``gloo`` (CPU) or ``nccl`` (CUDA)."""
    params: ExecutorParams
    """Rank 0's; the checkpoint pickles as the files to reopen (the rank reads only its
    slices of the weights)."""
    options: TorchExecutorOptions
    """Rank 0's options with this rank's ``device``."""
    store_host: str = "127.0.0.1"
    """Address of rank 0's rendezvous store (its node's, when ranks run on other nodes)."""


class RankLauncher(abc.ABC):
    """Starts ranks 1..N-1 and carries rank 0's messages to them; knows whether they live."""

    host: str = "127.0.0.1"
    """The address the other ranks reach rank 0 at (its rendezvous store, its collectives)."""

    @abc.abstractmethod
    def start(self, specs: list[RankSpec]) -> None:
        """Start one rank per spec; returns without waiting for them."""

    @abc.abstractmethod
    def send(self, message: bytes) -> None:
        """Hand ``message`` to every rank, in order (``BrokenPipeError`` if one is gone)."""

    @abc.abstractmethod
    def poll(self, timeout_s: float) -> list[tuple[int, Any]]:
        """Replies the ranks sent (``(rank, message)``), waiting up to ``timeout_s`` for one."""

    @abc.abstractmethod
    def dead(self) -> str | None:
        """Which rank has exited and how, or None while all run."""

    @abc.abstractmethod
    def stop(self, timeout_s: float) -> None:
        """Ask the ranks to exit, wait up to ``timeout_s``, then kill those left."""


class ProcessLauncher(RankLauncher):
    """Ranks as spawned processes on this machine (torch.multiprocessing's ``spawn``)."""

    def __init__(self) -> None:
        self.processes: list[BaseProcess] = []
        self.connections: list[Connection] = []

    def start(self, specs: list[RankSpec]) -> None:
        from brigade.plugins.executors.tp_worker import run_rank

        context = multiprocessing.get_context("spawn")
        for spec in specs:
            ours, theirs = context.Pipe()
            process = context.Process(
                target=run_rank, args=(spec, theirs), name=f"brigade-tp-rank{spec.rank}"
            )
            process.daemon = True  # multiprocessing ends it if the engine exits abruptly
            process.start()
            theirs.close()
            self.processes.append(process)
            self.connections.append(ours)

    def send(self, message: bytes) -> None:
        for connection in self.connections:
            connection.send_bytes(message)

    def poll(self, timeout_s: float) -> list[tuple[int, Any]]:
        return poll_connections(self.connections, timeout_s)

    def dead(self) -> str | None:
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                return f"tensor-parallel rank {rank} (pid {process.pid}) exited with code " + str(
                    process.exitcode
                )
        return None

    def stop(self, timeout_s: float) -> None:
        for connection in self.connections:
            with contextlib.suppress(OSError):  # a rank already gone
                connection.send_bytes(pickle.dumps(("shutdown", ())))
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(5.0)
        for connection in self.connections:
            connection.close()
        self.processes, self.connections = [], []


def poll_connections(connections: list[Connection], timeout_s: float) -> list[tuple[int, Any]]:
    """Replies waiting on ``connections`` (``connections[i]`` is rank ``i + 1``'s), waiting up
    to ``timeout_s`` for one; a closed connection is skipped (the launcher's ``dead`` says
    how its rank ended)."""
    from multiprocessing.connection import wait

    replies = []
    for ready in wait(connections, timeout_s):
        connection = cast("Connection", ready)
        try:
            message = pickle.loads(connection.recv_bytes())
        except (EOFError, OSError):
            continue
        replies.append((connections.index(connection) + 1, message))
    return replies


class RankGroup:
    """Rank 0's side: sends calls to the other ranks and turns their failures into one
    clear error; once a rank has failed, every later call fails at once (the ranks are out of
    step, and the engine stops on the second failure)."""

    def __init__(self, launcher: RankLauncher, world_size: int) -> None:
        self.launcher = launcher
        self.world_size = world_size
        self.failure: str | None = None
        self.store: Any = None
        """Rank 0's rendezvous store (the ranks' ``TCPStore`` server), kept while they run."""

    def wait(self, what: str, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until every rank replied ``what`` (``"hello"``: started, ``"ready"``: shard
        loaded); ``RuntimeError`` with the rank's own error when one fails instead."""
        waiting = set(range(1, self.world_size))
        deadline = time.monotonic() + timeout_s
        while waiting:
            for rank, (kind, detail) in self.launcher.poll(0.5):
                if kind == "error":
                    self._fail(f"tensor-parallel rank {rank} failed: {detail}")
                if kind == what:
                    waiting.discard(rank)
            if waiting and (dead := self.launcher.dead()) is not None:
                self._fail(dead)
            if waiting and time.monotonic() > deadline:
                self._fail(f"tensor-parallel ranks {sorted(waiting)} did not start in time")

    def send(self, name: str, *args: Any) -> None:
        """Have every other rank call its executor's ``name(*args)``."""
        if self.failure is not None:
            raise RuntimeError(self.failure)
        if (dead := self.launcher.dead()) is not None:
            self._fail(dead)
        try:
            self.launcher.send(encode((name, args)))
        except OSError as error:
            self._fail(self._reason(f"sending {name!r} failed: {error}"))

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Run rank 0's part of a call: an error in it (a collective that broke when a rank
        died) fails the group, naming the rank."""
        if self.failure is not None:
            raise RuntimeError(self.failure)
        try:
            yield
        except Exception as error:
            self._fail(self._reason(f"{type(error).__name__}: {error}"))

    def stop(self, timeout_s: float = 10.0) -> None:
        self.failure = self.failure or "the executor was shut down"
        self.launcher.stop(timeout_s)

    def _reason(self, fallback: str) -> str:
        """A dead rank, or a rank's own error message, explains a failure better than the
        broken collective rank 0 saw; give a dying rank a moment to report."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            for rank, (kind, detail) in self.launcher.poll(0.1):
                if kind == "error":
                    return f"tensor-parallel rank {rank} failed: {detail}"
            if (dead := self.launcher.dead()) is not None:
                return dead
        return f"tensor-parallel step failed on rank 0: {fallback}"

    def _fail(self, reason: str) -> None:
        self.failure = reason
        raise RuntimeError(reason)


class _Pickler(pickle.Pickler):
    """Pickles host tensors of numpy's dtypes as numpy arrays: torch's own reduction of a
    tensor costs ten times as much for the small tensors of a step."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and obj.device.type == "cpu" and obj.dtype in _NUMPY_DTYPES:
            return torch.from_numpy, (obj.numpy(),)
        return NotImplemented


_NUMPY_DTYPES = frozenset({torch.int64, torch.int32, torch.float32, torch.bool})


def encode(message: Any) -> bytes:
    """``message`` pickled for a rank (``pickle.loads`` reads it)."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return buffer.getvalue()


def join_group(backend: str, store: Any, rank: int, size: int, host: str = "127.0.0.1") -> Any:
    """This rank's ``ProcessGroup`` (blocks until every rank has joined); ``host``: the
    address the others reach this rank at. A group object of its own rather than
    torch.distributed's default group, which a process has only one of."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = COLLECTIVE_TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, size, options)
    # The options form is the one that takes a device: ``host``, whatever the hostname says.
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = COLLECTIVE_TIMEOUT
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, size, options)
