"""Preemption by recompute vs by swap on a long-context workload, in one invocation.

The KV pool is sized to hold only a few of the sequences at full length, so requests are
preempted as they grow. Recompute re-prefills prompt + output when a victim returns; swap
copies its pages to host memory and back. Prints generated tokens/s, preemptions and the ratio.

    python benchmarks/preemption.py --size tiny --prompt-len 1024 --output-len 128
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from offline_throughput import model_dir

from brigade import LLM, SamplingParams


def run(path: str, mode: str, prompts: list[list[int]], output_len: int, pages: int) -> dict:
    llm = LLM(
        overrides=[
            f"model.path={path}",
            "model.dtype=float32",
            f"kv.num_pages={pages}",
            "kv.enable_prefix_caching=false",
            f'scheduler.preemption="{mode}"',
        ]
    )
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    scheduler = llm.engine.scheduler
    return {
        "tok/s": tokens / elapsed,
        "seconds": elapsed,
        "preemptions": scheduler.stats().num_preemptions,
        "swapped": scheduler.swap.num_swapped_out if scheduler.swap is not None else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny", choices=("tiny", "small"))
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--resident", type=float, default=2.5, help="sequences the pool holds")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = model_dir(args.size, "llama")
    rng = random.Random(0)
    prompts = [
        [rng.randrange(10, 4000) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]
    page_size = 16
    pages = int(args.resident * (args.prompt_len + args.output_len) / page_size)
    print(
        f"llama-{args.size}: {args.requests} requests x ({args.prompt_len} prompt + "
        f"{args.output_len} output) tokens, KV pool {pages} pages of {page_size} "
        f"(~{args.resident:g} sequences)"
    )
    results = {
        mode: run(str(path), mode, prompts, args.output_len, pages)
        for mode in ("recompute", "swap")
    }
    for mode, result in results.items():
        print(
            f"{mode:<10} {result['tok/s']:8.1f} tok/s  ({result['seconds']:.1f} s, "
            f"{result['preemptions']} preemptions, {result['swapped']} swapped out)"
        )
    ratio = results["swap"]["tok/s"] / results["recompute"]["tok/s"]
    print(f"ratio swap / recompute: {ratio:.2f}x")


if __name__ == "__main__":
    main()
