"""What ``/health`` and ``/ping`` make of the server's state: the status, its precedence and
its HTTP code, and the front-end count read from the flags the supervisor shares."""

from __future__ import annotations

import ctypes
import multiprocessing.sharedctypes
from types import SimpleNamespace
from typing import Any

import pytest

from brigade.server.health import STALLED_AFTER_S, FrontendRoster, can_serve, server_health


def state(
    *,
    dead: str | None = None,
    shutting_down: bool = False,
    no_progress_s: float = 0.0,
    engines: tuple[int, int] = (1, 1),
    frontends: list[int] | None = None,
) -> Any:
    """A stand-in for ``ServerState``: what ``server_health`` reads of it."""
    alive, total = engines
    engine = SimpleNamespace(
        dead=dead, num_engines=total, num_engines_alive=alive, no_progress_s=no_progress_s
    )
    return SimpleNamespace(
        async_engine=engine, shutting_down=shutting_down, frontends=FrontendRoster(frontends)
    )


def test_a_healthy_server_is_ok_with_its_counts() -> None:
    health = server_health(state(engines=(2, 2), frontends=[1, 1]))
    assert (health.status, health.http_status) == ("ok", 200)
    assert (health.engines_alive, health.engines_total) == (2, 2)
    assert (health.frontends_alive, health.frontends_total) == (2, 2)


@pytest.mark.parametrize(
    ("engines", "frontends"), [((1, 2), [1, 1]), ((2, 2), [1, 0]), ((1, 3), [0, 1, 1])]
)
def test_a_lost_replica_or_front_end_is_degraded_but_still_serving(
    engines: tuple[int, int], frontends: list[int]
) -> None:
    served = state(engines=engines, frontends=frontends)
    health = server_health(served)
    assert (health.status, health.http_status, can_serve(served)) == ("degraded", 200, True)
    assert health.engines_alive == engines[0]
    assert health.frontends_alive == sum(frontends)


def test_a_long_step_is_stalled_503_for_readiness_but_alive_for_liveness() -> None:
    assert server_health(state(no_progress_s=STALLED_AFTER_S - 0.1)).status == "ok"
    stalled = state(no_progress_s=STALLED_AFTER_S, engines=(1, 2))
    health = server_health(stalled)
    assert (health.status, health.http_status, can_serve(stalled)) == ("stalled", 503, True)
    assert health.no_progress_s == STALLED_AFTER_S


def test_a_dead_engine_or_a_drain_comes_first_and_ends_liveness() -> None:
    dead = state(dead="gone", shutting_down=True, no_progress_s=60.0)
    failed = server_health(dead)
    assert (failed.status, failed.http_status, can_serve(dead)) == ("engine failed", 503, False)
    stopping = state(shutting_down=True, no_progress_s=60.0, frontends=[1, 0])
    draining = server_health(stopping)
    assert (draining.status, draining.http_status) == ("shutting down", 503)
    assert not can_serve(stopping)


def test_the_roster_reads_the_supervisors_shared_flags() -> None:
    flags = multiprocessing.sharedctypes.RawArray(ctypes.c_byte, [1, 1, 1])
    roster = FrontendRoster(flags)
    assert (roster.alive, roster.total) == (3, 3)
    flags[1] = 0  # what the supervisor does when front end 1 exits
    assert (roster.alive, roster.total) == (2, 3)
    assert (FrontendRoster().alive, FrontendRoster().total) == (1, 1)  # a lone front end
