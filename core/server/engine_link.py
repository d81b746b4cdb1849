"""How a front end reaches an engine and watches it: an engine process on this machine at
an ``ipc://`` address, or a replica in a Ray actor (``brigade.server.ray_replicas``) at a
``tcp://`` one.

An ``ipc://`` socket is a file in the supervisor's private directory; a TCP port can be
reached by anyone on the network. So the link is ZMQ CURVE: encrypted, and the engine admits
only front ends that hold the key the supervisor generated for this run (a ZAP handler checks
each connection's public key; any other is refused during the handshake). The supervisor
hands the engine side its keys through Ray and the front ends theirs when it spawns them; no
key is written to disk or to the log. libzmq without CURVE is refused with a ``ConfigError``.

A process id means nothing on another machine, so a front end cannot watch a remote engine
through a pidfd. :class:`ConnectionWatch` watches the connection instead: the engine's
process exiting closes it at once (the kernel sends FIN), and a node that vanishes without a
word (power, network) stops answering ZMQ's heartbeats, which libzmq's own threads send and
answer even while a step holds the GIL. Silence on the link (a hung step) is the usual
``engine_step_timeout_s`` watchdog; a remote engine cannot be killed from a front end, so it
is only taken out of rotation.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import os
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from brigade.errors import ConfigError, EngineDeadError
from brigade.server import engine_protocol as wire
from brigade.server.liveness import (
    ProcessWatch,
    Watchdog,
    no_progress,
    open_pidfd,
    process_alive,
    report_hang,
)

__all__ = [
    "HEARTBEAT_TIMEOUT_MS",
    "REMOTE_READY_S",
    "ConnectionWatch",
    "EngineKeys",
    "FrontendKeys",
    "bind_tcp",
    "generate_keys",
    "secure_engine_socket",
    "secure_frontend_socket",
    "wait_for_engine",
    "watch_engine",
]

HEARTBEAT_INTERVAL_MS = 250
"""How often a front end's socket pings a remote engine (libzmq's I/O thread answers)."""
HEARTBEAT_TIMEOUT_MS = 1500
"""A remote engine's connection that answers nothing for this long is lost: its node is gone.
Several intervals, so that a loaded machine's scheduling delays are not taken for a death;
an engine process that exits closes its connections at once, without waiting for this."""
REMOTE_READY_S = 60.0
"""How long a remote engine, loaded before the front ends start, may take to answer."""
_PROBE_POLL_MS = 200
_LOST = zmq.EVENT_DISCONNECTED
_REFUSED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


@dataclasses.dataclass(frozen=True, repr=False)
class EngineKeys:
    """What an engine needs to serve the front ends over CURVE (z85-encoded keys)."""

    public: bytes
    secret: bytes
    frontend_public: bytes
    """The one client key the engine admits."""


@dataclasses.dataclass(frozen=True, repr=False)
class FrontendKeys:
    """What a front end needs to reach the engines over CURVE (z85-encoded keys)."""

    engine_public: bytes
    public: bytes
    secret: bytes


def require_curve() -> None:
    """A ``ConfigError`` unless this libzmq can encrypt and authenticate (CURVE)."""
    if not zmq.has("curve"):
        raise ConfigError(
            f"engine replicas on Ray talk to the front ends over TCP, which Brigade protects "
            f"with ZMQ CURVE, and this libzmq ({zmq.zmq_version()}) was built without it: "
            "install a pyzmq wheel (they bundle libzmq with CURVE) or set "
            'distributed_executor_backend = "mp"'
        )


def generate_keys() -> tuple[EngineKeys, FrontendKeys]:
    """Fresh keys for one run: the engines' side and the front ends' side."""
    require_curve()
    engine_public, engine_secret = zmq.curve_keypair()
    frontend_public, frontend_secret = zmq.curve_keypair()
    return (
        EngineKeys(engine_public, engine_secret, frontend_public),
        FrontendKeys(engine_public, frontend_public, frontend_secret),
    )


class _FrontendKeyOnly:
    """A ZAP credentials check: the front ends' key, and no other."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.key)


def secure_engine_socket(
    context: zmq.Context[zmq.Socket[bytes]], socket: zmq.Socket[bytes], keys: EngineKeys
) -> ThreadAuthenticator:
    """Make ``socket`` (not yet bound) a CURVE server that admits only the front ends' key.
    The returned authenticator (a thread of ``context``) must be stopped before ``context``
    is terminated."""
    require_curve()
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve_callback(
        "*", credentials_provider=_FrontendKeyOnly(keys.frontend_public)
    )
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_server = True
    return authenticator


def secure_frontend_socket(socket: zmq.Socket[Any], keys: FrontendKeys) -> None:
    """Make ``socket`` (not yet connected) a CURVE client of the engines, pinging them
    (:data:`HEARTBEAT_INTERVAL_MS`) so that a silent node's death drops the connection."""
    socket.curve_serverkey = keys.engine_public
    socket.curve_publickey = keys.public
    socket.curve_secretkey = keys.secret
    socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_INTERVAL_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


