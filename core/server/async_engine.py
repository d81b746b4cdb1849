"""The engine core on its own thread, with asyncio streams per request.

The HTTP event loop never runs a model step: it hands requests to the engine thread through a
command queue and receives each request's updates on an ``asyncio.Queue``. The interface is
:class:`~brigade.server.request_streams.RequestStreams`, which ``EngineClient`` (the engine in
its own process, over ZMQ) shares.

The thread never dies silently: a request that cannot be queued fails alone, and when the
engine dies (``EngineDeadError``, or anything escaping the loop) every waiting stream gets the
error, :attr:`AsyncEngine.dead` says why, later requests are refused, and ``on_dead`` tells the
server, which exits so that a supervisor restarts it.

Nor does it hang silently: when its loop has not come round for ``step_timeout_s`` (``[server]
engine_step_timeout_s``; one step stuck in a plugin or a kernel), a watchdog on the event loop
declares the engine dead the same way. A thread cannot be stopped: the stuck step stays where
it is, on a daemon thread that the server's exit leaves behind. (A step stuck while holding
the GIL stops the whole process, watchdog and ``/health`` included: only a probe's timeout
sees that.)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import queue
import threading
from collections.abc import Callable, Mapping, Sequence

from brigade.admission import Admission
from brigade.engine import EngineCore, EngineStats, StepUpdate
from brigade.errors import EngineDeadError, RequestError, RequestFailedError, describe
from brigade.interfaces import ExtraValue, PoolingParams, SamplingParams
from brigade.server.engine_protocol import engine_info
from brigade.server.errors import EngineOverloadedError, EngineUnavailableError
from brigade.server.liveness import Watchdog, no_progress, report_hang
from brigade.server.request_streams import RequestStreams

__all__ = ["AsyncEngine", "EngineOverloadedError", "EngineUnavailableError"]

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.25
"""With nothing to run, the longest the thread sleeps before its loop comes round (a command
wakes it at once): the idle heartbeat the watchdog hears."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    admission: Admission
    params: SamplingParams
    priority: int
    sink: asyncio.Queue[StepUpdate | BaseException]
    loop: asyncio.AbstractEventLoop
    extra: Mapping[str, ExtraValue]


@dataclasses.dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class _AbortAll:
    """End every request now; each stream gets a last update (finish reason ``abort``)."""


_Command = _Add | _Abort | _AbortAll | None


