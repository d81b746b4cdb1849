#!/usr/bin/env bash
# Soaks the server: rounds of concurrent streams, a share of which disconnect at random.
#
# Builds a small random model, starts `brigade serve` on it on 127.0.0.1 with a KV pool far
# smaller than the load (so requests preempt each other), and runs SOAK_ROUNDS rounds of
# SOAK_STREAMS concurrent streaming requests (chat and completions, n = 1 or 2, random
# lengths); each one disconnects after a few chunks with probability SOAK_DISCONNECT. After
# every round it checks: every kept request ended with its finish reason and [DONE], no answer
# was a 5xx, and the free KV pages are back to the idle count; at the end, that the server's
# RSS stayed flat over the last rounds and that it stops with status 0. Prints one summary
# line; the exit status is non-zero on any failure.
#
#   scripts/soak.sh                                   10 rounds of 100 streams, 20% disconnect
#   SOAK_ROUNDS=70 SOAK_STREAMS=100 scripts/soak.sh   the 7000 streams of issue 16
#
# SOAK_SEED picks the random choices; SOAK_KEEP=1 keeps the work directory.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
work=$(mktemp -d)
server=""
cleanup() {
    if [ -n "$server" ] && kill -0 "$server" 2>/dev/null; then
        kill -KILL "$server" 2>/dev/null || true
    fi
    if [ -z "${SOAK_KEEP:-}" ]; then rm -rf "$work"; fi
}
trap cleanup EXIT

port=$("$py" - "$work" <<'EOF'
import socket
import sys
from pathlib import Path

from brigade.models.create import create_model

work = Path(sys.argv[1])
model = create_model(work / "tiny", "llama", overrides={"num_hidden_layers": 2})
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
(work / "server.toml").write_text(
    f'[model]\npath = "{model}"\nmax_model_len = 128\n'
    "[kv]\npage_size = 8\nnum_pages = 96\n"  # 768 tokens for up to ~100 streams: preemption
    f'[server]\nhost = "127.0.0.1"\nport = {port}\nserved_model_name = "tiny"\n'
    "max_waiting_requests = 1024\n"
)
print(port)
EOF
)
.venv/bin/brigade serve --config "$work/server.toml" >"$work/server.log" 2>&1 &
server=$!
status=0
"$py" - "http://127.0.0.1:$port" "$server" <<'EOF' || status=$?
import asyncio
import json
import os
import random
import sys
import time

import httpx
import psutil

BASE, PID = sys.argv[1], int(sys.argv[2])
ROUNDS = int(os.environ.get("SOAK_ROUNDS", 10))
STREAMS = int(os.environ.get("SOAK_STREAMS", 100))
DISCONNECT = float(os.environ.get("SOAK_DISCONNECT", 0.2))
MiB = 1 << 20
rng = random.Random(int(os.environ.get("SOAK_SEED", 0)))
started = time.monotonic()


def body() -> tuple[str, dict]:
    fields = {
        "max_tokens": rng.randint(4, 48),
        "temperature": rng.choice([0.0, 0.8]),
        "n": rng.choice([1, 1, 1, 2]),
        "ignore_eos": rng.random() < 0.5,
        "stream": True,
    }
    if rng.random() < 0.5:
        messages = [{"role": "user", "content": f"Tell me about {rng.randint(0, 10**6)}."}]
        return "/v1/chat/completions", {**fields, "messages": messages}
    prompt = [rng.randint(5, 200) for _ in range(rng.randint(1, 40))]
    return "/v1/completions", {**fields, "prompt": prompt}


async def one(client: httpx.AsyncClient, tally: dict) -> None:
    path, payload = body()
    leave_after = rng.randint(1, 4) if rng.random() < DISCONNECT else None
    async with client.stream("POST", path, json=payload) as response:
        if response.status_code >= 500:
            tally["5xx"] += 1
            return
        if response.status_code != 200:
            tally["other"].append(response.status_code)
            return
        finished, done, chunks = set(), False, 0
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    tally["errors"].append(event["error"]["message"])
                for choice in event.get("choices", ()):
                    if choice.get("finish_reason"):
                        finished.add((choice["index"], choice["finish_reason"]))
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    tally["left"] += 1
                    return
    tally["kept"] += 1
    if done and len(finished) == payload["n"] and all(r in ("stop", "length") for _, r in finished):
        tally["complete"] += 1


