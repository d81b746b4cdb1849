"""Data-parallel routing: round-robin vs least-loaded vs cache-aware, on the simulator.

Runs one seeded shared-prefix workload (system prompts shared by groups of requests, Poisson
arrivals) on N simulated engine replicas of Llama-3-70B's shape (``[router]
data_parallel_size``; each replica on ``--gpus`` simulated H100s with its own small KV pool),
once per router, in one invocation, and prints per router the prefix hit rate, TTFT p50/p99,
end-to-end p50, request throughput and the ratios to round-robin; then one replica alone for
scale. Simulated time, so the figures are the same on any machine.

    python benchmarks/routing.py
    python benchmarks/routing.py --replicas 8 --groups 32 --rate 80
    python benchmarks/routing.py --live     # real processes: brigade serve -dp 2, SmolLM2

``--live`` runs the workload (scaled for a CPU) against ``brigade serve MODEL -dp 2`` once per
router, each replica a real engine process with a small KV pool, and reads the prefix hit rate
from the server's /metrics and TTFT from the client (``brigade bench``'s endpoint runner).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from brigade.bench.simulate import SimulationResult, run_simulation
from brigade.bench.workloads import Arrivals, Lengths, shared_prefix

MODEL = Path(__file__).resolve().parents[1] / "examples" / "ab" / "llama-3-70b"
"""Llama-3-70B's config.json alone (the simulator reads only the shape)."""
ROUTERS = ("round-robin", "least-loaded", "cache-aware")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(result: SimulationResult) -> dict[str, float]:
    ttft = [r.ttft_s for r in result.requests]
    return {
        "prefix_hit_rate": result.prefix_hit_rate,
        "ttft_p50_ms": 1e3 * statistics.median(ttft),
        "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
        "e2e_p50_ms": 1e3 * statistics.median(r.e2e_s for r in result.requests),
        "requests_per_s": result.request_throughput,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--live", action="store_true", help="real engine processes (CPU)")
    parser.add_argument("--model", default="default", help="--live: what brigade serve loads")
    parser.add_argument("--replicas", type=int, default=None, help="default 4 (--live: 2)")
    parser.add_argument("--gpus", type=int, default=4, help="simulated H100s per replica")
    parser.add_argument("--pages", type=int, default=None, help="KV pages per replica")
    parser.add_argument("--groups", type=int, default=None, help="shared system prompts")
    parser.add_argument("--per-group", type=int, default=None)
    parser.add_argument("--prefix", type=int, default=None, help="system prompt tokens")
    parser.add_argument("--rate", type=float, default=None, help="requests per second")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    # Simulated: Llama-3-70B replicas on H100s; live: SmolLM2 on this CPU's cores.
    defaults = (2, 64, 6, 8, 256, 3.0) if args.live else (4, 320, 8, 24, 1024, 40.0)
    for name, default in zip(
        ("replicas", "pages", "groups", "per_group", "prefix", "rate"), defaults, strict=True
    ):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.live:
        live(args)
        return

    workload = shared_prefix(
        num_groups=args.groups,
        requests_per_group=args.per_group,
        prefix_len=args.prefix,
        suffix_lens=Lengths("uniform", 64, 32),
        output_lens=Lengths("fixed", 32),
        arrivals=Arrivals("poisson", rate=args.rate),
        vocab_size=json.loads((MODEL / "config.json").read_text())["vocab_size"],
        seed=args.seed,
    )
    common = [
        f"model.path={MODEL}",
        "model.max_model_len=4096",
        "executor.gpu=H100",
        f"executor.num_gpus={args.gpus}",
        f"kv.num_pages={args.pages}",
        "kv.enable_prefix_caching=true",
    ]
    rows = {
        router: summary(
            run_simulation(
                [*common, f"router.data_parallel_size={args.replicas}", f"router.plugin={router}"],
                workload,
            )
        )
        for router in ROUTERS
    }
    rows["one replica"] = summary(run_simulation(common, workload))

    print(
        f"{len(workload)} requests, {args.groups} system prompts of {args.prefix} tokens, "
        f"{args.rate:g}/s; {args.replicas} replicas x {args.gpus} H100 (simulated), "
        f"{args.pages} KV pages each\n"
    )
    _table(rows)


def live(args: argparse.Namespace) -> None:
    """Each router on ``brigade serve -dp 2`` (real engine processes), one after the other."""
    import subprocess
    import sys
    import tempfile
    import time

    import httpx

    from brigade.bench.endpoint import Endpoint, run_endpoint

    repo = Path(__file__).resolve().parents[1]
    workload = shared_prefix(
        num_groups=args.groups,
        requests_per_group=args.per_group,
        prefix_len=args.prefix,
        suffix_lens=Lengths("uniform", 32, 16),
        output_lens=Lengths("fixed", 8),
        arrivals=Arrivals("poisson", rate=args.rate),
        vocab_size=49152,
        seed=args.seed,
    )
    rows = {}
    for router in ROUTERS:
        port = _free_port()
        command = [
            str(repo / ".venv" / "bin" / "brigade"), "serve", args.model, "--port", str(port),
            "-dp", str(args.replicas), "--served-model-name", "bench",
            "--set", f"router.plugin={router}", "--set", f"kv.num_pages={args.pages}",
            "--set", "kv.page_size=16",
        ]  # fmt: skip
        log = Path(tempfile.mkdtemp(prefix="brigade-routing-")) / f"{router}.log"
        with log.open("wb") as out:
            server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                if server.poll() is not None:
                    sys.exit(f"brigade serve exited with {server.returncode}; see {log}")
                try:
                    if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1)
            endpoint = Endpoint(f"{base}/v1", "bench", max_concurrency=64)
            run = run_endpoint(endpoint, workload)
            metrics = httpx.get(f"{base}/metrics", timeout=10).text
        finally:
            server.terminate()
            server.wait(timeout=60)
        hits, queries = (
            _metric(metrics, f"brigade:prefix_cache_{k}_total") for k in ("hits", "queries")
        )
        ttft = [t.ttft_s for t in run.timings]
        rows[router] = {
            "prefix_hit_rate": hits / queries if queries else 0.0,
            "ttft_p50_ms": 1e3 * statistics.median(ttft),
            "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
            "e2e_p50_ms": 1e3 * statistics.median(t.e2e_s for t in run.timings),
            "failed": float(len(run.errors)),
        }
    print(
        f"live: {len(workload)} requests, {args.groups} system prompts of {args.prefix} tokens, "
        f"{args.rate:g}/s; brigade serve {args.model} -dp {args.replicas} (engine processes), "
        f"{args.pages} KV pages of 16 tokens each\n"
    )
    _table(rows)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _metric(text: str, name: str) -> float:
    """The value of an unlabelled-but-for-model series ``name`` in Prometheus text."""
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            return float(line.rsplit(" ", 1)[1])
    raise ValueError(f"/metrics has no {name}")


def _table(rows: dict[str, dict[str, float]]) -> None:
    keys = list(rows["round-robin"])
    print("| router | " + " | ".join(keys) + " | TTFT p50 vs round-robin |")
    print("|---" * (len(keys) + 2) + "|")
    base = rows["round-robin"]["ttft_p50_ms"]
    for name, row in rows.items():
        cells = " | ".join(f"{row[key]:.3g}" for key in keys)
        print(f"| {name} | {cells} | {row['ttft_p50_ms'] / base:.2f}x |")


if __name__ == "__main__":
    main()
