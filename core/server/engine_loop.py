"""The engine's step loop behind a ZMQ ROUTER socket, in an engine process
(``brigade.server.engine_process``) or a Ray actor (``brigade.server.ray_replicas``).

Every front end is a DEALER with its own identity. The loop reads every command waiting
(without blocking while requests run), runs one step, and sends each front end ONE
:class:`~brigade.server.engine_protocol.StepOutputs` with its requests' updates and the
engine's counters; front ends without updates that step get the counters alone, at most every
:data:`STATS_INTERVAL_S`. An idle loop publishes too, after each :data:`IDLE_POLL_MS` wait, so
every front end hears from the engine at least every step or 0.1 s: the heartbeat whose
silence a front end takes for a hung step (``[server] engine_step_timeout_s``,
``brigade.server.liveness``). Grammars compile here (``EngineCore.admit``); an invalid one comes
back as the request's first update with ``error`` and ``invalid`` set.

A front end that leaves says goodbye, and its requests are aborted. One that dies cannot: the
socket refuses the next message for it (``open_engine_socket``), and its requests are
aborted then, so that no pages or batch rows go on serving answers nobody will read while the
other front ends serve on.
"""

from __future__ import annotations

import logging
import os
import time

import structlog
import zmq

from brigade.engine import EngineCore, StepUpdate
from brigade.errors import EngineDeadError, RequestError, RequestFailedError, describe
from brigade.interfaces import RequestStatus
from brigade.server import engine_protocol as wire

__all__ = ["IDLE_POLL_MS", "STATS_INTERVAL_S", "EngineLoop"]

logger = logging.getLogger(__name__)
log = structlog.get_logger("brigade.server")

STATS_INTERVAL_S = 0.05
"""Counters-only messages to a front end with no updates are at most this frequent."""
IDLE_POLL_MS = 100
"""With nothing to run, how long the loop waits for a command before looking at signals and
sending the counters (the idle heartbeat)."""


