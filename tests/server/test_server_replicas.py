"""``brigade serve -dp 2``: two engine processes behind the router in the front end. A replica
killed mid-stream fails its own request only; the other keeps serving, and ``/health`` and
``/metrics`` show the loss; the last one's death stops the server with status 1, leaving
nothing behind."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import psutil
from server_harness import (
    completion,
    log_events,
    running_server,
    server_log,
    tiny_model,
    tiny_server_config,
)

NUM_PAGES = 300


def test_a_dead_replica_leaves_rotation_and_the_last_one_stops_the_server(
    tmp_path: Path,
) -> None:
    config = tiny_server_config(tiny_model(tmp_path), max_model_len=2048, num_pages=NUM_PAGES)
    args = ["--data-parallel-size", "2", "--set", "router.plugin=round-robin"]
    with running_server(config, tmp_path, args=args) as (base, process):
        started = log_events(server_log(tmp_path, base), "processes_started")[0]
        engines, frontends = started["engine_pids"], started["frontend_pids"]
        assert len(engines) == 2
        health = httpx.get(f"{base}/health", timeout=10).json()
        assert health["num_pages"] == 2 * NUM_PAGES, health  # both replicas' pools
        assert (health["status"], health["engines_alive"], health["engines_total"]) == ("ok", 2, 2)

        # Round-robin from a fresh front end: the first request goes to replica 0.
        body = {"prompt": [5, 6], "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            os.kill(engines[0], signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert "engine" in json.loads(rest[-2][6:])["error"]["message"].lower()

        assert [completion(base) for _ in range(3)] == [4, 4, 4]  # replica 1 serves them
        health = httpx.get(f"{base}/health", timeout=10)
        assert health.status_code == 200  # it still serves: a load balancer keeps it
        assert health.json()["num_pages"] == NUM_PAGES, "the dead replica is still counted"
        assert health.json()["status"] == "degraded"
        assert (health.json()["engines_alive"], health.json()["engines_total"]) == (1, 2)
        assert (health.json()["frontends_alive"], health.json()["frontends_total"]) == (1, 1)
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        assert 'brigade:engines_alive{model_name="tiny"} 1.0' in metrics
        assert 'brigade:engines_configured{model_name="tiny"} 2.0' in metrics
        failed = log_events(server_log(tmp_path, base), "engine_replica_failed")
        assert [(e["replica"], e["replicas_in_rotation"]) for e in failed] == [(0, 1)]

        os.kill(engines[1], signal.SIGKILL)
        killed = time.monotonic()
        statuses = []
        while time.monotonic() < killed + 1.0:
            statuses.append(httpx.get(f"{base}/health", timeout=10).status_code)
            if statuses[-1] == 503:
                break
        assert statuses[-1] == 503, f"/health after the last replica's death: {statuses}"
        assert process.wait(timeout=30) == 1
    for pid in (*engines, *frontends):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie", pid
