"""A hung engine (alive, stuck in one step) through the real server: with ``[server]
engine_step_timeout_s`` the front ends notice the silence, kill the engine process, end its
streams with an error that says why, answer 503 and exit 1; in thread mode the engine is
declared failed the same way. An idle engine is never taken for a hung one.

The hang: the ``faulty`` sampler never returns from ``apply`` for a request with priority
``HANG`` once it has 2 tokens (tests/faulty_plugins.py).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import faulty_plugins
import httpx
import psutil
import pytest
from faulty_plugins import HANG
from server_harness import (
    completion,
    log_events,
    running_server,
    server_log,
    tiny_model,
    tiny_server_config,
)

TIMEOUT_S = 1.5
HANGING = '\n[sampler]\nplugin = "faulty"\nfail_after_tokens = 2\n'


@contextlib.contextmanager
def hanging_server(workdir: Path, args: list[str]) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A server whose engine hangs on a ``HANG`` request, with a short step timeout."""
    env = faulty_plugins.install_entry_point(workdir / "plugins")
    server = f"engine_step_timeout_s = {TIMEOUT_S}\n"
    config = tiny_server_config(tiny_model(workdir), max_model_len=256, num_pages=64, server=server)
    with running_server(config + HANGING, workdir, args=args, env=env) as served:
        yield served


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    """Two front ends and one engine process; the module's last test hangs the engine."""
    workdir = tmp_path_factory.mktemp("hang")
    with hanging_server(workdir, ["--api-server-count", "2"]) as (base, process):
        yield base, process, workdir


def stream_a_hanging_request(base: str) -> tuple[list[str], float]:
    """The SSE lines of a request whose step hangs, and the seconds they took."""
    body = {"prompt": [5, 6], "max_tokens": 50, "ignore_eos": True, "stream": True}
    started = time.monotonic()
    with httpx.stream(
        "POST",
        f"{base}/v1/completions",
        json={**body, "priority": HANG},
        timeout=httpx.Timeout(10, read=TIMEOUT_S + 10),  # no watchdog: a ReadTimeout
    ) as stream:
        assert stream.status_code == 200
        lines = [line for line in stream.iter_lines() if line]
    return lines, time.monotonic() - started


def assert_failed_for_no_progress(base: str, lines: list[str], took_s: float) -> None:
    """The stream ended with an error naming the hang and the key, soon; /health is 503."""
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert "made no progress for" in error["message"], error
    assert f"engine_step_timeout_s = {TIMEOUT_S:g}" in error["message"], error
    assert took_s < TIMEOUT_S + 3, f"the hang was noticed after {took_s:.1f} s"
    health = [httpx.get(f"{base}/health", timeout=10) for _ in range(4)]  # any front end
    assert {h.status_code for h in health} == {503}
    assert {h.json()["status"] for h in health} == {"engine failed"}


def test_an_idle_engine_is_not_taken_for_a_hung_one(
    served: tuple[str, subprocess.Popen[bytes], Path],
) -> None:
    base, process, workdir = served
    deadline = time.monotonic() + 3 * TIMEOUT_S
    statuses = []
    while time.monotonic() < deadline:
        statuses.append(httpx.get(f"{base}/health", timeout=10).status_code)
        time.sleep(0.1)
    assert set(statuses) == {200}, statuses
    assert completion(base) == 4
    assert process.poll() is None
    assert not log_events(server_log(workdir, base), "engine_hung")


def test_a_hung_engine_is_killed_and_the_server_exits_1_leaving_nothing(
    served: tuple[str, subprocess.Popen[bytes], Path],
) -> None:
    """Last in the module."""
    base, process, workdir = served
    started = log_events(server_log(workdir, base), "processes_started")[0]
    pids = [int(pid) for pid in (*started["engine_pids"], *started["frontend_pids"])]
    lines, took_s = stream_a_hanging_request(base)
    assert_failed_for_no_progress(base, lines, took_s)
    assert process.wait(timeout=30) == 1
    log = server_log(workdir, base)
    hung = log_events(log, "engine_hung")
    assert hung, "no front end logged the hang"
    assert all(event["engine_step_timeout_s"] == TIMEOUT_S for event in hung)
    dead = log_events(log, "engine_dead")
    assert sorted(event["frontend"] for event in dead) == [0, 1]
    assert all("made no progress for" in event["reason"] for event in dead), dead
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie", pid


def test_a_hung_engine_thread_is_declared_failed_and_the_server_exits_1(
    tmp_path: Path,
) -> None:
    """``--disable-frontend-multiprocessing``: the thread cannot be killed, but the server
    fails the same way and exits, leaving the stuck thread behind."""
    with hanging_server(tmp_path, ["--disable-frontend-multiprocessing"]) as (base, process):
        lines, took_s = stream_a_hanging_request(base)
        assert_failed_for_no_progress(base, lines, took_s)
        assert process.wait(timeout=30) == 1
        hung = log_events(server_log(tmp_path, base), "engine_hung")
        assert [event["engine_step_timeout_s"] for event in hung] == [TIMEOUT_S]


def test_a_hung_replica_leaves_rotation_and_the_last_one_stops_the_server(
    tmp_path: Path,
) -> None:
    """``-dp 2``: the hung replica is killed and taken out of rotation like a dead one."""
    args = ["--data-parallel-size", "2", "--set", "router.plugin=round-robin"]
    with hanging_server(tmp_path, args) as (base, process):
        # Round-robin from a fresh front end: the first request goes to replica 0.
        lines, took_s = stream_a_hanging_request(base)
        assert "made no progress for" in lines[-2], lines[-2]
        assert took_s < TIMEOUT_S + 3, f"the hang was noticed after {took_s:.1f} s"
        assert [completion(base) for _ in range(3)] == [4, 4, 4]  # replica 1 serves them
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        failed = log_events(server_log(tmp_path, base), "engine_replica_failed")
        assert [(e["replica"], e["replicas_in_rotation"]) for e in failed] == [(0, 1)]

        lines, took_s = stream_a_hanging_request(base)  # on replica 1, the last one
        assert_failed_for_no_progress(base, lines, took_s)
        assert process.wait(timeout=30) == 1


def test_a_timeout_too_short_to_mean_anything_is_a_config_error() -> None:
    from brigade.errors import ConfigError
    from brigade.server.serve import serve

    with pytest.raises(ConfigError, match=r"engine_step_timeout_s = 0.5 .* at least 1"):
        serve(None, ["server.engine_step_timeout_s=0.5"])
