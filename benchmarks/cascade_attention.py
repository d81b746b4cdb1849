"""Cascade decode attention on a CPU, on and off: the C++ decode kernel alone over a layer
stack's KV caches, rows sharing a cached prefix.

``--rows`` decode rows whose block tables start with the same ``--shared`` tokens' pages (as the
prefix cache leaves them), then ``--own`` tokens each on pages of their own, scattered over
``--caches`` pools of ``--pages`` pages (one per layer, reused round-robin over ``--layers``:
enough pools and pages that the keys come from memory, not from a cache a previous call left
hot). Each variant runs ``--layers`` calls (one decode step's attention), best of ``--repeats``,
alternating off and on twice. SmolLM2's attention shape by default (9 query heads over 3 KV
heads of 64, pages of 16), float32, 2 threads.

    python benchmarks/cascade_attention.py                          # 384 shared + 64 own
    python benchmarks/cascade_attention.py --shared 2048 --caches 6 --pages 8192
"""

from __future__ import annotations

import argparse
import time

import torch

from brigade.plugins.cpu.build import cpu_ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--shared", type=int, default=384, help="shared prefix tokens")
    parser.add_argument("--own", type=int, default=64, help="each row's tokens after it")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--caches", type=int, default=30, help="distinct KV pools")
    parser.add_argument("--pages", type=int, default=1024, help="pages per pool")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("the CPU kernels could not be built here")
    dtype = getattr(torch, args.dtype)
    page = args.page_size
    length = args.shared + args.own
    shared_pages, row_pages = args.shared // page, -(-length // page)
    needed = shared_pages + args.rows * (row_pages - shared_pages)
    if needed > args.pages:
        raise SystemExit(f"--pages {args.pages} is too few: the rows need {needed}")
    shape = (args.pages, page, args.kv_heads, args.head_dim)
    keys = [torch.randn(shape).to(dtype) for _ in range(args.caches)]
    values = [torch.randn(shape).to(dtype) for _ in range(args.caches)]
    order = torch.randperm(args.pages).tolist()
    tables = torch.empty(args.rows, row_pages, dtype=torch.long)
    tables[:, :shared_pages] = torch.tensor(order[:shared_pages])
    rest = iter(order[shared_pages:])
    for row in range(args.rows):
        for column in range(shared_pages, row_pages):
            tables[row, column] = next(rest)
    seq_lens = torch.full((args.rows,), length, dtype=torch.long)
    query = torch.randn(args.rows, args.heads, args.head_dim).to(dtype)
    scale = args.head_dim**-0.5
    shared = ops.shared_decode_keys(tables, seq_lens, page)
    print(
        f"{args.rows} rows x ({args.shared} shared + {args.own} own) keys, {args.layers} layers,"
        f" {args.caches} pools of {args.pages} pages, {args.dtype}, {args.threads} threads;"
        f" keys the cascade shares per row: {int(shared.max())}"
    )
    results: dict[bool, list[float]] = {False: [], True: []}
    for cascade in (False, True, False, True):
        best = float("inf")
        for _ in range(args.repeats):
            started = time.perf_counter()
            for layer in range(args.layers):
                pool = layer % args.caches
                ops.paged_decode(
                    query, keys[pool], values[pool], tables, seq_lens, 0, scale, cascade
                )
            best = min(best, time.perf_counter() - started)
        results[cascade].append(1e3 * best)
    for cascade, times in results.items():
        label = "cascade on " if cascade else "cascade off"
        print(f"  {label}: {', '.join(f'{t:.1f}' for t in times)} ms per {args.layers} layers")
    ratio = min(results[False]) / min(results[True])
    print(f"  off / on (best of each): {ratio:.2f}x")


if __name__ == "__main__":
    main()
