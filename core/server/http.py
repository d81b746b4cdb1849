"""uvicorn's h11 protocol with the limits an exposed server needs.

uvicorn closes a keep-alive connection that stays idle after a response, but waits forever
for the first request of a connection and for headers sent a byte at a time, so idle and
half-sent connections pile up until new clients starve. This protocol gives every request's
headers a deadline (``[server] header_timeout_s``, from the connection's opening or from the
first byte after a response), closes connections beyond ``max_connections`` at once with a
503, and logs a repeated connection-level warning at most once per :data:`LOG_EVERY_S`.
(The body's deadline is the application's: ``guards.read_body``.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

from brigade.server.errors import ServerOverloadedError

__all__ = ["LOG_EVERY_S", "GuardedH11Protocol", "ThrottledWarnings"]

LOG_EVERY_S = 10.0
"""A connection-level warning (bad request line, refused connection) repeats at most this often."""

_REFUSED_BODY = ServerOverloadedError("Too many open connections; retry later.").to_body()
REFUSED_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: " + str(len(_REFUSED_BODY)).encode() + b"\r\n\r\n"
) + _REFUSED_BODY

_log = logging.getLogger("uvicorn.error")


class GuardedH11Protocol(H11Protocol):
    """h11 with a header deadline and a connection cap; configure with :meth:`with_limits`."""

    header_timeout_s: ClassVar[float] = 10.0
    keep_alive_timeout_s: ClassVar[float] = 5.0
    max_connections: ClassVar[int] = 2048

    @classmethod
    def with_limits(
        cls, *, header_timeout_s: float, keep_alive_timeout_s: float, max_connections: int
    ) -> type[GuardedH11Protocol]:
        """A subclass with these limits (uvicorn builds protocols from a class)."""
        limits = {
            "header_timeout_s": header_timeout_s,
            "keep_alive_timeout_s": keep_alive_timeout_s,
            "max_connections": max_connections,
        }
        return type(cls.__name__, (cls,), limits)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_keep_alive = self.keep_alive_timeout_s  # type: ignore[assignment]
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            _log.warning("Too many open connections (max_connections = %d).", self.max_connections)
            transport.write(REFUSED_RESPONSE)
            transport.close()
            return
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a request's headers arrived
            self._cancel_header_timer()
        elif self._header_timer is None and (cycle is None or cycle.response_complete):
            self._arm_header_timer()  # the next request has begun arriving

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()  # nothing is being answered on it: just close


class ThrottledWarnings(logging.Filter):
    """Lets each distinct message through at most once per ``every_s`` seconds."""

    def __init__(self, every_s: float = LOG_EVERY_S) -> None:
        super().__init__()
        self.every_s = every_s
        self._last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        now = time.monotonic()
        key = str(record.msg)
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            return False
        self._last[key] = now
        return True
