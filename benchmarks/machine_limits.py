"""What this CPU allows, and the floors that puts under SmolLM2's figures: the float32 FMA peak
(a loop of independent vector FMAs on registers, every thread), the streaming read rate
(``x.sum()`` over 1 GiB), then batch-1 decode at the read rate (every weight read once per
token) and prefill at the peak (two FLOPs per weight per token).

    python benchmarks/machine_limits.py                 # 2 threads
    python benchmarks/machine_limits.py --threads 1

The FMA loop is built with the CPU kernels' flags (``-O3 -march=native``); 16-float vectors
where the CPU has AVX-512, else 8. A CPU whose 512-bit FMAs issue at half the rate (as this one
measured) shows the same peak either way.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from step_profile import cpu_flags
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <ATen/Parallel.h>
#include <torch/extension.h>

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vecf __attribute__((vector_size(4 * kLanes)));
constexpr int kChains = 12;  // independent accumulators: more than latency x FMA ports

// FLOPs done: every thread runs `iterations` rounds of kChains vector FMAs.
double fma_loop(int64_t iterations) {
  const int64_t threads = at::get_num_threads();
  std::vector<float> sink(threads);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      vecf acc[kChains];
      for (int c = 0; c < kChains; ++c) acc[c] = vecf{} + static_cast<float>(c);
      const vecf a = vecf{} + 1.0000001f, b = vecf{} + 1e-8f;
      for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 12
        for (int c = 0; c < kChains; ++c) acc[c] = acc[c] * a + b;
      }
      float total = 0.0f;
      for (int c = 0; c < kChains; ++c) {
        for (int l = 0; l < kLanes; ++l) total += acc[c][l];
      }
      sink[t] = total;  // kept, so the loop is not dropped
    }
  });
  volatile float keep = sink[0];
  (void)keep;
  return 2.0 * kLanes * kChains * static_cast<double>(iterations) * threads;
}
"""

# SmolLM2-135M-Instruct: 30 layers, hidden 576, MLP 1536, 9 query heads over 3 KV heads of 64,
# vocabulary 49152 (tied embeddings: the LM head is read once more per token).
LAYER_PARAMS = 576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536
SMOLLM2_PARAMS = 30 * LAYER_PARAMS + 49152 * 576


def fma_peak(iterations: int) -> float:
    """GFLOP/s of the FMA loop on torch's threads, best of three."""
    with tempfile.TemporaryDirectory() as build:
        module = load_inline(
            "brigade_fma_peak",
            cpp_sources=[SOURCE],
            functions=["fma_loop"],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=build,
        )
        module.fma_loop(iterations // 10)  # threads started, clocks up
        best = 0.0
        for _ in range(3):
            started = time.perf_counter()
            flops = module.fma_loop(iterations)
            best = max(best, flops / (time.perf_counter() - started) / 1e9)
    return best


def read_rate(num_bytes: int) -> float:
    """GB/s of ``x.sum()`` over ``num_bytes`` of float32, best of eight."""
    x = torch.ones(num_bytes // 4)
    x.sum()
    best = float("inf")
    for _ in range(8):
        started = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - started)
    return num_bytes / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=100_000_000)
    parser.add_argument("--read-gib", type=float, default=1.0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{cpu_flags()}; torch {torch.__version__}, {args.threads} threads")
    peak = fma_peak(args.iterations)
    rate = read_rate(int(args.read_gib * 2**30))
    weights = 4 * SMOLLM2_PARAMS
    print(f"  float32 FMA peak: {peak:.1f} GFLOP/s")
    print(f"  streaming read (x.sum()): {rate:.1f} GB/s")
    print(
        f"  SmolLM2 fp32, batch 1: {weights / 1e6:.0f} MB of weights per token -> at least"
        f" {weights / rate / 1e6:.2f} ms/token at that read rate"
    )
    per_token = 2 * 30 * LAYER_PARAMS  # prefill: the layers' GEMMs (the LM head: last token only)
    print(
        f"  SmolLM2 fp32 prefill: {per_token / 1e6:.0f} MFLOP of GEMMs per token -> at most"
        f" {peak * 1e9 / per_token:.0f} tokens/s at the peak (attention not counted)"
    )


if __name__ == "__main__":
    main()
