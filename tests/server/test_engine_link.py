"""The engine's TCP link (``serve -dp N`` on Ray): only the front ends' key gets an answer, a
front end with another key is told it was refused, and a front end hears when the engine's
end goes away: at once when it closes, within the heartbeat timeout when it falls silent (a
lost node). An echoing ROUTER stands in for the engine: no model, no Ray."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

import pytest
import zmq
import zmq.asyncio

from brigade.server.engine_link import (
    HEARTBEAT_TIMEOUT_MS,
    ConnectionWatch,
    EngineKeys,
    FrontendKeys,
    bind_tcp,
    generate_keys,
    secure_engine_socket,
    secure_frontend_socket,
)
from brigade.server.engine_process import open_engine_socket

ANSWER_S = 5.0
"""Bounds every wait for something that must happen (a loaded machine is slow, never this
slow)."""
SILENCE_MS = 1000
"""How long a refused client waits to be sure no answer comes."""

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


@contextlib.contextmanager
def echo_engine(keys: EngineKeys) -> Iterator[tuple[str, Callable[[], None]]]:
    """(address, stop) of a CURVE ROUTER on 127.0.0.1 that echoes every message; ``stop``
    closes its socket, as an engine's exit does."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socket = open_engine_socket(context)
    authenticator = secure_engine_socket(context, socket, keys)
    address = bind_tcp(socket, "127.0.0.1")
    stopping = threading.Event()

    def serve() -> None:
        while not stopping.is_set():
            if socket.poll(20):
                identity, data = socket.recv_multipart()
                socket.send_multipart([identity, b"echo " + data])
        socket.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def stop() -> None:
        stopping.set()
        thread.join()

    try:
        yield address, stop
    finally:
        stop()
        authenticator.stop()
        context.term()


def ask(address: str, secure: Callable[[zmq.Socket[bytes]], None], wait_ms: int) -> bytes | None:
    """Send one message from a fresh DEALER set up by ``secure``; the answer, or None."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        secure(dealer)
        dealer.connect(address)
        dealer.send(b"hello")
        return dealer.recv() if dealer.poll(wait_ms) else None
    finally:
        dealer.close()
        context.term()


def test_only_the_front_ends_key_gets_an_answer() -> None:
    engine_keys, frontend_keys = generate_keys()
    _, stranger = generate_keys()
    knows_the_engine = FrontendKeys(frontend_keys.engine_public, stranger.public, stranger.secret)
    with echo_engine(engine_keys) as (address, _):
        assert address.startswith("tcp://127.0.0.1:")
        assert ask(address, lambda s: None, SILENCE_MS) is None, "a plain client got in"
        assert (
            ask(address, lambda s: secure_frontend_socket(s, knows_the_engine), SILENCE_MS) is None
        )
        answer = ask(
            address, lambda s: secure_frontend_socket(s, frontend_keys), int(ANSWER_S * 1000)
        )
        assert answer == b"echo hello"


def test_a_front_end_hears_a_refused_key_and_a_lost_engine() -> None:
    engine_keys, frontend_keys = generate_keys()
    _, stranger = generate_keys()
    refused = FrontendKeys(frontend_keys.engine_public, stranger.public, stranger.secret)
    with echo_engine(engine_keys) as (address, stop):
        assert asyncio.run(watch(address, refused)).endswith("refused this front end's key")
        reason = asyncio.run(watch(address, frontend_keys, then=stop))
        assert reason.startswith(f"the connection to the engine at {address} was lost"), reason


FROZEN_ENGINE = """
import sys, zmq
public, secret = sys.argv[1].encode(), sys.argv[2].encode()
socket = zmq.Context().socket(zmq.ROUTER)
socket.curve_secretkey, socket.curve_publickey, socket.curve_server = secret, public, True
socket.bind("tcp://127.0.0.1:*")
print(socket.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
while True:
    identity, data = socket.recv_multipart()
    socket.send_multipart([identity, b"echo " + data])
"""


def test_a_front_end_hears_a_silent_engine_as_lost() -> None:
    """An engine whose machine stops (SIGSTOP: its connections stay open, nothing answers)
    is lost once ZMQ's heartbeats go unanswered."""
    engine_keys, frontend_keys = generate_keys()
    engine = subprocess.Popen(
        [
            sys.executable,
            "-c",
            FROZEN_ENGINE,
            engine_keys.public.decode(),
            engine_keys.secret.decode(),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert engine.stdout is not None
        address = engine.stdout.readline().strip()
        reason = asyncio.run(
            watch(address, frontend_keys, then=lambda: engine.send_signal(signal.SIGSTOP))
        )
        assert reason.startswith(f"the connection to the engine at {address} was lost"), reason
    finally:
        engine.kill()
        engine.wait()


def test_an_engine_that_stops_talking_is_given_up_after_the_step_timeout() -> None:
    """Connected but silent (a hung step): the watchdog's reason, since a front end cannot
    kill a remote engine."""
    engine_keys, frontend_keys = generate_keys()
    with echo_engine(engine_keys) as (address, _):
        reason = asyncio.run(watch(address, frontend_keys, then=lambda: None, step_timeout_s=1.0))
    assert reason.startswith("the engine failed: it made no progress for 1."), reason


async def watch(
    address: str,
    keys: FrontendKeys,
    then: Callable[[], None] | None = None,
    step_timeout_s: float = 0.0,
) -> str:
    """Connect as a front end does, run ``then`` once the engine answered, and return the
    reason the watch gives for the engine's end (``step_timeout_s``: the hung-step watchdog's,
    counted from the answer)."""
    reasons: asyncio.Queue[str] = asyncio.Queue()
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    secure_frontend_socket(socket, keys)
    connection = ConnectionWatch(address, step_timeout_s, reasons.put_nowait)
    connection.start(socket)
    socket.connect(address)
    try:
        if then is not None:
            await socket.send(b"hello")
            assert await asyncio.wait_for(socket.recv(), ANSWER_S) == b"echo hello"
            connection.heard()
            then()
        return await asyncio.wait_for(reasons.get(), ANSWER_S + HEARTBEAT_TIMEOUT_MS / 1000)
    finally:
        connection.close()
        socket.close()
        context.term()