class AsyncEngine(RequestStreams):
    """Runs ``EngineCore.step`` in a loop on a worker thread; requests stream back to asyncio.

    ``on_dead(reason)`` is called once, when the engine dies: on the engine thread, or on the
    event loop when the watchdog finds it hung (``step_timeout_s``, 0: never).
    """

    def __init__(
        self,
        engine: EngineCore,
        *,
        max_waiting_requests: int,
        step_timeout_s: float = 0.0,
        on_dead: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(max_waiting_requests=max_waiting_requests, on_dead=on_dead)
        self.engine = engine
        self.info = engine_info(engine, os.getpid())
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, _Add] = {}
        self._watchdog = Watchdog(step_timeout_s, self._hung)
        self._dying = threading.Lock()
        """Makes the death happen once, whether the thread or the watchdog sees it first."""
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="brigade-engine", daemon=True)
        self.snapshot: EngineStats = engine.stats()
        """Engine counters as of the latest step (read by /health and /metrics)."""
        self._thread.start()

    # -- event-loop side ----------------------------------------------------------------

    async def start(self) -> None:
        """Start the watchdog (on the server's event loop)."""
        self._watchdog.start()

    def admit(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        pooling: PoolingParams | None = None,
    ) -> Admission:
        return self.engine.admit(prompt_token_ids, params, pooling=pooling)

    def _submit(
        self,
        request_id: str,
        admission: Admission,
        params: SamplingParams,
        priority: int,
        extra: Mapping[str, ExtraValue],
        sink: asyncio.Queue[StepUpdate | BaseException],
    ) -> None:
        loop = asyncio.get_running_loop()
        self._send(_Add(request_id, admission, params, priority, sink, loop, extra))

    def abort(self, request_id: str) -> None:
        """Stop a request (no-op if it already finished)."""
        self._send(_Abort(request_id))

    def abort_all(self) -> None:
        """End every request now: streams finish with reason ``abort`` (shutdown timeout)."""
        self._send(_AbortAll())

    @property
    def no_progress_s(self) -> float:
        """Seconds since the engine thread's loop last came round (it does after every
        step, and at least every ``_IDLE_WAIT_S`` when idle)."""
        return self._watchdog.silence_s

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the worker thread after its current step (no wait for a hung one)."""
        self._stopped = True
        self._commands.put(None)
        self._wake.set()
        self._thread.join(timeout if self.dead is None else 0.0)

    def _send(self, command: _Add | _Abort | _AbortAll) -> None:
        self._commands.put(command)
        self._wake.set()

    def _hung(self, silence_s: float) -> None:
        """The watchdog's verdict: the thread's loop has not come round for the timeout."""
        if self.dead is not None:  # it died on its own: the thread has ended
            return
        timeout = self._watchdog.timeout_s
        report_hang(silence_s, timeout, "declared the engine failed (a thread cannot be stopped)")
        self._die(no_progress(silence_s, timeout))

    # -- engine-thread side -------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except EngineDeadError as exc:
            self._die(str(exc))
        except BaseException as exc:  # a failure outside any step: the engine cannot go on
            logger.critical("the engine thread failed", exc_info=exc)
            self._die(f"the engine thread failed: {describe(exc)}")

    def _loop(self) -> None:
        engine = self.engine
        while self.dead is None:  # set by the watchdog if a step hung: leave when it returns
            self._watchdog.heard()
            if not self._drain_commands():
                return
            if not engine.has_unfinished():
                self.snapshot = engine.stats()  # aborts may have freed pages
                self._wake.wait(timeout=_IDLE_WAIT_S)
                self._wake.clear()
                continue
            for update in engine.step():
                stream = self._streams.get(update.request.request_id)
                if stream is None:
                    continue
                _put(stream, update)
                if update.finished:
                    del self._streams[update.request.request_id]
            self.snapshot = engine.stats()

    def _drain_commands(self) -> bool:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if command is None:
                return False
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                self._abort(command.request_id, notify=False)
            else:
                for request_id in list(self._streams):
                    self._abort(request_id, notify=True)

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(
                command.request_id,
                command.admission.prompt_token_ids,
                command.params,
                priority=command.priority,
                admission=command.admission,
                extra=command.extra,
            )
        except (RequestError, RequestFailedError) as exc:
            _put(command, exc)
            return
        except Exception as exc:  # this request fails; the engine goes on
            logger.exception("queueing request %s failed", command.request_id)
            _put(command, RequestFailedError(f"queueing this request failed: {describe(exc)}"))
            return
        self._streams[command.request_id] = command

    def _abort(self, request_id: str, *, notify: bool) -> None:
        try:
            request = self.engine.abort_request(request_id)
        except Exception:  # the client is gone or the server is stopping: log, go on
            logger.exception("aborting request %s failed", request_id)
            request = None
        stream = self._streams.pop(request_id, None)
        if notify and stream is not None and request is not None:
            _put(stream, StepUpdate(request, [], None, True))

    def _die(self, reason: str) -> None:
        """Fail every stream and tell ``on_dead``, once: on the engine thread, or on the event
        loop while the thread is stuck in a step (it leaves its loop if that step returns)."""
        with self._dying:
            if self.dead is not None:
                return
            self.dead = reason  # first: generate() checks it after sending
        error = EngineDeadError(f"the engine failed: {reason}")
        for stream in list(self._streams.values()):
            _put(stream, error)
        self._streams.clear()
        while True:  # requests sent before `dead` was set are answered too
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                _put(command, error)
        if self.on_dead is not None:
            self.on_dead(reason)


def _put(stream: _Add, item: StepUpdate | BaseException) -> None:
    """Hand ``item`` to a request's stream (dropped if its event loop has closed)."""
    with contextlib.suppress(RuntimeError):  # a closed loop: the server is exiting
        stream.loop.call_soon_threadsafe(stream.sink.put_nowait, item)