class EngineLoop:
    """Commands in, one message per front end per step out."""

    def __init__(self, engine: EngineCore, socket: zmq.Socket[bytes]) -> None:
        self.engine = engine
        engine.warm_up()
        self.socket = socket
        self.info = wire.engine_info(engine, os.getpid())
        self._owners: dict[str, bytes] = {}
        """Request id -> the identity of the front end that sent it."""
        self._stats_sent: dict[bytes, float] = {}
        """Registered front ends -> when they were last sent counters."""
        self._stopping = False

    def stop(self) -> None:
        """Stop after the current step (a signal handler: sets a flag only)."""
        self._stopping = True

    def run(self) -> int:
        """Serve until :meth:`stop` (0) or until the engine dies (1, after telling every
        front end why)."""
        engine = self.engine
        while not self._stopping:
            busy = engine.has_unfinished()
            if self.socket.poll(0 if busy else IDLE_POLL_MS):
                self._drain_commands()
            if not engine.has_unfinished():
                self._publish([])  # aborts may have freed pages
                continue
            try:
                updates = engine.step()
            except EngineDeadError as exc:
                self._fail(str(exc))
                return 1
            except BaseException as exc:  # outside any step's own handling: cannot go on
                logger.critical("the engine loop failed", exc_info=exc)
                self._fail(f"the engine loop failed: {describe(exc)}")
                return 1
            self._publish(updates)
        return 0

    # -- commands -----------------------------------------------------------------------

    def _drain_commands(self) -> None:
        while True:
            try:
                identity, data = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                command = wire.decode_to_engine(data)
            except Exception as exc:  # a front end of another version, or a bug: say so
                logger.error("undecodable message from a front end: %s", describe(exc))
                continue
            self._handle(identity, command)

    def _handle(self, identity: bytes, command: wire.ToEngine) -> None:
        if isinstance(command, wire.AddRequest):
            self._add(identity, command)
        elif isinstance(command, wire.Abort):
            for request_id in command.request_ids:
                if self._owners.pop(request_id, None) is not None:
                    self._abort(request_id)
        elif isinstance(command, wire.AbortAll):
            self._abort_all(identity, notify=True)
        elif isinstance(command, wire.Hello):
            if command.frontend >= 0:  # a negative index is a start-up probe: answer only
                self._stats_sent[identity] = 0.0
            stats = self.engine.stats()
            self._send(identity, wire.Ready(self.info, stats))
        else:  # Goodbye
            self._abort_all(identity, notify=False)
            self._stats_sent.pop(identity, None)

    def _add(self, identity: bytes, command: wire.AddRequest) -> None:
        engine = self.engine
        request_id = command.request_id
        try:
            admission = engine.admit(
                command.prompt_token_ids, command.params, pooling=command.pooling
            )
            engine.add_request(
                request_id,
                command.prompt_token_ids,
                command.params,
                priority=command.priority,
                admission=admission,
                extra=command.extra,
            )
        except RequestError as exc:
            self._refuse(identity, request_id, str(exc), invalid=True, param=exc.param)
            return
        except RequestFailedError as exc:
            self._refuse(identity, request_id, str(exc), invalid=False)
            return
        except Exception as exc:  # this request fails; the engine goes on
            logger.exception("queueing request %s failed", request_id)
            self._refuse(
                identity,
                request_id,
                f"queueing this request failed: {describe(exc)}",
                invalid=False,
            )
            return
        self._owners[request_id] = identity

    def _refuse(
        self,
        identity: bytes,
        request_id: str,
        error: str,
        *,
        invalid: bool,
        param: str | None = None,
    ) -> None:
        update = wire.RequestUpdate(
            request_id,
            [],
            True,
            RequestStatus.FINISHED_ABORTED.value,
            error=error,
            invalid=invalid,
            error_param=param,
        )
        self._send(identity, wire.StepOutputs([update], self.engine.stats()))

    def _abort(self, request_id: str) -> StepUpdate | None:
        try:
            request = self.engine.abort_request(request_id)
        except Exception:  # the client is gone or the server is stopping: log, go on
            logger.exception("aborting request %s failed", request_id)
            return None
        return None if request is None else StepUpdate(request, [], None, True)

    def _abort_all(self, identity: bytes, *, notify: bool) -> None:
        ended = [rid for rid, owner in self._owners.items() if owner == identity]
        updates = []
        for request_id in ended:
            del self._owners[request_id]
            update = self._abort(request_id)
            if update is not None:
                updates.append(wire.request_update(update))
        if notify:
            self._send(identity, wire.StepOutputs(updates, self.engine.stats()))

    # -- outputs ------------------------------------------------------------------------

    def _publish(self, updates: list[StepUpdate]) -> None:
        """One message per front end: its updates of the step, and the counters (to a front
        end without updates, when :data:`STATS_INTERVAL_S` has passed: its heartbeat)."""
        by_owner: dict[bytes, list[wire.RequestUpdate]] = {}
        for update in updates:
            request_id = update.request.request_id
            owner = self._owners.get(request_id)
            if owner is None:  # aborted by its front end during the step
                continue
            by_owner.setdefault(owner, []).append(wire.request_update(update))
            if update.finished:
                del self._owners[request_id]
        now = time.monotonic()
        due = [i for i, sent in self._stats_sent.items() if now - sent >= STATS_INTERVAL_S]
        if not by_owner and not due:
            return
        stats = self.engine.stats()
        for identity in set(by_owner).union(due):
            self._send(identity, wire.StepOutputs(by_owner.get(identity, []), stats))
            if identity in self._stats_sent:
                self._stats_sent[identity] = now

    def _fail(self, reason: str) -> None:
        for identity in list(self._stats_sent):
            self._send(identity, wire.EngineFailed(reason))

    def _send(self, identity: bytes, message: wire.FromEngine) -> None:
        try:
            self.socket.send_multipart([identity, wire.encode(message)], copy=False)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._forget(identity)

    def _forget(self, identity: bytes) -> None:
        """A front end that is gone without a goodbye (it died): abort its requests."""
        num_requests = sum(owner == identity for owner in self._owners.values())
        self._abort_all(identity, notify=False)
        if self._stats_sent.pop(identity, None) is not None or num_requests:
            log.warning("frontend_gone", aborted=num_requests)
