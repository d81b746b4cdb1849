"""How the server stops, and the exit status that says how.

- The first SIGTERM or SIGINT starts a drain: ``/health`` and ``/ping`` answer 503 and new
  requests get 503 while running ones may finish for ``shutdown_timeout_s`` (a float; 0 means
  no wait). Requests still running then end with finish reason ``abort`` (streams get their
  last chunk, an error event saying the server stopped them, and ``[DONE]``; a stream the
  engine did not end within :data:`ABORT_GRACE_S`, a step still running, gets the error event
  alone), and the server exits with :data:`EXIT_OK`.
- A second signal stops at once: every stream gets an error event and ``[DONE]`` (they have
  :data:`FORCED_STOP_GRACE_S` to leave), then connections are cut; the exit status is 128 +
  the signal number (130 for Ctrl-C twice, 143 for SIGTERM twice). A third signal cuts them
  without waiting.
- When the engine dies, requests in flight get their error, ``/health`` answers 503 and new
  requests 503 at once; after :data:`DEAD_LINGER_S` (so probes see it) the server exits
  with :data:`EXIT_ENGINE_DEAD`, for a supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Coroutine, Generator
from types import FrameType
from typing import TYPE_CHECKING

import structlog
import uvicorn

from brigade.server.errors import ServerOverloadedError

if TYPE_CHECKING:
    from brigade.server.state import ServerState

__all__ = [
    "ABORT_GRACE_S",
    "DEAD_LINGER_S",
    "EXIT_ENGINE_DEAD",
    "EXIT_OK",
    "EXIT_STARTUP_ERROR",
    "FORCED_STOP_GRACE_S",
    "BrigadeServer",
]

EXIT_OK = 0
"""Stopped on a signal: every request finished or ended with ``abort``."""
EXIT_ENGINE_DEAD = 1
"""The engine died; the server could no longer serve."""
EXIT_STARTUP_ERROR = 2
"""A config, model or port error before serving (the CLI's status for ``BrigadeError``)."""
ABORT_GRACE_S = 5.0
"""After the shutdown timeout aborts the running requests, how long their answers may take to
leave (and uvicorn's own wait for connections)."""
DEAD_LINGER_S = 2.0
"""With the engine dead, how long the server keeps answering 503 before it exits."""
FORCED_STOP_GRACE_S = 1.0
"""On a second signal, how long the streams' error events may take to leave before the
connections are cut: long enough for a write, short enough to still be "at once"."""
_POLL_S = 0.05

log = structlog.get_logger("brigade.server")


class BrigadeServer(uvicorn.Server):
    """uvicorn's server with Brigade's drain, forced stop and engine-death exit.

    :attr:`exit_code` is the process's exit status once :meth:`run` returns.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.exit_code = EXIT_OK
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals: list[int] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def serve(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await self.state.async_engine.start()
        if self.state.async_engine.dead is not None:  # it died while the server started
            self._engine_dead(self.state.async_engine.dead)
        await super().serve(sockets)  # type: ignore[arg-type]

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """Route SIGINT and SIGTERM to :meth:`handle_exit`; unlike uvicorn's, do not raise
        them again at exit (the exit status says how the server stopped)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The first signal drains, the second stops at once (a signal handler: no logging
        here, a write to the log stream may be under way)."""
        self._signals.append(sig)
        if len(self._signals) > 1:
            self.exit_code = 128 + sig
            if len(self._signals) > 2 or self._loop is None:
                self.force_exit = True
                self.should_exit = True
            else:
                self._loop.call_soon_threadsafe(self._start_task, self._stop_at_once())
            return
        self.state.shutting_down = True  # /health, /ping and new requests: 503
        if self._loop is None:
            self.should_exit = True
        else:
            self._loop.call_soon_threadsafe(self._start_drain, sig)

    def engine_died(self, reason: str) -> None:
        """Called when the engine dies (on the engine thread, or on the event loop when the
        engine is another process)."""
        self.exit_code = EXIT_ENGINE_DEAD
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._engine_dead, reason)

    def _start_drain(self, sig: int) -> None:
        log.info("shutdown_requested", signal=sig, timeout_s=self.shutdown_timeout_s)
        self._start_task(self._drain())

    def _start_task(self, work: Coroutine[None, None, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stop_at_once(self) -> None:
        await self._fail_streams("was stopped at once (a second signal)")
        self.force_exit = True
        self.should_exit = True

    async def _fail_streams(self, how: str) -> None:
        """End every open stream with an error event saying that the server ``how``, and
        give the events :data:`FORCED_STOP_GRACE_S` to leave before the connections go."""
        self.state.async_engine.fail_all(
            ServerOverloadedError(f"The server {how}: this request did not finish; retry it.")
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FORCED_STOP_GRACE_S
        while self._busy() and loop.time() < deadline:
            await asyncio.sleep(_POLL_S)

    @property
    def shutdown_timeout_s(self) -> float:
        return float(self.state.settings.shutdown_timeout_s)

    async def _drain(self) -> None:
        engine = self.state.async_engine
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_timeout_s
        while self._busy() and loop.time() < deadline:
            await asyncio.sleep(_POLL_S)
        if engine.num_in_flight:
            log.warning("shutdown_timeout", aborted=engine.num_in_flight)
            engine.abort_all()
        grace = loop.time() + ABORT_GRACE_S
        while self._busy() and loop.time() < grace:
            await asyncio.sleep(_POLL_S)
        if engine.num_in_flight:  # the engine did not end them (a step still runs): say so
            await self._fail_streams("is shutting down and could not stop this request in time")
        self.should_exit = True

    def _busy(self) -> bool:
        """Requests in the engine, or HTTP requests still being answered (one may be
        tokenizing on its way in)."""
        return bool(self.state.async_engine.num_in_flight or self.server_state.tasks)

    def _engine_dead(self, reason: str) -> None:
        log.critical("engine_dead", reason=reason, exit_code=EXIT_ENGINE_DEAD)
        self.exit_code = EXIT_ENGINE_DEAD
        asyncio.get_running_loop().call_later(DEAD_LINGER_S, self._stop)

    def _stop(self) -> None:
        self.should_exit = True
