"""``brigade serve -dp 2 --distributed-executor-backend ray`` on a two-node Ray cluster (both
nodes on 127.0.0.1): the replicas are Ray actors, one per node, reached over TCP; greedy
answers equal one engine's; a replica's actor killed mid-stream fails its own request while
the other keeps serving; the server leaves no actor or placement group behind."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

pytest.importorskip("ray")

from ray_helpers import assert_nothing_left, two_node_cluster
from server_harness import (
    log_events,
    running_server,
    server_log,
    tiny_model,
    tiny_server_config,
)

from brigade import LLM, SamplingParams

NUM_PAGES = 300
MAX_MODEL_LEN = 2048
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
"""An even count: round-robin then sends the next request to replica 0 again."""
MAX_TOKENS = 6
SERVE_ARGS = [
    "--data-parallel-size",
    "2",
    "--distributed-executor-backend",
    "ray",
    "--set",
    "router.plugin=round-robin",
]


@pytest.fixture(scope="module")
def cluster_address() -> Iterator[str]:
    # Each node fits one replica's bundle: this machine's cores shared by the two replicas.
    with two_node_cluster(num_cpus=max(1, len(os.sched_getaffinity(0)) // 2)) as address:
        yield address


def test_replicas_are_ray_actors_that_fail_alone_and_leave_nothing_behind(
    cluster_address: str, tmp_path: Path
) -> None:
    model_dir = tiny_model(tmp_path)
    config = tiny_server_config(model_dir, max_model_len=MAX_MODEL_LEN, num_pages=NUM_PAGES)
    with running_server(config, tmp_path, args=SERVE_ARGS) as (base, process):
        log = server_log(tmp_path, base)
        [actors] = log_events(log, "engine_actors_started")
        assert len(set(actors["nodes"])) == 2, "both replicas run on one node"
        node_ip = cluster_address.rsplit(":", 1)[0]  # every node's, on this machine
        assert all(a.startswith(f"tcp://{node_ip}:") for a in actors["addresses"]), actors
        local = {child.pid for child in psutil.Process(process.pid).children(recursive=True)}
        assert not local & set(actors["pids"]), "a replica runs as a child of the server"

        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        answers = [
            client.completions.create(
                model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
            )
            .choices[0]
            .text
            for prompt in PROMPTS  # round-robin: replicas 0, 1, 0, 1
        ]
        reference = LLM(
            overrides=[
                f"model.path={model_dir}",
                f"model.max_model_len={MAX_MODEL_LEN}",
                "kv.page_size=8",
                f"kv.num_pages={NUM_PAGES}",
            ]
        ).generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
        assert answers == [output.outputs[0].text for output in reference]

        # Two streams at once, one on each replica; replica 0's actor dies under its stream.
        long = {"model": "tiny", "max_tokens": 2000, "temperature": 0, "stream": True}
        on_replica_0 = client.completions.create(
            prompt=[5, 6], extra_body={"ignore_eos": True}, **long
        )
        on_replica_1 = client.completions.create(
            prompt=[7, 8], extra_body={"ignore_eos": True}, **{**long, "max_tokens": 200}
        )
        next(iter(on_replica_0))
        next(iter(on_replica_1))
        os.kill(actors["pids"][0], signal.SIGKILL)
        with pytest.raises(openai.APIError, match=r"(?i)engine"):
            for _ in on_replica_0:
                pass
        finish = [chunk.choices[0].finish_reason for chunk in on_replica_1]
        assert finish[-1] == "length", "the surviving replica's stream did not finish"
        alone = [  # replica 1 answers every request now, as before
            client.completions.create(
                model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
            )
            .choices[0]
            .text
            for prompt in PROMPTS[:2]
        ]
        assert alone == answers[:2]

        failed = log_events(server_log(tmp_path, base), "engine_replica_failed")
        assert [(e["replica"], e["replicas_in_rotation"]) for e in failed] == [(0, 1)]
        assert "connection" in failed[0]["reason"], failed[0]
        assert _supervisor_saw_actor_die(tmp_path, base), "the supervisor missed the death"
    assert process.returncode == 1, "a replica died: the server's status says so"
    assert_nothing_left(cluster_address)


def test_the_last_replica_actor_to_die_stops_the_server_with_status_1(
    cluster_address: str, tmp_path: Path
) -> None:
    config = tiny_server_config(tiny_model(tmp_path), max_model_len=MAX_MODEL_LEN, num_pages=64)
    with running_server(config, tmp_path, args=SERVE_ARGS) as (base, process):
        [actors] = log_events(server_log(tmp_path, base), "engine_actors_started")
        for pid in actors["pids"]:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        statuses = []
        while time.monotonic() < killed + 1.5:
            statuses.append(httpx.get(f"{base}/health", timeout=10).status_code)
            if statuses[-1] == 503:
                break
        assert statuses[-1] == 503, f"/health after every replica's death: {statuses}"
        assert process.wait(timeout=30) == 1
    assert_nothing_left(cluster_address)


def _supervisor_saw_actor_die(workdir: Path, base: str, wait_s: float = 10.0) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if any(
            e["replica"] == 0 for e in log_events(server_log(workdir, base), "engine_actor_failed")
        ):
            return True
        time.sleep(0.2)
    return False
