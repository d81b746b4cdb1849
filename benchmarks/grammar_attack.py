"""Other streams' inter-token gaps while grammar attacks hit ``brigade serve``, against the
same streams beside the same requests without their grammars, in one invocation.

    python benchmarks/grammar_attack.py                    # SmolLM2, 4 streams, 3 rounds
    python benchmarks/grammar_attack.py --model random-tiny --streams 8 --rounds 2

One server (the default model unless ``--model``) on 127.0.0.1. Each round runs ``--streams``
unconstrained streaming completions (greedy, EOS ignored) twice, taking turns: once beside
the attacking requests without their grammars (the baseline: the same arrivals and prefills),
once while the attacks of the issue "One small request must never stop the server" arrive
a moment after the streams start: the 88-byte regex ``(.{0,100}){0,100}zz``,
a 50,000-value ``enum`` (under a raised size limit, so that it reaches the compiler), a
``guided_choice`` of 20,000 and the same regex again from a client that leaves after 0.5 s.
Each gap is the time between two streamed tokens of one stream. Prints, per round and over
all rounds, the median, p99 and worst gap of each phase and the ratios attack / baseline,
what each attack got back, and ``/health`` after each round; exits 1 if the server died.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from serve_process import launched

ATTACK_REGEX = "(.{0,100}){0,100}zz"


async def stream(client: httpx.AsyncClient, base: str, index: int, tokens: int) -> list[float]:
    """One unconstrained stream; the arrival time of each streamed chunk."""
    body = {
        "model": "bench",
        "prompt": f"Story {index}: once upon a time",
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    arrivals: list[float] = []
    async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
    return arrivals


def attacks(round_: int) -> list[tuple[str, dict[str, Any], float | None]]:
    """(name, chat body, seconds after which the client leaves, or None); each round's
    grammars are new ones (no compiled-grammar cache answers them)."""
    ask = [{"role": "user", "content": "Answer."}]
    regex = {"type": "regex", "regex": ATTACK_REGEX + "z" * round_}
    choices = [f"c{round_}-{i}" for i in range(20000)]
    values = [f"value-{round_}-{i}" for i in range(50000)]
    enum = {
        "type": "json_schema",
        "json_schema": {"name": "e", "schema": {"enum": values}},
    }
    return [
        ("regex", {"messages": ask, "response_format": regex, "max_tokens": 32}, None),
        ("enum 50k", {"messages": ask, "response_format": enum, "max_tokens": 8}, None),
        (
            "choice 20k",
            {"messages": ask, "guided_choice": choices, "max_tokens": 8},
            None,
        ),
        (
            "regex, client leaves",
            {"messages": ask, "response_format": regex, "max_tokens": 32},
            0.5,
        ),
    ]


async def attack(
    client: httpx.AsyncClient, base: str, name: str, body: dict[str, Any], leave_s: float | None
) -> str:
    started = time.monotonic()
    try:
        response = await client.post(
            f"{base}/v1/chat/completions",
            json={"model": "bench", **body},
            timeout=leave_s if leave_s is not None else 300,
        )
    except httpx.TimeoutException:
        return f"{name}: left after {leave_s} s"
    took = time.monotonic() - started
    message = response.json().get("error", {}).get("message", "") if response.is_error else ""
    return f"{name}: {response.status_code} after {took:.1f} s {message[:110]}"


def gaps(arrivals: list[list[float]]) -> list[float]:
    return [later - earlier for times in arrivals for earlier, later in itertools.pairwise(times)]


async def phase(
    base: str, streams: int, tokens: int, with_attacks: bool, round_: int
) -> tuple[list[float], list[str]]:
    """The streams, with the attacks arriving a moment after they start, or (the baseline)
    the same requests at the same moment without their grammars."""
    async with httpx.AsyncClient(timeout=600) as client:
        runs = [asyncio.create_task(stream(client, base, i, tokens)) for i in range(streams)]
        await asyncio.sleep(1.0)  # the streams are decoding
        specs = attacks(round_)
        requests = specs if with_attacks else [benign(spec) for spec in specs]
        answers = await asyncio.gather(*(attack(client, base, *spec) for spec in requests))
        arrivals = await asyncio.gather(*runs)
    return gaps([times[1:] for times in arrivals]), answers  # the first gap holds the prefill


def benign(
    spec: tuple[str, dict[str, Any], float | None],
) -> tuple[str, dict[str, Any], float | None]:
    """The same request without its grammar (it still arrives and prefills)."""
    name, body, leave_s = spec
    plain = {k: v for k, v in body.items() if k not in ("response_format", "guided_choice")}
    return f"{name} (no grammar)", plain, leave_s


def summary(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    return (
        statistics.median(ordered),
        ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        ordered[-1],
    )


def report(label: str, base_gaps: list[float], attack_gaps: list[float]) -> None:
    b, a = summary(base_gaps), summary(attack_gaps)
    print(
        f"{label}: baseline median/p99/max {b[0] * 1000:.0f}/{b[1] * 1000:.0f}/{b[2] * 1000:.0f}"
        f" ms, under attack {a[0] * 1000:.0f}/{a[1] * 1000:.0f}/{a[2] * 1000:.0f} ms; ratio "
        f"median {a[0] / b[0]:.2f}x, p99 {a[1] / b[1]:.2f}x, max {a[2] / b[2]:.2f}x"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    all_base: list[float] = []
    all_attack: list[float] = []
    tables = (
        f'[model]\npath = "{args.model}"\nmax_model_len = 2048\n[kv]\nnum_pages = 2048\n'
        "[grammar]\nmax_grammar_bytes = 4194304\n"
    )
    with (
        tempfile.TemporaryDirectory() as workdir,
        launched(Path(workdir), tables) as (base, process),
    ):
        asyncio.run(phase(base, args.streams, 8, False, 0))  # warm-up
        for round_ in range(1, args.rounds + 1):
            base_gaps, _ = asyncio.run(phase(base, args.streams, args.tokens, False, round_))
            attack_gaps, answers = asyncio.run(phase(base, args.streams, args.tokens, True, round_))
            report(f"round {round_}", base_gaps, attack_gaps)
            for answer in answers:
                print(f"  {answer}")
            health = httpx.get(f"{base}/health", timeout=10)
            print(f"  /health {health.status_code} {json.dumps(health.json())[:120]}")
            all_base += base_gaps
            all_attack += attack_gaps
        report(f"all {args.rounds} rounds", all_base, all_attack)
        alive = process.poll() is None
    print("server: up" if alive else "server: DIED")
    return 0 if alive else 1


if __name__ == "__main__":
    sys.exit(main())
