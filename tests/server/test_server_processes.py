"""``brigade serve`` as several processes: front ends sharing one port in front of one engine
process; the engine's death seen by every front end at once; nothing left behind.

One server with ``--api-server-count 2`` serves the module; its last test kills the engine.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from server_harness import (
    completion,
    free_port,
    frontends_that_answered,
    log_events,
    running_server,
    server_log,
    tiny_model,
    tiny_server_config,
)

ROUNDS = 10
"""Bounded: concurrent rounds until both front ends have answered."""
CONCURRENT = 8


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    workdir = tmp_path_factory.mktemp("processes")
    config = tiny_server_config(tiny_model(workdir), max_model_len=2048, num_pages=300)
    with running_server(config, workdir, args=["--api-server-count", "2"]) as (base, process):
        yield base, process, workdir


def pids(log: str) -> tuple[int, list[int]]:
    """The engine's and the front ends' process ids, from the supervisor's log line."""
    line = log_events(log, "processes_started")[0]
    return int(line["engine_pids"][0]), [int(pid) for pid in line["frontend_pids"]]


def test_two_front_ends_serve_concurrent_requests_on_one_port(
    served: tuple[str, subprocess.Popen[bytes], Path],
) -> None:
    base, process, workdir = served
    engine_pid, frontend_pids = pids(server_log(workdir, base))
    assert len(frontend_pids) == 2
    children = {child.pid for child in psutil.Process(process.pid).children()}
    assert {engine_pid, *frontend_pids} <= children
    with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        for _ in range(ROUNDS):
            tokens = list(pool.map(lambda _: completion(base), range(CONCURRENT)))
            assert tokens == [4] * CONCURRENT
            if frontends_that_answered(server_log(workdir, base)) == {0, 1}:
                break
    assert frontends_that_answered(server_log(workdir, base)) == {0, 1}
    # Both report the one engine's counters (broadcast with every step).
    health = [httpx.get(f"{base}/health", timeout=10).json() for _ in range(4)]
    assert all(h["status"] == "ok" and h["num_pages"] == 300 for h in health)


def test_a_killed_engine_is_seen_at_once_and_the_server_exits_1_leaving_nothing(
    served: tuple[str, subprocess.Popen[bytes], Path],
) -> None:
    """Last in the module: SIGKILL the engine process mid-stream."""
    base, process, workdir = served
    engine_pid, frontend_pids = pids(server_log(workdir, base))
    body = {"prompt": [5, 6], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        os.kill(engine_pid, signal.SIGKILL)
        killed = time.monotonic()
        statuses = []
        while time.monotonic() < killed + 1.0:  # the bound the process model promises
            statuses.append(httpx.get(f"{base}/health", timeout=10).status_code)
            if statuses[-1] == 503:
                break
        rest = [line for line in lines if line]
    assert statuses[-1] == 503, f"/health after the engine's death: {statuses}"
    # Several fresh connections: whichever front end answers knows.
    assert {httpx.get(f"{base}/health", timeout=10).status_code for _ in range(6)} == {503}
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][6:])["error"]
    assert "engine" in error["message"].lower()
    assert process.wait(timeout=30) == 1
    log = server_log(workdir, base)
    assert sorted(line["frontend"] for line in log_events(log, "engine_dead")) == [0, 1]
    for pid in (engine_pid, *frontend_pids):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie", pid


def test_several_front_ends_need_the_engine_process() -> None:
    from brigade.errors import ConfigError
    from brigade.server.serve import serve

    overrides = ["server.api_server_count=2", "server.engine_process=false"]
    with pytest.raises(ConfigError, match=r"api_server_count = 2 needs .*engine_process = true"):
        serve(None, overrides)


def test_a_model_that_cannot_load_is_a_startup_error_with_status_2(tmp_path: Path) -> None:
    """The engine and the front end each say why in one line; nothing is left behind. (A
    missing model is refused before they start: this one's tokenizer file fails in them.)"""
    missing = tiny_model(tmp_path) / "tokenizer_config.json"
    missing.write_text('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    result = subprocess.run(
        [sys.executable, "-m", "brigade", "serve", str(missing.parent), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "brigade: error: " in output, output
    assert str(missing) in output, output
    assert "Traceback" not in output, output
    engine_pid, frontend_pids = pids(output)
    for pid in (engine_pid, *frontend_pids):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie", pid


def test_the_engine_on_a_thread_is_one_process(tmp_path: Path) -> None:
    """``--disable-frontend-multiprocessing`` ([server] engine_process = false)."""
    config = tiny_server_config(tiny_model(tmp_path), max_model_len=64, num_pages=64)
    args = ["--disable-frontend-multiprocessing"]
    with running_server(config, tmp_path, args=args) as (base, process):
        assert completion(base) == 4
        assert psutil.Process(process.pid).children() == []
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    assert not log_events(server_log(tmp_path, base), "processes_started")


def test_a_supervisor_killed_with_sigkill_leaves_no_process_and_no_socket(
    tmp_path: Path,
) -> None:
    """The engine and the front end notice their parent is gone and exit; the engine removes
    its socket and the supervisor's private run directory, which the supervisor cannot."""
    config = tiny_server_config(tiny_model(tmp_path), max_model_len=64, num_pages=64)
    with running_server(config, tmp_path) as (base, process):
        assert completion(base) == 4
        started = log_events(server_log(tmp_path, base), "processes_started")[0]
        socket_path = Path(started["addresses"][0].removeprefix("ipc://"))
        assert socket_path.exists()
        children = [int(started["engine_pids"][0]), *map(int, started["frontend_pids"])]
        process.kill()
        process.wait(timeout=10)
        deadline = time.monotonic() + 10  # bounded: the children poll their parent
        while time.monotonic() < deadline and any(psutil.pid_exists(pid) for pid in children):
            time.sleep(0.1)
    for pid in children:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie", pid
    assert not socket_path.exists()
    assert not socket_path.parent.exists()
