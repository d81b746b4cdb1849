"""Data-parallel routing: round-robin vs least-loaded vs cache-aware, on the simulator.

Runs one seeded shared-prefix workload (system prompts shared by groups of requests, Poisson
arrivals) on N simulated engine replicas of Llama-3-70B's shape (``[router]
data_parallel_size``; each replica on ``--gpus`` simulated H100s with its own small KV pool),
once per router, in one invocation, and prints per router the prefix hit rate, TTFT p50/p99,
end-to-end p50, request throughput and the ratios to round-robin; then one replica alone for
scale. Simulated time, so the figures are the same on any machine.

    python benchmarks/routing.py
    python benchmarks/routing.py --replicas 8 --groups 32 --rate 80
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
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--gpus", type=int, default=4, help="simulated H100s per replica")
    parser.add_argument("--pages", type=int, default=320, help="KV pages per replica")
    parser.add_argument("--groups", type=int, default=8, help="shared system prompts")
    parser.add_argument("--per-group", type=int, default=24)
    parser.add_argument("--prefix", type=int, default=1024, help="system prompt tokens")
    parser.add_argument("--rate", type=float, default=40.0, help="requests per second")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

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
    keys = list(rows["round-robin"])
    print("| router | " + " | ".join(keys) + " | TTFT p50 vs round-robin |")
    print("|---" * (len(keys) + 2) + "|")
    base = rows["round-robin"]["ttft_p50_ms"]
    for name, row in rows.items():
        cells = " | ".join(f"{row[key]:.3g}" for key in keys)
        print(f"| {name} | {cells} | {row['ttft_p50_ms'] / base:.2f}x |")


if __name__ == "__main__":
    main()
