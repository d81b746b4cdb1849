"""A front end's side of the engine process: ``AsyncEngine``'s interface over ZMQ.

:meth:`EngineClient.connect` waits (blocking, before the HTTP server starts) for the engine's
:class:`~brigade.server.engine_protocol.Ready` and its :class:`EngineInfo`; :meth:`start`
then opens the DEALER the requests travel on, on the server's event loop. Each step's
message is fanned out to the requests' streams as ``StepUpdate``\\ s over a front-end copy of
each ``Request`` (prompt, output tokens, status), so detokenization and the handlers read
what they read in thread mode.

Admission runs here on :class:`EngineInfo` alone (``check_request``), so a bad request is a
400 without a round trip; the grammar compiles in the engine process and an invalid one is
the request's first update (``RequestError`` -> 400).

The engine's death is seen within a second: an engine on this machine (an ``ipc://``
address) through a pidfd on its process id (readable when the process exits, whoever its
parent is); a remote one (a Ray actor at a ``tcp://`` address, reached over CURVE with the
run's keys) through its connection (``brigade.server.engine_link``). An
:class:`EngineFailed` message says why when the engine died on its own terms. Every stream
then ends with ``EngineDeadError``, :attr:`dead` is set and ``on_dead`` is called.

A hung engine (alive, but stuck in one step) is made a dead one: when nothing has come from
it for ``[server] engine_step_timeout_s`` (``brigade.server.liveness``), this front end kills
it with SIGKILL, so every front end and the supervisor see it die as above; the reason names
the silence and the key. A remote engine cannot be killed from here: it leaves rotation.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence

import zmq
import zmq.asyncio

from brigade.admission import Admission, check_request
from brigade.engine import EngineStats, StepUpdate
from brigade.errors import EngineDeadError, RequestError
from brigade.interfaces import ExtraValue, PoolingParams, Request, RequestStatus, SamplingParams
from brigade.sampling_stage import TokenLogprob
from brigade.server import engine_protocol as wire
from brigade.server.engine_link import (
    ConnectionWatch,
    FrontendKeys,
    secure_frontend_socket,
    wait_for_engine,
    watch_engine,
)
from brigade.server.liveness import ProcessWatch
from brigade.server.request_streams import RequestStreams

__all__ = ["EngineClient"]

_LINGER_MS = 500
"""At shutdown, how long a last message (Goodbye) may take to leave."""


class EngineClient(RequestStreams):
    """``AsyncEngine``'s interface for a front end whose engine runs in another process."""

    def __init__(
        self,
        info: wire.EngineInfo,
        stats: EngineStats,
        address: str,
        *,
        frontend: int,
        max_waiting_requests: int,
        step_timeout_s: float = 0.0,
        on_dead: Callable[[str], None] | None = None,
        keys: FrontendKeys | None = None,
    ) -> None:
        super().__init__(max_waiting_requests=max_waiting_requests, on_dead=on_dead)
        self.info = info
        self.address = address
        self.frontend = frontend
        self.keys = keys
        self.snapshot: EngineStats = stats
        """Engine counters as of the latest step message (read by /health and /metrics)."""
        self._streams: dict[str, tuple[Request, asyncio.Queue[StepUpdate | BaseException]]] = {}
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._receiver: asyncio.Task[None] | None = None
        self._step_timeout_s = step_timeout_s
        self._watch: ProcessWatch | ConnectionWatch | None = None

    @classmethod
    def connect(
        cls,
        address: str,
        engine_pid: int | None,
        *,
        frontend: int,
        max_waiting_requests: int,
        step_timeout_s: float = 0.0,
        keys: FrontendKeys | None = None,
    ) -> EngineClient:
        """Wait until the engine at ``address`` is ready (``wait_for_engine``: ``engine_pid``
        None for a remote one, ``keys`` to reach it over CURVE). ``step_timeout_s``: once
        started, give the engine up when it sends nothing for this long (0: never)."""
        ready = wait_for_engine(address, engine_pid, keys)
        return cls(
            ready.info,
            ready.stats,
            address,
            frontend=frontend,
            max_waiting_requests=max_waiting_requests,
            step_timeout_s=step_timeout_s,
            keys=keys,
        )

    # -- event-loop side ----------------------------------------------------------------

    async def start(self) -> None:
        """Open the request socket and watch the engine (on the server's loop)."""
        loop = asyncio.get_running_loop()
        self._context = zmq.asyncio.Context()
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.LINGER, _LINGER_MS)
        if self.keys is not None:
            secure_frontend_socket(socket, self.keys)
        # Before connecting, so that no event of the connection is missed.
        self._watch = watch_engine(
            self.address, self.info.pid, self._step_timeout_s, self._die, socket, self._unread
        )
        socket.connect(self.address)
        self._socket = socket
        self._send(wire.Hello(frontend=self.frontend))
        self._receiver = loop.create_task(self._receive())

    def admit(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        pooling: PoolingParams | None = None,
    ) -> Admission:
        """The checks ``EngineCore.admit`` makes that need only :class:`EngineInfo`; the
        grammar compiles in the engine process (``grammar`` is None here)."""
        info = self.info
        check_request(
            prompt_token_ids, params, vocab_size=info.vocab_size, max_model_len=info.max_model_len
        )
        if pooling is not None:
            if not info.embeddings:
                raise RequestError(
                    f"embeddings are not available: the executor {info.executor!r} returns no "
                    "hidden states",
                    param="input",
                )
            if params.structured_output is not None:
                raise RequestError(
                    "an embedding request generates no text to constrain",
                    param="structured_output",
                )
        elif params.structured_output is not None and not info.structured_output:
            raise RequestError(
                "structured output is not available: this executor returns token ids, not logits",
                param="structured_output",
            )
        return Admission(list(prompt_token_ids), params, None, pooling=pooling)

    def _submit(
        self,
        request_id: str,
        admission: Admission,
        params: SamplingParams,
        priority: int,
        extra: Mapping[str, ExtraValue],
        sink: asyncio.Queue[StepUpdate | BaseException],
    ) -> None:
        request = Request(
            request_id,
            admission.prompt_token_ids,
            params,
            priority=priority,
            extra=extra,
            pooling=admission.pooling,
        )
        if self._socket is None:
            raise EngineDeadError("this front end is not connected to the engine")
        self._streams[request_id] = (request, sink)
        command = wire.AddRequest(
            request_id,
            admission.prompt_token_ids,
            params,
            priority=priority,
            extra=dict(extra),
            pooling=admission.pooling,
        )
        self._send(command)

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self._send(wire.Abort([request_id]))

    def abort_all(self) -> None:
        self._send(wire.AbortAll())

    def shutdown(self, timeout: float = 5.0) -> None:
        """Say goodbye (the engine aborts this front end's requests) and close the socket;
        the supervisor stops the engine once every front end has left."""
        self._stopped = True
        if self._watch is not None:
            self._watch.close()  # its event loop has closed, with its reader
        if self._socket is None or self._context is None:
            return
        # The event loop has stopped: send through a blocking shadow of the same socket.
        with contextlib.suppress(zmq.ZMQError):
            zmq.Socket.shadow(self._socket.underlying).send(
                wire.encode(wire.Goodbye()), zmq.NOBLOCK
            )
        self._socket.close()
        self._context.term()
        self._socket = None

    def _send(self, message: wire.ToEngine) -> None:
        if self._socket is not None:  # else shut down: the engine forgot this front end
            self._socket.send(wire.encode(message), copy=False)

    async def _receive(self) -> None:
        socket = self._socket
        if socket is None:
            return
        while True:
            try:
                data = await socket.recv()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            if self._watch is not None:
                self._watch.heard()
            message = wire.decode_from_engine(data)
            if isinstance(message, wire.EngineFailed):
                self._die(f"the engine failed: {message.reason}")
                return
            # Published before the updates: a client that sees a token can see the engine's
            # state as of that step.
            self.snapshot = message.stats
            if self.on_snapshot is not None:
                self.on_snapshot(message.stats)
            if isinstance(message, wire.StepOutputs):
                for update in message.updates:
                    self._deliver(update)

    def _deliver(self, update: wire.RequestUpdate) -> None:
        stream = self._streams.get(update.request_id)
        if stream is None:  # aborted here while the engine stepped
            return
        request, sink = stream
        request.output_token_ids.extend(update.new_token_ids)
        request.status = RequestStatus(update.status)
        if update.first_scheduled_time is not None:
            request.first_scheduled_time = update.first_scheduled_time
        logprobs = (
            None
            if update.logprobs is None
            else [TokenLogprob(t, lp, tuple(top)) for t, lp, top in update.logprobs]
        )
        sink.put_nowait(
            StepUpdate(
                request,
                update.new_token_ids,
                logprobs,
                update.finished,
                error=update.error,
                invalid=update.invalid,
                error_param=update.error_param,
                embedding=update.embedding,
            )
        )
        if update.finished:
            del self._streams[update.request_id]

    @property
    def no_progress_s(self) -> float:
        """Seconds since the engine's last message (0 while its messages wait unread: it
        spoke, this event loop was busy)."""
        if self._watch is None or self._unread():
            return 0.0
        return self._watch.watchdog.silence_s

    def _unread(self) -> bool:
        """Messages from the engine wait on the socket (this event loop was busy)."""
        socket = self._socket
        return socket is not None and bool(int(socket.get(zmq.EVENTS)) & zmq.POLLIN)

    def _die(self, reason: str) -> None:
        if self.dead is not None:
            return
        self.dead = reason
        error = EngineDeadError(reason)
        for _, sink in self._streams.values():
            sink.put_nowait(error)
        self._streams.clear()
        if self.on_dead is not None:
            self.on_dead(reason)
