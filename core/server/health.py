"""What ``/health`` and ``/ping`` say about the server, and the process counts ``/metrics``
publishes.

``/health`` is a readiness probe's answer: whether this server should get traffic now. Its
``status``, first match wins:

- ``"engine failed"`` (503): every engine is dead; the server is about to exit.
- ``"shutting down"`` (503): a signal started the drain; new requests are refused.
- ``"stalled"`` (503): the engine has made no progress for :data:`STALLED_AFTER_S` (one step
  still running). Requests sent now would wait behind that step, so a readiness probe should
  take the server out of rotation until it moves again; the step may still end on its own,
  and one that never does is what ``[server] engine_step_timeout_s`` bounds.
- ``"degraded"`` (200): serving, with fewer processes than it started with (a dead
  data-parallel replica, a dead front end). It still answers, so a load balancer keeps
  sending to it; the counts say what is missing, for an alert.
- ``"ok"`` (200).

``/ping`` is a liveness probe's answer: 503 only when the server cannot serve again
("engine failed", "shutting down"); a stall or a lost process is not a reason to restart it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from brigade.server.state import ServerState

__all__ = [
    "STALLED_AFTER_S",
    "AliveFlags",
    "FrontendRoster",
    "ServerHealth",
    "can_serve",
    "server_health",
]

STALLED_AFTER_S = 5.0
"""Seconds without progress from the engine after which ``/health`` says "stalled". An idle
engine speaks several times a second, and a busy one after every step, so only a step this
long stays silent: long enough for the large prefill chunks of ordinary serving, short
enough for a probe to see a step gone wrong long before ``engine_step_timeout_s``."""

_SERVING = ("ok", "degraded")


class AliveFlags(Protocol):
    """One flag per front end, non-zero while it runs: a ``multiprocessing`` shared array
    (``RawArray``) that the supervisor writes and the front ends read."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int, /) -> Any: ...
    def __setitem__(self, index: int, value: Any, /) -> None: ...


class FrontendRoster:
    """How many of the server's front-end processes are alive, as its supervisor sees them:
    ``flags`` in memory shared with the supervisor, which clears a front end's flag when it
    exits (their only writer). Without flags this process is the only front end."""

    def __init__(self, flags: AliveFlags | None = None) -> None:
        self._flags = flags

    @property
    def total(self) -> int:
        return 1 if self._flags is None else len(self._flags)

    @property
    def alive(self) -> int:
        flags = self._flags
        return 1 if flags is None else sum(1 for index in range(len(flags)) if flags[index])


@dataclasses.dataclass(frozen=True, slots=True)
class ServerHealth:
    """The server's state as ``/health`` reports it (see the module docstring)."""

    status: str
    engines_alive: int
    engines_total: int
    """Engine processes the server started (``[router] data_parallel_size``)."""
    frontends_alive: int
    frontends_total: int
    """Front-end processes the server started (``[server] api_server_count``)."""
    no_progress_s: float
    """Seconds since the engine last made progress (with several, the slowest live one)."""

    @property
    def http_status(self) -> int:
        """``/health``'s status code: 200 while the server should get traffic."""
        return 200 if self.status in _SERVING else 503


def can_serve(state: ServerState) -> bool:
    """``/ping``'s answer: False once the server cannot serve again (its engine failed, or
    it is shutting down)."""
    return state.async_engine.dead is None and not state.shutting_down


def server_health(state: ServerState) -> ServerHealth:
    """How the server behind ``state`` is doing now."""
    engine = state.async_engine
    engines_alive, engines_total = engine.num_engines_alive, engine.num_engines
    frontends_alive, frontends_total = state.frontends.alive, state.frontends.total
    no_progress_s = engine.no_progress_s
    if engine.dead is not None:
        status = "engine failed"
    elif state.shutting_down:
        status = "shutting down"
    elif no_progress_s >= STALLED_AFTER_S:
        status = "stalled"
    elif engines_alive < engines_total or frontends_alive < frontends_total:
        status = "degraded"
    else:
        status = "ok"
    return ServerHealth(
        status, engines_alive, engines_total, frontends_alive, frontends_total, no_progress_s
    )
