"""Faults through the real server: a bad request or a failing plugin fails alone; a dead
engine is visible at once and the process exits non-zero (tests/faulty_plugins.py)."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import time
from collections.abc import Iterator

import faulty_plugins
import httpx
import openai
import pytest
from faulty_plugins import POISON
from server_harness import running_server, tiny_model, tiny_server_config

FAULTY = """
[sampler]
plugin = "faulty"
fail_after_tokens = 3
[scheduler]
plugin = "faulty"
fail_add_priority = 7
fail_schedule_priority = 99
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, subprocess.Popen]]:
    """Faulty plugins, and a finished hook that raises for every request (FAULTY_HOOK).

    The module's last test kills its engine.
    """
    workdir = tmp_path_factory.mktemp("faults")
    model_dir = tiny_model(workdir)
    env = {**faulty_plugins.install_entry_point(workdir / "plugins"), "FAULTY_HOOK": "1"}
    config = tiny_server_config(model_dir, max_model_len=256, num_pages=200) + FAULTY
    with running_server(config, workdir, env=env) as (base, process):
        yield base, process


@pytest.fixture
def server(served: tuple[str, subprocess.Popen]) -> str:
    return served[0]


def completion(server: str, **fields: object) -> httpx.Response:
    body = {"prompt": [5, 6, 7], "max_tokens": 12, "temperature": 0, "ignore_eos": True, **fields}
    return httpx.post(f"{server}/v1/completions", json=body, timeout=60)


def stream_lines(server: str, **fields: object) -> list[str]:
    body = {"prompt": [5, 6, 7], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{server}/v1/completions", json={**body, **fields, "stream": True}, timeout=60
    ) as response:
        assert response.status_code == 200
        return [line for line in response.iter_lines() if line]


def events(lines: list[str]) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def health(server: str) -> httpx.Response:
    return httpx.get(f"{server}/health", timeout=10)


def test_a_plugin_failing_mid_stream_ends_that_stream_alone_with_an_error_event(
    server: str,
) -> None:
    neighbour = {"max_tokens": 40, "prompt": [9, 10, 11]}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        calm = [pool.submit(completion, server, **neighbour) for _ in range(2)]
        poisoned = stream_lines(server, priority=POISON["apply"])
        answers = [future.result() for future in calm]
    chunks = events(poisoned)
    assert poisoned[-1] == "data: [DONE]"
    error = chunks[-1]["error"]
    assert "FaultyProcessor" in error["message"]
    assert "poisoned row in apply" in error["message"]
    assert error["code"] == "internal_error"
    texts = [c for c in chunks if "choices" in c]
    assert texts[-1]["choices"][0]["finish_reason"] == "error"
    for answer in answers:
        assert answer.status_code == 200
        assert answer.json()["choices"][0]["finish_reason"] == "length"
        assert answer.json()["usage"]["completion_tokens"] == 40
    # Not streamed: its tokens so far, and the reason it stopped.
    cut = completion(server, priority=POISON["apply"])
    assert cut.status_code == 200
    assert cut.json()["choices"][0]["finish_reason"] == "error"
    assert cut.json()["usage"]["completion_tokens"] == 3
    # The official client raises it, naming the cause.
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    stream = client.completions.create(
        model="tiny", prompt=[5, 6], max_tokens=12, stream=True, extra_body={"priority": 23}
    )
    with pytest.raises(openai.APIError, match="FaultyProcessor"):
        for _ in stream:
            pass


def test_a_plugin_failing_before_the_first_token_is_a_500_naming_it(server: str) -> None:
    for stream in (False, True):
        refused = completion(server, priority=POISON["add"], stream=stream)
        assert refused.status_code == 500
        assert "FaultyProcessor" in refused.json()["error"]["message"]
    refused = completion(server, priority=7)
    assert refused.status_code == 500
    assert "the scheduler 'faulty' failed to queue" in refused.json()["error"]["message"].lower()
    assert completion(server).status_code == 200


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", 3.5e38), ("temperature", 1e308), ("repetition_penalty", 1e300)],
)
def test_sampling_values_that_overflow_float32_are_400_and_hurt_nobody(
    server: str, field: str, value: float
) -> None:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(completion, server, max_tokens=30)
        refused = completion(server, **{field: value})
        answer = running.result()
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == field
    assert answer.status_code == 200
    assert answer.json()["usage"]["completion_tokens"] == 30


def test_a_hook_failing_when_a_stream_disconnects_leaves_the_engine_serving(
    server: str,
) -> None:
    idle = health(server).json()["num_free_pages"]
    body = {"prompt": [5, 6], "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as response:
        next(line for line in response.iter_lines() if line.startswith("data:"))
    deadline = time.monotonic() + 10
    while health(server).json()["num_free_pages"] != idle and time.monotonic() < deadline:
        time.sleep(0.05)
    assert health(server).json()["num_free_pages"] == idle
    answer = completion(server)
    assert answer.status_code == 200
    assert answer.json()["usage"]["completion_tokens"] == 12
    assert health(server).status_code == 200


def test_a_dead_engine_answers_503_and_the_server_exits_1(
    served: tuple[str, subprocess.Popen],
) -> None:
    """Last in the module: the scheduler fails twice in a row, so the engine dies."""
    server, process = served
    body = {"prompt": [5, 6], "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        killer = completion(server, priority=99)  # the scheduler fails while it is queued
        rest = [line for line in lines if line]
    assert killer.status_code == 500
    assert "the engine failed" in killer.json()["error"]["message"].lower()
    assert rest[-1] == "data: [DONE]"
    assert "the scheduler broke" in events(rest)[-1]["error"]["message"]
    dead = health(server)
    assert dead.status_code == 503
    assert dead.json()["status"] == "engine failed"
    refused = completion(server)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "engine_unavailable"
    assert process.wait(timeout=30) == 1
