"""``/metrics`` of a server with two front-end processes: whichever front end a scrape reaches,
it reports every request the server finished, and the engine's state once.

One server with ``--api-server-count 2`` serves the module; its last test kills the supervisor.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import (
    frontends_that_answered,
    log_events,
    running_server,
    server_log,
    tiny_model,
    tiny_server_config,
)

ROUNDS = 10
"""Bounded: concurrent rounds of requests until both front ends have finished some."""
CONCURRENT = 8
SCRAPES = 16
PREFIXES = ("brigade:", "vllm:")

Samples = dict[str, list[tuple[dict[str, str], float]]]


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    workdir = tmp_path_factory.mktemp("frontends")
    config = tiny_server_config(
        tiny_model(workdir), max_model_len=2048, num_pages=300, server='metrics_names = "both"\n'
    )
    with running_server(config, workdir, args=["--api-server-count", "2"]) as (base, process):
        yield base, process, workdir


def complete(base: str) -> tuple[int, int]:
    """A completion with the official client on a connection of its own (the kernel hands
    each to either front end); its prompt and completion tokens."""
    with openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0) as client:
        usage = client.completions.create(
            model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0
        ).usage
    assert usage is not None
    return usage.prompt_tokens, usage.completion_tokens


def scrape(base: str) -> Samples:
    """``/metrics`` on a connection of its own, by sample name."""
    response = httpx.get(f"{base}/metrics", timeout=10)
    assert response.status_code == 200, response.text
    found: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def scrapes(base: str) -> list[Samples]:
    """:data:`SCRAPES` scrapes, :data:`CONCURRENT` at a time, so that both front ends answer."""
    with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        return list(pool.map(lambda _: scrape(base), range(SCRAPES)))


def total(found: Samples, name: str) -> float:
    return sum(value for _, value in found[name])


def test_every_front_end_reports_every_request_of_the_server(
    served: tuple[str, subprocess.Popen[bytes], Path],
) -> None:
    base, _, workdir = served
    usages: list[tuple[int, int]] = []
    with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        for _ in range(ROUNDS):
            usages += pool.map(lambda _: complete(base), range(CONCURRENT))
            if frontends_that_answered(server_log(workdir, base)) == {0, 1}:
                break
    # Each front end finished some, so neither one's own series hold them all.
    assert frontends_that_answered(server_log(workdir, base)) == {0, 1}
    sent = len(usages)
    for found in scrapes(base):
        for prefix in PREFIXES:
            assert total(found, f"{prefix}request_success_total") == sent
            assert total(found, f"{prefix}time_to_first_token_seconds_count") == sent
            assert total(found, f"{prefix}e2e_request_latency_seconds_count") == sent
            assert total(found, f"{prefix}prompt_tokens_total") == sum(p for p, _ in usages)
            assert total(found, f"{prefix}generation_tokens_total") == sum(c for _, c in usages)


def test_the_engines_gauges_and_totals_are_counted_once(
    served: tuple[str, subprocess.Popen[bytes], Path],
) -> None:
    """Every front end receives the engine's counters: one running request is 1, not 2."""
    base, _, _ = served
    body = {"prompt": [5, 6], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()  # held: dropping it would close the connection
        next(line for line in lines if line.startswith("data:"))
        # A front end advances the engine's totals from its latest snapshot as it answers a
        # scrape, and the other's may predate this request: a first round lets each answer
        # once (the totals then stand at the newest), the second is the one checked.
        scrapes(base)
        found = scrapes(base)
    for prefix in PREFIXES:
        assert [total(f, f"{prefix}num_requests_running") for f in found] == [1] * SCRAPES
        for f in found:
            assert [value for _, value in f[f"{prefix}engine_info"]] == [1]
            assert 0 < total(f, f"{prefix}kv_cache_usage_perc") <= 1
    # Totals the engine keeps: the same whichever front end answered.
    queries = {total(f, "brigade:prefix_cache_queries_total") for f in found}
    assert len(queries) == 1, queries
    assert queries.pop() > 0


def test_a_supervisor_killed_with_sigkill_leaves_no_metrics_behind(
    served: tuple[str, subprocess.Popen[bytes], Path],
) -> None:
    """Last in the module: the front ends remove the metrics folder, and with the engine's
    socket gone the supervisor's run directory goes too."""
    base, process, workdir = served
    started = log_events(server_log(workdir, base), "processes_started")[0]
    metrics_dir = Path(started["metrics_dir"])
    assert any(metrics_dir.glob("*.db"))
    children = [int(started["engine_pids"][0]), *map(int, started["frontend_pids"])]
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=10)
    deadline = time.monotonic() + 10  # bounded: the children poll their parent
    while time.monotonic() < deadline and any(psutil.pid_exists(pid) for pid in children):
        time.sleep(0.1)
    for pid in children:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie", pid
    assert not metrics_dir.exists()
    assert not metrics_dir.parent.exists()
