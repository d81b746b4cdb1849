"""Prefill attention on a CPU: Brigade's vector kernel, its AMX tile kernel (bfloat16 on CPUs
with AMX) and torch's flash attention, on SmolLM2's heads, by prompt length.

    python benchmarks/cpu_prefill.py                        # bfloat16, prompts of 64-1024
    python benchmarks/cpu_prefill.py --lengths 512 --prompts 4
    python benchmarks/cpu_prefill.py --cached 384 --lengths 16 --prompts 8   # chunks after a prefix

One layer's attention for ``--prompts`` rows of ``--lengths`` new tokens each (after
``--cached`` keys already in the pages), over scattered pages of 16 tokens; the kernels read the
pages in place, flash attention gets each row's keys gathered and, after cached keys, a mask
(as the ``sdpa`` backend did for bfloat16 prefills on AMX before the tile kernel). The three take
turns, the median of each kept; prints ms per call, GFLOP/s and the largest difference from
the tile kernel's output.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from brigade.plugins.cpu.build import cpu_ops
from brigade.plugins.cpu.gemm import tiles_usable

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16
"""SmolLM2-135M's attention heads and the engine's default page size."""


def median_ms(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each call's median milliseconds over ``repeats`` turns (after two untimed)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for turn in range(repeats + 2):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            if turn >= 2:
                times[name].append((time.perf_counter() - started) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def compare(
    ops: object, dtype: torch.dtype, new: int, cached: int, prompts: int, repeats: int
) -> None:
    seq_len = cached + new
    pages_per_row = -(-seq_len // PAGE)
    num_pages = prompts * pages_per_row
    key_cache = torch.randn(num_pages, PAGE, KV_HEADS, HEAD_DIM).to(dtype)
    value_cache = torch.randn(num_pages, PAGE, KV_HEADS, HEAD_DIM).to(dtype)
    tables = torch.randperm(num_pages).view(prompts, pages_per_row)
    query = torch.randn(prompts * new, HEADS, HEAD_DIM).to(dtype)
    chunks = torch.tensor([[row, row * new, (row + 1) * new, seq_len] for row in range(prompts)])
    scale = HEAD_DIM**-0.5
    positions = torch.arange(seq_len)
    slots = [tables[row, positions // PAGE] * PAGE + positions % PAGE for row in range(prompts)]
    mask = None if cached == 0 else positions[None, :] <= torch.arange(cached, seq_len)[:, None]

    def flash() -> torch.Tensor:
        outputs = []
        for row in range(prompts):
            keys = key_cache.view(-1, KV_HEADS, HEAD_DIM)[slots[row]].transpose(0, 1)[None]
            values = value_cache.view(-1, KV_HEADS, HEAD_DIM)[slots[row]].transpose(0, 1)[None]
            q = query[row * new : (row + 1) * new].transpose(0, 1)[None]
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale,
                enable_gqa=True,
            )  # fmt: skip
            outputs.append(out[0].transpose(0, 1))
        return torch.cat(outputs)

    args = (query, key_cache, value_cache, tables, chunks, 0, scale)
    calls: dict[str, Callable[[], torch.Tensor]] = {
        "vector kernel": lambda: ops.paged_prefill(*args),  # type: ignore[attr-defined]
        "flash attention": flash,
    }
    if dtype == torch.bfloat16 and tiles_usable():
        calls["tile kernel"] = lambda: ops.paged_prefill_tiles(*args)  # type: ignore[attr-defined]
    reference = calls.get("tile kernel", calls["vector kernel"])().float()
    best = median_ms(calls, repeats)
    flops = prompts * 4 * new * (cached + new / 2) * HEAD_DIM * HEADS
    parts = [f"{prompts} x {new:4d} new after {cached:4d}"]
    for name, ms in best.items():
        error = (calls[name]().float() - reference).abs().max().item()
        parts.append(f"{name} {ms:7.3f} ms ({flops / ms / 1e6:4.0f} GF, |diff| {error:.0e})")
    print("  ".join(parts), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--cached", type=int, default=0, help="keys already in the pages")
    parser.add_argument("--prompts", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("the CPU kernels could not be built here")
    from step_profile import cpu_flags  # benchmarks/ is this script's directory

    print(f"{cpu_flags()}; torch {torch.__version__}, {args.threads} threads, {args.dtype}")
    for new in args.lengths:
        compare(ops, getattr(torch, args.dtype), new, args.cached, args.prompts, args.repeats)


if __name__ == "__main__":
    main()
