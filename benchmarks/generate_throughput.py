"""Tokens per second of ``LLM.generate`` on one uniform workload, for A/B runs of two checkouts.

    python benchmarks/generate_throughput.py 32 128 128     # 32 prompts x 128 ids -> 128 tokens
    python benchmarks/generate_throughput.py 1 128 256      # batch 1
    python benchmarks/generate_throughput.py 32 128 128 executor.fused_ops=false
    SHARED=384 python benchmarks/generate_throughput.py 32 32 64   # a shared 384-token prefix

Run it from two checkouts (each with its own venv) in turn, A B A B, on an idle machine: the
figure is the generate call alone (after a short warm-up), and the first tokens are printed so
that both sides can be seen to emit the same greedy stream. SmolLM2 (the default model), fp32,
greedy, EOS ignored, prefix caching off; ``THREADS`` (default 2) sets torch's threads;
``SHARED=N`` puts one N-token prefix before every prompt and turns prefix caching on (the
prompts all arrive at once, as peers.py's shared-prefix workload); extra arguments are config
overrides.
"""

from __future__ import annotations

import os
import random
import sys
import time

import torch

from brigade import LLM, SamplingParams


def main() -> None:
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    batch, prompt_len, output_len = (int(value) for value in sys.argv[1:4])
    shared = int(os.environ.get("SHARED", "0"))
    llm = LLM(
        overrides=[
            "model.path=default",
            "model.dtype=float32",
            "kv.num_pages=4096",
            f"kv.enable_prefix_caching={'true' if shared else 'false'}",
            *sys.argv[4:],
        ]
    )
    rng = random.Random(0)
    head = [rng.randrange(100, 40000) for _ in range(shared)]
    prompts = [
        [*head, *(rng.randrange(100, 40000) for _ in range(prompt_len))] for _ in range(batch)
    ]
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([[7, 8, 9, 10], [11, 12]], warm, use_tqdm=False)  # caches none of the prompts
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    first = outputs[0].outputs[0].token_ids[:8]
    print(f"{tokens / elapsed:.1f} tok/s ({elapsed:.1f} s), first tokens {first}", flush=True)


if __name__ == "__main__":
    main()