def bind_tcp(socket: zmq.Socket[bytes], host: str) -> str:
    """Bind ``socket`` to a free port on ``host`` (this node's address, not every
    interface); the address the front ends connect to."""
    if ":" in host:  # IPv6
        socket.ipv6 = True
        host = f"[{host}]"
    socket.bind(f"tcp://{host}:*")
    return socket.getsockopt_string(zmq.LAST_ENDPOINT)


class ConnectionWatch:
    """A front end's watch over an engine it reaches over TCP, on its event loop: calls
    ``on_gone(reason)`` once, when the connection is lost (the engine's process or node died,
    see the module docstring), when the engine refuses this front end's key, or when the
    engine has been silent for ``timeout_s`` (:meth:`heard` not called; 0: never)."""

    def __init__(
        self,
        address: str,
        timeout_s: float,
        on_gone: Callable[[str], None],
        *,
        pending: Callable[[], bool] | None = None,
    ) -> None:
        self.address = address
        self.on_gone = on_gone
        self.watchdog = Watchdog(timeout_s, self._hung, pending=pending)
        self._socket: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._events: asyncio.Task[None] | None = None
        """The reader of the monitor's events (held: the loop keeps only a weak reference)."""
        self._gone = False

    def heard(self) -> None:
        """The engine spoke: it is making progress."""
        self.watchdog.heard()

    def start(self, socket: zmq.asyncio.Socket) -> None:
        """Watch ``socket``'s connection to the engine (on the running event loop); call
        before it connects, so that no event is missed."""
        self._socket = socket
        self._monitor = socket.get_monitor_socket(_LOST | _REFUSED)
        self._events = asyncio.get_running_loop().create_task(self._read_events(self._monitor))
        self.watchdog.start()

    def close(self) -> None:
        """Stop the socket's event reports and close their socket (after the event loop, and
        its reader, are gone), so that the socket's context can be terminated."""
        if self._socket is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._socket.disable_monitor()
            self._socket = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None

    async def _read_events(self, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event & _REFUSED:
                    self._end(f"the engine at {self.address} refused this front end's key")
                    return
                if event & _LOST:
                    self._end(
                        f"the connection to the engine at {self.address} was lost (its "
                        "process or its node died)"
                    )
                    return
        except (zmq.ZMQError, asyncio.CancelledError):  # closed, or the loop is ending
            return

    def _hung(self, silence_s: float) -> None:
        timeout = self.watchdog.timeout_s
        report_hang(silence_s, timeout, f"stopped sending to the engine at {self.address}")
        self._end(f"the engine failed: {no_progress(silence_s, timeout)}")

    def _end(self, reason: str) -> None:
        if self._gone:
            return
        self._gone = True
        self.watchdog.stop()
        self.on_gone(reason)


def wait_for_engine(address: str, engine_pid: int | None, keys: FrontendKeys | None) -> wire.Ready:
    """Block until the engine at ``address`` answers a probe (it may be loading its model).
    ``EngineDeadError`` if its process ``engine_pid`` exits first, or, for a remote engine
    (``engine_pid`` None: loaded before the front ends start), if it does not answer within
    :data:`REMOTE_READY_S`. ``keys``: reach it over CURVE."""
    context = zmq.Context()
    probe = context.socket(zmq.DEALER)
    probe.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        secure_frontend_socket(probe, keys)
    pidfd = None if engine_pid is None else open_pidfd(engine_pid)
    deadline = time.monotonic() + REMOTE_READY_S
    try:
        probe.connect(address)
        probe.send(wire.encode(wire.Hello(frontend=-1)))
        poller = zmq.Poller()
        poller.register(probe, zmq.POLLIN)
        if pidfd is not None:
            poller.register(pidfd, zmq.POLLIN)
        while True:
            events = dict(poller.poll(_PROBE_POLL_MS))
            if probe in events:
                reply = wire.decode_from_engine(probe.recv())
                if isinstance(reply, wire.Ready):
                    return reply
            if engine_pid is None:
                if time.monotonic() > deadline:
                    raise EngineDeadError(
                        f"the engine at {address} did not answer within {REMOTE_READY_S:g} s: "
                        "its Ray actor died, or it refused this front end's key"
                    )
            elif (pidfd is not None and pidfd in events) or not process_alive(engine_pid):
                raise EngineDeadError(
                    f"the engine process (pid {engine_pid}) exited while starting; its output "
                    "above says why"
                )
    finally:
        if pidfd is not None:
            os.close(pidfd)
        probe.close()
        context.term()


def watch_engine(
    address: str,
    pid: int,
    timeout_s: float,
    on_gone: Callable[[str], None],
    socket: zmq.asyncio.Socket,
    pending: Callable[[], bool],
) -> ProcessWatch | ConnectionWatch:
    """Start watching the engine at ``address`` (its process ``pid`` on its machine) that
    ``socket`` is about to connect to: through a pidfd when it is on this machine (``ipc://``),
    else through the connection. ``timeout_s``: the hung-step watchdog's."""
    if address.startswith("ipc://"):
        watch = ProcessWatch(pid, timeout_s, on_gone, pending=pending)
        watch.start()
        return watch
    remote = ConnectionWatch(address, timeout_s, on_gone, pending=pending)
    remote.start(socket)
    return remote
