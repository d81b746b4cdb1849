"""Start a real ``brigade serve`` process on 127.0.0.1 for end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import httpx
import psutil


def tiny_model(root: Path) -> Path:
    """A 2-layer tiny Llama built under ``root`` (what the server tests serve)."""
    from brigade.models.create import create_model

    return create_model(root / "tiny", "llama", overrides={"num_hidden_layers": 2})


def tiny_server_config(
    model_dir: Path, *, max_model_len: int, num_pages: int, server: str = ""
) -> str:
    """A server config for ``model_dir`` with 8-token pages, serving it as ``tiny``."""
    return (
        f'[model]\npath = "{model_dir}"\nmax_model_len = {max_model_len}\n'
        f"[kv]\npage_size = 8\nnum_pages = {num_pages}\n"
        f'[server]\nserved_model_name = "tiny"\n{server}'
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def running_server(
    config_text: str,
    workdir: Path,
    *,
    startup_s: float = 180.0,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Yield (base URL, process) of a server started from ``config_text`` (plus ``brigade
    serve`` arguments ``args``, e.g. vLLM flags; ``env`` replaces the environment); stop it
    after, and fail if any process it started (engine, front ends) outlives it.

    ``startup_s`` is generous: with the engine in its own process, the engine and the front
    end import and load in parallel, which a loaded 2-core machine slows down."""
    port = free_port()
    config = workdir / f"server-{port}.toml"
    config.write_text(
        config_text + f'\n[server]\nhost = "127.0.0.1"\nport = {port}\n'
        if "[server]" not in config_text
        else config_text.replace("[server]", f'[server]\nhost = "127.0.0.1"\nport = {port}', 1)
    )
    log = (workdir / f"server-{port}.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "brigade", "serve", "--config", str(config), *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + startup_s
    children: list[psutil.Process] = []
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"server exited with {process.returncode}:\n"
                    + (workdir / f"server-{port}.log").read_text()
                )
            try:
                if httpx.get(f"{base}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become healthy in time")
            time.sleep(0.2)
        children = psutil.Process(process.pid).children(recursive=True)
        yield base, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()
    _, left = psutil.wait_procs(children, timeout=10)
    for child in left:
        child.kill()
    if left:
        raise AssertionError(f"the server left processes behind: {[c.pid for c in left]}")


def server_log(workdir: Path, base: str) -> str:
    """The output of the server at ``base`` started in ``workdir``."""
    return (workdir / f"server-{base.rsplit(':', 1)[1]}.log").read_text()


def log_events(log: str, event: str) -> list[dict]:
    """The server's JSON log lines for ``event``."""
    lines = (json.loads(raw) for raw in log.splitlines() if raw.startswith("{"))
    return [line for line in lines if line.get("event") == event]


def frontends_that_answered(log: str) -> set[int]:
    """The indexes of the front ends that finished a request, from a server's log."""
    return {int(line["frontend"]) for line in log_events(log, "request_finished")}


def completion(base: str, max_tokens: int = 4) -> int:
    """Tokens of a greedy completion of a 3-token prompt, on a fresh connection (the kernel
    hands each to any front end); the answer must be a 200."""
    body = {"prompt": [5, 6, 7], "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["completion_tokens"])
