"""A server with two front-end processes behaves as one server: one rate limit for a client
whichever front end takes its connections, a long step reported by ``/health`` whichever
answers, and the death of one front end seen by the other, which serves on.

Which front end holds a connection is read from the processes' sockets (psutil), so each
test can prove both took part. One server serves the module; its last test kills a front end.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import faulty_plugins
import httpx
import psutil
import pytest
from faulty_plugins import SLOW
from prometheus_client.parser import text_string_to_metric_families
from server_harness import log_events, running_server, server_log, tiny_model, tiny_server_config

from brigade.server.health import STALLED_AFTER_S

LIMIT = 5
"""requests_per_minute of every key: the rate test spends the key ``limited``."""
MAX_LIMITED_REQUESTS = 200
"""Bounded: requests until each front end has taken more than LIMIT of them."""
SLOW_STEP_S = STALLED_AFTER_S + 1.5
"""How long the step of a SLOW request sleeps: past the stall mark, with room to see it."""
SURVIVOR_TOKENS = 200
VICTIM_TOKENS = 4000
"""A request on the killed front end: far longer than the test, unless the engine aborts it."""
MAX_CONNECTIONS = 20
"""Bounded: fresh connections until each front end holds one."""
KEYS = [f"key-{index}" for index in range(32)]
"""One per request of the other tests, so that only the rate test meets the limit."""
_fresh_keys = iter(KEYS)


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    workdir = tmp_path_factory.mktemp("frontends")
    env = faulty_plugins.install_entry_point(workdir / "plugins")
    keys = ", ".join(f'"{key}"' for key in ["limited", *KEYS])
    server = f"api_keys = [{keys}]\nrequests_per_minute = {LIMIT}\n"
    config = tiny_server_config(
        tiny_model(workdir), max_model_len=4096, num_pages=1200, server=server
    )
    config += (
        f'\n[sampler]\nplugin = "faulty"\nfail_after_tokens = 1\nslow_step_s = {SLOW_STEP_S}\n'
    )
    args = ["--api-server-count", "2"]
    with running_server(config, workdir, args=args, env=env) as (base, process):
        yield base, process, workdir


def frontend_pids(workdir: Path, base: str) -> list[int]:
    started = log_events(server_log(workdir, base), "processes_started")[0]
    return [int(pid) for pid in started["frontend_pids"]]


def frontend_of(response: httpx.Response, pids: Sequence[int]) -> int:
    """The index of the front end whose process holds the server end of the connection
    ``response`` came on."""
    port = response.extensions["network_stream"].get_extra_info("client_addr")[1]
    for index, pid in enumerate(pids):
        for connection in psutil.Process(pid).net_connections(kind="tcp"):
            if connection.raddr and connection.raddr.port == port:
                return index
    raise AssertionError(f"no front end holds the connection from port {port}")


def authorized(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def health(base: str) -> httpx.Response:
    return httpx.get(f"{base}/health", timeout=10)  # a fresh connection: either front end


def gauges(base: str) -> dict[str, float]:
    response = httpx.get(f"{base}/metrics", timeout=10)
    assert response.status_code == 200
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(response.text)
        if family.type == "gauge"
        for sample in family.samples
    }


def test_the_rate_limit_holds_for_the_server_whichever_front_end_answers(
    served: tuple[str, subprocess.Popen[bytes], Path],
) -> None:
    base, _, workdir = served
    pids = frontend_pids(workdir, base)
    taken = [0, 0]
    statuses: list[int] = []
    started = time.monotonic()
    for _ in range(MAX_LIMITED_REQUESTS):
        body = {"prompt": [5, 6], "max_tokens": 1}
        with httpx.Client(base_url=base, headers=authorized("limited"), timeout=60) as client:
            response = client.post("/v1/completions", json=body)
            taken[frontend_of(response, pids)] += 1
        statuses.append(response.status_code)
        if response.status_code == 429:
            assert int(response.headers["Retry-After"]) >= 1
            assert response.json()["error"]["code"] == "rate_limit_exceeded"
        if min(taken) > LIMIT:
            break
    elapsed = time.monotonic() - started
    # Each front end took more than a minute's allowance: on its own, each would admit LIMIT.
    assert min(taken) > LIMIT, taken
    assert set(statuses) == {200, 429}
    refilled = int(elapsed * LIMIT / 60)  # what the bucket may have regained meanwhile
    assert LIMIT <= statuses.count(200) <= LIMIT + refilled, (statuses, elapsed)


def test_a_long_step_makes_health_say_stalled_until_it_ends(
    served: tuple[str, subprocess.Popen[bytes], Path],
) -> None:
    base, _, _ = served
    body = {"prompt": [5, 6], "max_tokens": 4, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST",
        f"{base}/v1/completions",
        json={**body, "priority": SLOW},
        headers=authorized(next(_fresh_keys)),
        timeout=60,
    ) as stream:  # answered once the first token exists: the slow step is next
        seen: list[httpx.Response] = []
        deadline = time.monotonic() + SLOW_STEP_S + 2
        while time.monotonic() < deadline:
            seen.append(health(base))
            if seen[-1].json()["status"] == "stalled":
                break
            time.sleep(0.1)
        ping = httpx.get(f"{base}/ping", timeout=10)
        rest = [line for line in stream.iter_lines() if line]
    stalled = seen[-1]
    assert stalled.json()["status"] == "stalled", [h.json() for h in seen[-3:]]
    assert stalled.status_code == 503
    assert stalled.json()["no_progress_s"] >= STALLED_AFTER_S
    assert {h.json()["status"] for h in seen} <= {"ok", "stalled"}
    assert ping.status_code == 200  # liveness: a long step is no reason to restart
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    after = health(base)
    assert (after.status_code, after.json()["status"]) == (200, "ok")
    assert after.json()["no_progress_s"] < STALLED_AFTER_S


@contextlib.contextmanager
def one_stream_per_front_end(
    base: str, pids: Sequence[int], max_tokens: Sequence[int]
) -> Iterator[list[Iterator[str]]]:
    """A running stream on each front end (``max_tokens[i]`` for front end ``i``), each on a
    fresh connection found to be that front end's; their SSE lines."""
    with contextlib.ExitStack() as stack:
        lines: dict[int, Iterator[str]] = {}
        for _ in range(MAX_CONNECTIONS):
            key = next(_fresh_keys)
            client = httpx.Client(base_url=base, headers=authorized(key), timeout=60)
            index = frontend_of(client.get("/health"), pids)  # kept alive for the stream
            if index in lines:
                client.close()
                continue
            stack.callback(client.close)
            body = {
                "prompt": [5, 6],
                "max_tokens": max_tokens[index],
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            stream = stack.enter_context(client.stream("POST", "/v1/completions", json=body))
            assert frontend_of(stream, pids) == index
            lines[index] = stream.iter_lines()
            if len(lines) == len(pids):
                break
        assert len(lines) == len(pids), f"{MAX_CONNECTIONS} connections all went to {set(lines)}"
        yield [lines[index] for index in range(len(pids))]


def test_a_killed_front_end_leaves_the_other_serving_and_shows_in_health(
    served: tuple[str, subprocess.Popen[bytes], Path],
) -> None:
    """Last in the module: SIGKILL front end 1 while each front end streams."""
    base, process, workdir = served
    pids = frontend_pids(workdir, base)
    with one_stream_per_front_end(base, pids, [SURVIVOR_TOKENS, VICTIM_TOKENS]) as streams:
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(httpx.TransportError):  # its connection died with it
            list(streams[1])
        survivor = [line for line in streams[0] if line]
    # The other front end's stream went on to its end, untouched.
    assert survivor[-1] == "data: [DONE]"
    assert all("error" not in json.loads(line[6:]) for line in survivor[:-1])
    assert json.loads(survivor[-3][6:])["choices"][0]["finish_reason"] == "length"
    assert json.loads(survivor[-2][6:])["usage"]["completion_tokens"] == SURVIVOR_TOKENS

    # Every connection now reaches front end 0, which reports the loss and serves on.
    answers = [health(base) for _ in range(4)]
    assert {a.status_code for a in answers} == {200}
    for answer in answers:
        body = answer.json()
        assert body["status"] == "degraded", body
        assert (body["frontends_alive"], body["frontends_total"]) == (1, 2)
        assert (body["engines_alive"], body["engines_total"]) == (1, 1)
    found = gauges(base)
    assert found["brigade:frontends_alive"] == 1
    assert found["brigade:frontends_configured"] == 2
    assert found["brigade:engines_alive"] == found["brigade:engines_configured"] == 1
    for _ in range(3):
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        headers = authorized(next(_fresh_keys))
        response = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4

    # The engine aborted the dead front end's request rather than generate it for nobody.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and health(base).json()["num_running"]:
        time.sleep(0.1)
    assert health(base).json()["num_running"] == 0
    log = server_log(workdir, base)
    assert [event["aborted"] for event in log_events(log, "frontend_gone")] == [1]
    exited = log_events(log, "frontend_exited")
    assert [(event["frontend"], event["frontends_alive"]) for event in exited] == [(1, 1)]
    assert process.poll() is None
