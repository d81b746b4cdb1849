"""The engine watchdog (``brigade.server.liveness``) alone: silence for the timeout is a hang,
reported once; an engine heard from, or whose words wait unread, is not hung; a silent
process is killed, and one that exits says how long it had been silent.

The end-to-end checks (a real server whose step hangs) are in test_server_hang.py.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Callable

from brigade.server.liveness import ProcessWatch, Watchdog

DEADLINE_S = 10.0
"""Bounds every wait for a report (a loaded machine is slow, never this slow)."""


async def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


def test_silence_for_the_timeout_is_a_hang_reported_once() -> None:
    hangs: list[float] = []

    async def main() -> None:
        watchdog = Watchdog(0.2, hangs.append)
        watchdog.start()
        await wait_for(lambda: bool(hangs))
        await asyncio.sleep(0.5)  # and not again

    asyncio.run(main())
    assert len(hangs) == 1
    assert hangs[0] >= 0.2


def test_an_engine_heard_from_is_not_hung() -> None:
    hangs: list[float] = []

    async def main() -> None:
        watchdog = Watchdog(0.5, hangs.append)
        watchdog.start()
        for _ in range(15):  # 1.5 s, three timeouts
            await asyncio.sleep(0.1)
            watchdog.heard()
        watchdog.stop()

    asyncio.run(main())
    assert hangs == []


def test_words_waiting_unread_are_not_a_hang() -> None:
    hangs: list[float] = []
    unread = [True]

    async def main() -> None:
        watchdog = Watchdog(0.2, hangs.append, pending=lambda: unread[0])
        watchdog.start()
        await asyncio.sleep(0.6)
        assert hangs == []
        unread[0] = False
        await wait_for(lambda: bool(hangs))

    asyncio.run(main())
    assert len(hangs) == 1


def test_a_zero_timeout_never_fires() -> None:
    hangs: list[float] = []

    async def main() -> None:
        Watchdog(0.0, hangs.append).start()
        await asyncio.sleep(0.3)

    asyncio.run(main())
    assert hangs == []


def watch(pid: int, timeout_s: float, silence_s: float = 0.0) -> list[str]:
    """What a :class:`ProcessWatch` over ``pid`` reports, waiting ``silence_s`` first."""
    reasons: list[str] = []

    async def main() -> None:
        process_watch = ProcessWatch(pid, timeout_s, reasons.append)
        process_watch.start()
        await asyncio.sleep(silence_s)
        await wait_for(lambda: bool(reasons))
        process_watch.close()

    asyncio.run(main())
    return reasons


def test_a_silent_process_is_killed_and_its_end_says_why() -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        reasons = watch(child.pid, 0.3)
        assert child.wait(timeout=DEADLINE_S) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()
    assert len(reasons) == 1
    assert "made no progress for" in reasons[0]
    assert "engine_step_timeout_s = 0.3" in reasons[0]
    assert f"killed it (pid {child.pid})" in reasons[0]


def test_a_process_that_exits_says_how_long_it_had_made_no_progress() -> None:
    quick = subprocess.Popen(["sleep", "0.1"])
    assert watch(quick.pid, 0.0) == [f"the engine process (pid {quick.pid}) exited"]
    quick.wait()
    slow = subprocess.Popen(["sleep", "1.3"])  # silent longer than any heartbeat's gap
    [reason] = watch(slow.pid, 0.0)
    slow.wait()
    assert reason.startswith(f"the engine process (pid {slow.pid}) exited after it made no ")