async def settle(client: httpx.AsyncClient, idle: int) -> dict:
    deadline = time.monotonic() + 60
    while True:
        health = (await client.get("/health")).json()
        quiet = health["num_running"] == 0 and health["num_waiting"] == 0
        if (quiet and health["num_free_pages"] == idle) or time.monotonic() > deadline:
            return health
        await asyncio.sleep(0.1)


async def main() -> int:
    # Idle connections expire here before the server's keep-alive (5 s) closes them: reusing
    # one the server is closing at that moment fails in any client.
    limits = httpx.Limits(max_connections=STREAMS + 8, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=BASE, timeout=120, limits=limits) as client:
        for _ in range(600):
            try:
                if (await client.get("/health")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
        idle = (await client.get("/health")).json()["num_free_pages"]
        tally = {"kept": 0, "complete": 0, "left": 0, "5xx": 0, "other": [], "errors": []}
        rss, problems = [], []
        for round_index in range(ROUNDS):
            results = await asyncio.gather(
                *(one(client, tally) for _ in range(STREAMS)), return_exceptions=True
            )
            failures = [r for r in results if isinstance(r, BaseException)]
            if failures:
                problems.append(f"round {round_index}: {len(failures)} client errors "
                                f"({type(failures[0]).__name__}: {failures[0]})")
            health = await settle(client, idle)
            if health["num_free_pages"] != idle:
                problems.append(f"round {round_index}: {health['num_free_pages']}/{idle} pages "
                                "free after it")
            rss.append(psutil.Process(PID).memory_info().rss)
        metrics = (await client.get("/metrics")).text
    preemptions = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("brigade:num_preemptions_total")
    )
    tail = rss[-max(3, ROUNDS // 3):]
    growth = tail[-1] - tail[0]
    if growth > max(16 * MiB, 0.02 * tail[0]):
        problems.append(f"RSS grew {growth / MiB:.0f} MiB over the last {len(tail)} rounds")
    if tally["complete"] != tally["kept"]:
        problems.append(f"{tally['kept'] - tally['complete']} kept requests incomplete")
    if tally["5xx"]:
        problems.append(f"{tally['5xx']} answers were 5xx")
    if tally["other"]:
        problems.append(f"{len(tally['other'])} answers were {sorted(set(tally['other']))}")
    if tally["errors"]:
        problems.append(f"{len(tally['errors'])} error events ({tally['errors'][0]})")
    verdict = "FAILED" if problems else "ok"
    pages = "not " if any("pages free" in p for p in problems) else ""
    print(
        f"soak: {verdict}: {ROUNDS} rounds x {STREAMS} streams, {tally['left']} disconnected, "
        f"{tally['complete']}/{tally['kept']} kept complete, {tally['5xx']} 5xx, "
        f"{preemptions:.0f} preemptions, KV pages {pages}back to {idle} free after each round, "
        f"RSS {tail[0] / MiB:.0f} -> {tail[-1] / MiB:.0f} MiB over the last {len(tail)} rounds, "
        f"{time.monotonic() - started:.0f} s"
        + "".join(f"\n  {problem}" for problem in problems)
    )
    return 1 if problems else 0


sys.exit(asyncio.run(main()))
EOF
kill -TERM "$server"
server_status=0
wait "$server" || server_status=$?
server=""
if [ "$server_status" != 0 ]; then
    echo "soak: FAILED: the server exited with $server_status (log: $work/server.log)" >&2
    SOAK_KEEP=1
    exit 1
fi
if [ "$status" != 0 ]; then
    SOAK_KEEP=1
    echo "soak: the server's log: $work/server.log" >&2
fi
exit "$status"
