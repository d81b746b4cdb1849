"""Output tokens per second of ``brigade serve`` with the engine on a thread vs in its own
process, many concurrent streams over loopback, in one invocation.

    python benchmarks/serve_process.py                   # 128 streams x 64 tokens, 2-layer model
    python benchmarks/serve_process.py --streams 256 --tokens 32 --layers 4 --rounds 2
    python benchmarks/serve_process.py --api-server-count 2   # process mode with 2 front ends

A random llama model is built in a temporary directory (``brigade model create``), served
twice per round (``[server] engine_process`` false, then true) on 127.0.0.1; each run sends
``--streams`` streaming completions at once (greedy, EOS ignored, fixed prompts) and counts
the streamed tokens. Prints tok/s per mode and the ratio process / thread (> 1: the process
split is faster). Server start-up is not timed; a warm-up of the same width (8 tokens per
stream) precedes each timed run. The client runs on the same machine: on few cores it takes
a share of the CPU, so compare ratios from one invocation, not figures across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

STARTUP_S = 300.0
RESETS: list[int] = []
"""Streams whose connection was reset before an answer (retried once)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def server(
    model_dir: Path,
    workdir: Path,
    *,
    engine_process: bool,
    api_server_count: int,
    threads: int,
) -> Iterator[str]:
    tables = (
        f'[model]\npath = "{model_dir}"\nmax_model_len = 512\n'
        "[kv]\npage_size = 16\nnum_pages = 4096\nenable_prefix_caching = false\n"
        "[scheduler]\nmax_num_seqs = 256\n"
        f"[executor]\nnum_threads = {threads}\n"
    )
    server_keys = (
        f"engine_process = {'true' if engine_process else 'false'}\n"
        f"api_server_count = {api_server_count}\nmax_waiting_requests = 4096\n"
    )
    with launched(workdir, tables, server_keys) as (base, _):
        yield base


@contextlib.contextmanager
def launched(
    workdir: Path, tables: str, server_keys: str = ""
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``brigade serve`` on a free loopback port with the config ``tables`` (every table but
    ``[server]``) and ``server_keys`` in ``[server]``, serving the model as ``bench``: its
    base URL and process once ``/health`` says 200; SIGTERM on leaving (the log's last lines
    printed if it failed)."""
    port = free_port()
    config = workdir / f"serve-{port}.toml"
    config.write_text(
        f'{tables}[server]\nhost = "127.0.0.1"\nport = {port}\nserved_model_name = "bench"\n'
        f"{server_keys}"
    )
    log = (workdir / f"serve-{port}.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "brigade", "serve", "--config", str(config)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited: see {log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.5)
        else:
            raise RuntimeError("the server did not start in time")
        yield base, process
    except BaseException:
        log.flush()
        print(f"--- the server's log ({log.name}), last lines:", file=sys.stderr)
        print(*Path(log.name).read_text().splitlines()[-30:], sep="\n", file=sys.stderr)
        raise
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


async def one_stream(client: httpx.AsyncClient, base: str, index: int, tokens: int) -> int:
    body = {
        "model": "bench",
        "prompt": [(index * 7 + k) % 200 + 10 for k in range(16)],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    for attempt in range(2):  # bounded: one retry of a connection reset before any answer
        received = 0
        try:
            async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        usage = json.loads(line[6:]).get("usage")
                        if usage:
                            received = int(usage["completion_tokens"])
            return received
        except (httpx.ReadError, httpx.RemoteProtocolError):
            # A burst of hundreds of new connections on a small machine sometimes has one
            # reset before its response starts, in either mode; count it, retry once.
            RESETS.append(index)
            if attempt:
                raise
    raise AssertionError("unreachable")


async def run(base: str, streams: int, tokens: int) -> float:
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        # Warm-up at full width: the first wide batches pay one-off costs (allocations,
        # connection setup) that are not what is compared.
        await asyncio.gather(*(one_stream(client, base, i, 8) for i in range(streams)))
        started = time.perf_counter()
        counts = await asyncio.gather(
            *(one_stream(client, base, i, tokens) for i in range(streams))
        )
        elapsed = time.perf_counter() - started
    if sum(counts) != streams * tokens:
        raise RuntimeError(f"expected {streams * tokens} tokens, got {sum(counts)}")
    return sum(counts) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="thread/process pairs (A B A B)")
    parser.add_argument("--api-server-count", type=int, default=1)
    parser.add_argument(
        "--threads", type=int, default=0, help="[executor] num_threads (0: torch's default)"
    )
    args = parser.parse_args()
    from brigade.models.create import create_model

    with tempfile.TemporaryDirectory(prefix="brigade-bench-") as tmp:
        workdir = Path(tmp)
        model_dir = create_model(
            workdir / "model", "llama", overrides={"num_hidden_layers": args.layers}
        )
        figures: dict[str, list[float]] = {"thread": [], "process": []}
        for _ in range(args.rounds):
            for mode in ("thread", "process"):
                with server(
                    model_dir,
                    workdir,
                    engine_process=mode == "process",
                    api_server_count=args.api_server_count if mode == "process" else 1,
                    threads=args.threads,
                ) as base:
                    rate = asyncio.run(run(base, args.streams, args.tokens))
                figures[mode].append(rate)
                print(f"{mode:8s} {rate:9.1f} tok/s ({len(RESETS)} resets retried)", flush=True)
                RESETS.clear()
    thread = sum(figures["thread"]) / len(figures["thread"])
    process = sum(figures["process"]) / len(figures["process"])
    print(
        f"{args.streams} streams x {args.tokens} tokens, {args.layers} layers, "
        f"api_server_count {args.api_server_count}, threads {args.threads}: thread "
        f"{thread:.1f} tok/s, process {process:.1f} tok/s, ratio process/thread "
        f"{process / thread:.2f}"
    )


if __name__ == "__main__":
    main()
