"""The attacks of the issue "One small request must never stop the server", as a fuzz phase.

Run by ``scripts/fuzz.sh`` against the server it started (``BASE``, a random model, process
``SERVER_PID``) and with the work folder ``WORK`` for config files:

    python scripts/fuzz_attacks.py BASE WORK SERVER_PID

Grammar attacks on the running server, each of which must fail alone with a 400 naming the
limit it passed (or be served) in bounded time, while the server stays healthy: the 88-byte
regex whose masks grow without bound, a 50,000-value ``enum``, a ``guided_choice`` of
20,000, and a 12,000-value ``enum`` (within the size limit, minutes to compile) whose client
leaves: its compile process must be gone soon after. Config attacks on ``brigade config
check``, each a ``brigade: error:`` line with exit status 2 and no traceback: empty and
blank API keys, huge process counts, pages and sequences, deep TOML nesting. Prints one line
per attack; exit status 1 if any failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

ASK = [{"role": "user", "content": "Answer."}]
REGEX = "(.{0,100}){0,100}zz"


def chat(base: str, body: dict[str, Any], timeout: float = 120) -> httpx.Response:
    return httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": "tiny", "messages": ASK, **body},
        timeout=timeout,
    )


def refused(base: str, body: dict[str, Any], *limits: str) -> str | None:
    """None if the server answered 400 naming one of ``limits``; else what went wrong."""
    started = time.monotonic()
    response = chat(base, body)
    took = time.monotonic() - started
    message = response.json().get("error", {}).get("message", "") if response.is_error else ""
    if response.status_code != 400 or not any(limit in message for limit in limits):
        return f"{response.status_code} after {took:.1f} s: {response.text[:200]}"
    return None


def compiles_alive(server_pid: int) -> int:
    """Grammar compile processes under the server (the compile server's children)."""
    count = 0
    for process in psutil.Process(server_pid).children(recursive=True):
        try:
            if "compile_worker" in " ".join(process.cmdline()):
                count += len(process.children())
        except psutil.Error:
            continue
    return count


def client_leaves(base: str, server_pid: int) -> str | None:
    return asyncio.run(_client_leaves(base, server_pid))


async def _client_leaves(base: str, server_pid: int) -> str | None:
    """A compile that would run for minutes, whose client leaves once it runs: its process
    must be gone within seconds."""
    values = [f"value-{i}-xxxxx" for i in range(12000)]
    schema = {"type": "json_schema", "json_schema": {"name": "e", "schema": {"enum": values}}}
    body = {"model": "tiny", "messages": ASK, "response_format": schema, "max_tokens": 4}
    async with httpx.AsyncClient(timeout=300) as client:
        request = asyncio.create_task(client.post(f"{base}/v1/chat/completions", json=body))
        deadline = time.monotonic() + 30
        while not compiles_alive(server_pid):
            if request.done() or time.monotonic() > deadline:
                request.cancel()
                return "its compile was never seen running"
            await asyncio.sleep(0.1)
        request.cancel()  # the client leaves
        with contextlib.suppress(asyncio.CancelledError):
            await request
    deadline = time.monotonic() + 10
    while compiles_alive(server_pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    alive = compiles_alive(server_pid)
    return f"{alive} compile process(es) still running after the client left" if alive else None


def grammar_attacks(base: str, server_pid: int) -> dict[str, Callable[[], str | None]]:
    enum = {"enum": [f"value-{i}" for i in range(50000)]}
    return {
        "regex (.{0,100}){0,100}zz": lambda: refused(
            base,
            {"response_format": {"type": "regex", "regex": REGEX}, "max_tokens": 16},
            "mask_budget_ms",
            "compile_timeout_s",
        ),
        "enum of 50,000": lambda: refused(
            base,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "e", "schema": enum},
                },
                "max_tokens": 4,
            },
            "max_grammar_bytes",
        ),
        "guided_choice of 20,000": lambda: _served_or_refused(
            base,
            {"guided_choice": [f"c{i}" for i in range(20000)], "max_tokens": 4},
            "compile_timeout_s",
            "cache_mib",
        ),
        "a slow compile whose client leaves": lambda: client_leaves(base, server_pid),
    }


def _served_or_refused(base: str, body: dict[str, Any], *limits: str) -> str | None:
    response = chat(base, body)
    if response.status_code == 200:
        return None
    return refused(base, body, *limits)


def config_attacks(work: Path) -> dict[str, Callable[[], str | None]]:
    nested = "x = " + "[" * 5000 + "]" * 5000 + "\n"
    cases = {
        'api_keys = [""]': '[server]\napi_keys = [""]\n',
        'api_keys = [" "]': '[server]\napi_keys = [" "]\n',
        "api_server_count = 1000": "[server]\napi_server_count = 1000\n",
        "num_pages = 10**12": "[kv]\nnum_pages = 1000000000000\n",
        "max_num_seqs = 10**9": "[scheduler]\nmax_num_seqs = 1000000000\n",
        "TOML nested 5,000 deep": f"[model]\n{nested}",
    }
    return {name: lambda text=text: _config_refused(work, text) for name, text in cases.items()}


def _config_refused(work: Path, text: str) -> str | None:
    path = work / "attack.toml"
    path.write_text(text)
    result = subprocess.run(
        [sys.executable, "-m", "brigade", "config", "check", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("brigade: error:")]
    if result.returncode != 2 or not errors or "Traceback" in result.stderr:
        return f"exit {result.returncode}: {result.stderr[-300:]}"
    return None


def main() -> int:
    base, work, server_pid = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    failures = 0
    attacks = {**grammar_attacks(base, server_pid), **config_attacks(work)}
    for name, attack in attacks.items():
        started = time.monotonic()
        problem = attack()
        took = time.monotonic() - started
        health = httpx.get(f"{base}/health", timeout=10).status_code
        if health != 200:
            problem = f"{problem or 'ok'}; /health {health} afterwards"
        print(f"attack {name} ({took:.1f} s): {'FAILED: ' + problem if problem else 'ok'}")
        failures += problem is not None
    served = chat(base, {"max_tokens": 4}).status_code
    if served != 200:
        print(f"attack aftermath: a plain request got {served}")
        failures += 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
