"""Is the engine still making progress? The watchdog behind ``[server] engine_step_timeout_s``.

An engine shows it is alive by what it does between steps: the engine process sends every
front end a message after each step and, when idle, about every 0.1 s (its counters; see
``brigade.server.engine_loop``), and the engine thread of thread mode marks each turn of
its loop. A step that never returns (a plugin in an endless loop, a deadlocked kernel) means
silence, while the process or thread stays alive. :class:`Watchdog` runs on the server's
event loop and calls ``on_hung`` once when nothing was heard for its timeout; its owner
decides what that means. A front end's :class:`ProcessWatch` kills the engine process, so
that the usual death path runs in every process (each front end's pidfd fires, the
supervisor sees the exit); ``AsyncEngine``, which cannot stop a thread, declares the engine
dead; a remote engine (a Ray actor) is watched through its connection instead
(``brigade.server.tcp_link.ConnectionWatch``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable

import structlog

__all__ = [
    "MIN_STEP_TIMEOUT_S",
    "ProcessWatch",
    "Watchdog",
    "kill_process",
    "no_progress",
    "open_pidfd",
    "process_alive",
    "report_hang",
]

log = structlog.get_logger("brigade.server")

MIN_STEP_TIMEOUT_S = 1.0
"""The shortest ``engine_step_timeout_s`` allowed (0 turns the watchdog off): several times
the idle engine's heartbeat, so that a loaded machine's scheduling delays are not taken for
a hang."""
_RECHECK_S = 0.05
"""When the engine's messages wait unread (this event loop was busy), look again after this."""
_POLL_ALIVE_S = 0.25
"""Without pidfd support, how often the engine's process id is checked."""


def no_progress(silence_s: float, timeout_s: float) -> str:
    """The reason a hung engine failed, for streams, ``/health`` callers and the log."""
    return (
        f"it made no progress for {silence_s:.1f} s (a step ran longer than [server] "
        f"engine_step_timeout_s = {timeout_s:g})"
    )


def report_hang(silence_s: float, timeout_s: float, action: str) -> None:
    """Log a hung engine as an error: how long, the key that bounds it, what was done."""
    log.error(
        "engine_hung",
        no_progress_s=round(silence_s, 1),
        engine_step_timeout_s=timeout_s,
        action=action,
        hint="if steps this long are expected (a long prefill on a CPU), raise [server] "
        "engine_step_timeout_s; 0 turns the check off",
    )


class Watchdog:
    """Calls ``on_hung(silence_s)`` once, on the event loop, when :meth:`heard` has not been
    called for ``timeout_s`` seconds (0: never).

    ``pending``, if given, says whether the engine has spoken and the words wait unread
    (messages queued on a socket while this event loop was busy elsewhere): then it is not
    hung, and the watchdog looks again once the reader had its turn.
    """

    def __init__(
        self,
        timeout_s: float,
        on_hung: Callable[[float], None],
        *,
        pending: Callable[[], bool] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.on_hung = on_hung
        self.pending = pending
        self._last = time.monotonic()
        self._task: asyncio.Task[None] | None = None

    def heard(self) -> None:
        """The engine made progress (any thread may call it: one float store)."""
        self._last = time.monotonic()

    @property
    def silence_s(self) -> float:
        """Seconds since the engine was last heard from."""
        return time.monotonic() - self._last

    def start(self) -> None:
        """Start watching, on the running event loop; silence counts from now."""
        self.heard()
        if self.timeout_s <= 0 or self._task is not None:
            return
        self._task = asyncio.get_running_loop().create_task(self._watch())

    def stop(self) -> None:
        """Stop watching (the engine died or the server stops): ``on_hung`` is not called."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _watch(self) -> None:
        while True:
            remaining = self._last + self.timeout_s - time.monotonic()
            if remaining > 0:
                await asyncio.sleep(remaining)
            elif self.pending is not None and self.pending():
                await asyncio.sleep(_RECHECK_S)
            else:
                break
        self._task = None
        self.on_hung(self.silence_s)


class ProcessWatch:
    """A front end's watch over the engine process ``pid``, on its event loop: calls
    ``on_gone(reason)`` once, when the process exits (a pidfd: at once, whoever killed it;
    polled every 0.25 s without pidfd support) or when it has been silent for ``timeout_s``
    (:meth:`heard` not called), in which case it first kills it with SIGKILL, so that every
    other process watching it sees it exit too."""

    def __init__(
        self,
        pid: int,
        timeout_s: float,
        on_gone: Callable[[str], None],
        *,
        pending: Callable[[], bool] | None = None,
    ) -> None:
        self.pid = pid
        self.on_gone = on_gone
        self.watchdog = Watchdog(timeout_s, self._hung, pending=pending)
        self._pidfd: int | None = None
        self._poller: asyncio.Task[None] | None = None
        self._gone = False

    def heard(self) -> None:
        """The engine spoke: it is making progress."""
        self.watchdog.heard()

    def start(self) -> None:
        """Start watching (on the running event loop)."""
        loop = asyncio.get_running_loop()
        self._pidfd = open_pidfd(self.pid)
        if self._pidfd is not None:
            loop.add_reader(self._pidfd, self._exited)
        else:
            self._poller = loop.create_task(self._poll())
        self.watchdog.start()

    def close(self) -> None:
        """Release the pidfd (after the event loop, and its reader, are gone)."""
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    async def _poll(self) -> None:
        while process_alive(self.pid):
            await asyncio.sleep(_POLL_ALIVE_S)
        self._exited()

    def _exited(self) -> None:
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
        reason = f"the engine process (pid {self.pid}) exited"
        silence, timeout = self.watchdog.silence_s, self.watchdog.timeout_s
        if silence >= MIN_STEP_TIMEOUT_S:  # beyond any heartbeat's gap: it was stuck, and
            # most likely another front end's watchdog, a moment ahead of ours, killed it
            reason += (
                f" after {no_progress(silence, timeout)}"
                if timeout > 0
                else f" after it made no progress for {silence:.1f} s"
            )
        self._end(reason)

    def _hung(self, silence_s: float) -> None:
        report_hang(silence_s, self.watchdog.timeout_s, f"killed the engine process {self.pid}")
        kill_process(self.pid, self._pidfd)
        reason = no_progress(silence_s, self.watchdog.timeout_s)
        self._end(f"the engine failed: {reason}; this front end killed it (pid {self.pid})")

    def _end(self, reason: str) -> None:
        if self._gone:
            return
        self._gone = True
        self.watchdog.stop()
        self.on_gone(reason)


def open_pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when process ``pid`` exits (None without pidfd
    support: Linux before 5.3, other systems; callers then poll :func:`process_alive`)."""
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_process(pid: int, pidfd: int | None) -> None:
    """SIGKILL process ``pid``, through its ``pidfd`` when there is one (a descriptor names
    that process even if it has exited and its pid been reused); nothing if it is gone."""
    with contextlib.suppress(ProcessLookupError):
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
