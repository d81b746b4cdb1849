"""What the HTTP handlers call to run requests, whichever way the engine runs.

:class:`RequestStreams` is the event-loop side shared by ``AsyncEngine`` (the engine on a
thread of this process) and ``EngineClient`` (the engine in its own process, over ZMQ): the
bounded waiting queue, one ``asyncio.Queue`` of ``StepUpdate`` per request, and the rules of
what a failure raises. A subclass says how a request reaches the engine and how it is aborted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence

from brigade.admission import Admission
from brigade.engine import EngineStats, StepUpdate
from brigade.errors import EngineDeadError, RequestError, RequestFailedError
from brigade.interfaces import EMPTY_EXTRA, ExtraValue, PoolingParams, SamplingParams
from brigade.server.engine_protocol import EngineInfo
from brigade.server.errors import EngineOverloadedError, EngineUnavailableError

__all__ = ["RequestStreams"]


class RequestStreams:
    """The event-loop side shared by :class:`AsyncEngine` (engine thread) and
    ``EngineClient`` (engine process): the bounded waiting queue, the per-request streams
    and the rules of what a failure raises. A subclass submits and aborts."""

    info: EngineInfo
    """What the front end knows about the engine (fixed for its life)."""
    snapshot: EngineStats
    """Engine counters as of the latest step (read by /health and /metrics)."""

    def __init__(
        self, *, max_waiting_requests: int, on_dead: Callable[[str], None] | None = None
    ) -> None:
        self.max_waiting_requests = max_waiting_requests
        self.on_dead = on_dead
        self.on_snapshot: Callable[[EngineStats], None] | None = None
        """Called with each new :attr:`snapshot` as it arrives from an engine process (front
        ends of one server publish the engine's gauges this way; an engine thread's snapshot
        is read when needed)."""
        self._num_unstarted = 0
        """Requests submitted that have not produced a token yet (the bounded queue)."""
        self._num_active = 0
        """``generate`` calls in progress."""
        self._stopped = False
        self.dead: str | None = None
        """Why the engine died (None while it runs)."""
        self._sinks: dict[str, asyncio.Queue[StepUpdate | BaseException]] = {}
        """Request id -> its stream's queue, while :meth:`generate` runs."""

    def admit(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        pooling: PoolingParams | None = None,
    ) -> Admission:
        """``EngineCore.admit``'s checks for a prompt (``RequestError`` naming the field)."""
        raise NotImplementedError

    async def start(self) -> None:
        """Called on the server's event loop before it serves."""

    def check_capacity(self, num_requests: int = 1) -> None:
        """Raise ``EngineOverloadedError`` unless ``num_requests`` more may wait now."""
        if self.dead is not None:
            raise EngineUnavailableError(
                f"the engine has failed ({self.dead}); this server is restarting"
            )
        if self._stopped:
            raise EngineOverloadedError("the server is shutting down")
        if num_requests and self._num_unstarted + num_requests > self.max_waiting_requests:
            raise EngineOverloadedError(
                f"{self._num_unstarted} requests are already waiting "
                f"(max_waiting_requests = {self.max_waiting_requests}); retry later"
            )

    async def generate(
        self,
        request_id: str,
        admission: Admission,
        params: SamplingParams,
        *,
        priority: int = 0,
        check_queue: bool = True,
        extra: Mapping[str, ExtraValue] = EMPTY_EXTRA,
    ) -> AsyncGenerator[StepUpdate, None]:
        """Submit an admitted prompt with ``params`` and yield its updates; leaving early
        aborts it in the engine. ``extra`` becomes the request's ``Request.extra``.

        ``admission`` is :meth:`admit`'s for the prompt (``params`` are its parameters, or a
        fan-out child's): the engine does not check the request again.
        Before its first update a failure raises: ``RequestError`` (the request is invalid),
        ``RequestFailedError`` (a plugin failed for it) or ``EngineDeadError``. After it, a
        failure of this request alone arrives as its last update, with ``error`` set.
        ``check_queue`` False skips the waiting-queue bound (the parent request took the
        place: ``n`` > 1 choices).
        """
        self.check_capacity(1 if check_queue else 0)
        sink: asyncio.Queue[StepUpdate | BaseException] = asyncio.Queue()
        self._num_unstarted += 1
        self._num_active += 1
        self._sinks[request_id] = sink
        started = False
        finished = False
        try:
            self._submit(request_id, admission, params, priority, extra, sink)
            if self.dead is not None:  # it died as we sent: nobody may be left to answer
                finished = True
                raise EngineDeadError(self.dead)
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.error is not None and not started:
                    finished = True
                    if item.invalid:
                        raise RequestError(item.error, param=item.error_param)
                    raise RequestFailedError(item.error)
                if not started:
                    started = True
                    self._num_unstarted -= 1
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._num_active -= 1
            self._sinks.pop(request_id, None)
            if not started:
                self._num_unstarted -= 1
            if not finished:
                self.abort(request_id)

    def _submit(
        self,
        request_id: str,
        admission: Admission,
        params: SamplingParams,
        priority: int,
        extra: Mapping[str, ExtraValue],
        sink: asyncio.Queue[StepUpdate | BaseException],
    ) -> None:
        """Hand the request to the engine; its updates (or its failure) go to ``sink``."""
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        """Stop a request (no-op if it already finished)."""
        raise NotImplementedError

    def abort_all(self) -> None:
        """End every request now: streams finish with reason ``abort`` (shutdown timeout)."""
        raise NotImplementedError

    def fail_all(self, error: BaseException) -> None:
        """End every open stream now with ``error`` (each :meth:`generate` raises it, so a
        streaming client gets an error event rather than a cut) and abort its request: the
        server is stopping at once."""
        sinks, self._sinks = self._sinks, {}
        for request_id, sink in sinks.items():
            sink.put_nowait(error)
            self.abort(request_id)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop talking to the engine (and stop it, when this front end owns it)."""
        raise NotImplementedError

    @property
    def num_engines(self) -> int:
        """Engines behind this seam (one; a replicated engine has several)."""
        return 1

    @property
    def num_engines_alive(self) -> int:
        """Of :attr:`num_engines`, those still serving."""
        return 0 if self.dead is not None else 1

    @property
    def no_progress_s(self) -> float:
        """Seconds since the engine last showed progress (a step's message, or its idle
        heartbeat); a step still running is as old as this."""
        return 0.0

    @property
    def num_unstarted(self) -> int:
        return self._num_unstarted

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet finished (their streams still open)."""
        return self._num_active
