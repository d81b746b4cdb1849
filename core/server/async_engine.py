"""The engine core on its own thread, with asyncio streams per request.

The HTTP event loop never runs a model step: it hands requests to the engine thread through a
command queue and receives each request's updates on an ``asyncio.Queue``. The interface
(``submit`` / ``abort`` / per-request async iterators of ``StepUpdate``) is what a
two-process split would keep, with the queues replaced by IPC.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
from collections.abc import AsyncGenerator, Sequence

from brigade.engine import EngineCore, EngineStats, StepUpdate
from brigade.errors import BrigadeError, RequestError
from brigade.interfaces import SamplingParams

__all__ = ["AsyncEngine", "EngineOverloadedError"]


class EngineOverloadedError(BrigadeError):
    """The bounded waiting queue is full; the client should retry later."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    sink: asyncio.Queue[StepUpdate | BaseException]
    loop: asyncio.AbstractEventLoop


@dataclasses.dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


class AsyncEngine:
    """Runs ``EngineCore.step`` in a loop on a worker thread; requests stream back to asyncio."""

    def __init__(self, engine: EngineCore, *, max_waiting_requests: int) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._streams: dict[str, _Add] = {}
        self._num_unstarted = 0
        """Requests submitted that have not produced a token yet (the bounded queue)."""
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="brigade-engine", daemon=True)
        self._stopped = False
        self.snapshot: EngineStats = engine.stats()
        """Engine counters as of the latest step (read by /health and /metrics)."""
        self._thread.start()

    # -- event-loop side ----------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
    ) -> AsyncGenerator[StepUpdate, None]:
        """Submit a request and yield its updates; leaving early aborts it in the engine."""
        self.engine.validate(prompt_token_ids, params)  # read-only: safe off the thread
        if self._stopped:
            raise EngineOverloadedError("the server is shutting down")
        if self._num_unstarted >= self.max_waiting_requests:
            raise EngineOverloadedError(
                f"{self._num_unstarted} requests are already waiting "
                f"(max_waiting_requests = {self.max_waiting_requests}); retry later"
            )
        sink: asyncio.Queue[StepUpdate | BaseException] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._num_unstarted += 1
        started = False
        finished = False
        self._send(_Add(request_id, list(prompt_token_ids), params, priority, sink, loop))
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.error is not None:
                    finished = True
                    raise RequestError(item.error)
                if not started:
                    started = True
                    self._num_unstarted -= 1
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not started:
                self._num_unstarted -= 1
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request (no-op if it already finished)."""
        self._send(_Abort(request_id))

    @property
    def num_unstarted(self) -> int:
        return self._num_unstarted

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the worker thread after its current step."""
        self._stopped = True
        self._commands.put(None)
        self._wake.set()
        self._thread.join(timeout)

    def _send(self, command: _Add | _Abort) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- engine-thread side -------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            if not self._drain_commands():
                return
            if not engine.has_unfinished():
                self.snapshot = self.engine.stats()  # aborts may have freed pages
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                updates = engine.step()
            except Exception as exc:  # a step failure fails its requests, not the server
                self._fail_all(exc)
                continue
            for update in updates:
                stream = self._streams.get(update.request.request_id)
                if stream is None:
                    continue
                stream.loop.call_soon_threadsafe(stream.sink.put_nowait, update)
                if update.finished:
                    del self._streams[update.request.request_id]
            self.snapshot = self.engine.stats()

    def _drain_commands(self) -> bool:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if command is None:
                return False
            if isinstance(command, _Abort):
                if self.engine.abort_request(command.request_id) is not None:
                    self._streams.pop(command.request_id, None)
                continue
            try:
                self.engine.add_request(
                    command.request_id,
                    command.prompt_token_ids,
                    command.params,
                    priority=command.priority,
                )
            except RequestError as exc:
                command.loop.call_soon_threadsafe(command.sink.put_nowait, exc)
                continue
            self._streams[command.request_id] = command

    def _fail_all(self, exc: Exception) -> None:
        error = RuntimeError(f"engine step failed: {exc}")
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            stream.loop.call_soon_threadsafe(stream.sink.put_nowait, error)
        self._streams.clear()
