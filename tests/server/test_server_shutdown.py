"""A forced stop of the real server says so, to its streams and in its exit status (the drain
and its timeout: test_server.py and test_server_hardening.py)."""

from __future__ import annotations

import json
import signal
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest
from server_harness import running_server, tiny_model, tiny_server_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("served"))


def long_stream(server: str) -> AbstractContextManager[httpx.Response]:
    body = {"prompt": [5, 6], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    return httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60)


def test_a_second_signal_stops_at_once_with_a_status_that_says_so(
    model_dir: Path, tmp_path: Path
) -> None:
    config = tiny_server_config(
        model_dir, max_model_len=2048, num_pages=300, server="shutdown_timeout_s = 600\n"
    )
    with running_server(config, tmp_path) as (server, process), long_stream(server) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        process.send_signal(signal.SIGINT)
        assert httpx.get(f"{server}/health", timeout=10).status_code == 503
        process.send_signal(signal.SIGINT)
        rest = [line for line in lines if line]
        assert process.wait(timeout=20) == 128 + signal.SIGINT
    # The stream was told, not cut: an error event in OpenAI's shape, then [DONE].
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert (error["type"], error["code"]) == ("server_error", "server_overloaded")
    assert "stopped at once" in error["message"]
