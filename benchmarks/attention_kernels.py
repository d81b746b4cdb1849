"""Attention kernels on one GPU: the ``triton`` backend vs the ``sdpa`` reference backend.

One layer's ``forward`` (KV write + attention) of each backend on the same paged KV pool and
inputs, timed with CUDA events (median of ``--repeats`` after ``--warmup`` calls); metadata is
built once per case, outside the timing, as the engine builds it once per step. Eager launches,
no CUDA graphs, so host launch overhead counts. Shapes: ``--dtype`` (bf16 by default), head dim
128, 32 query heads over 8 KV heads, pages of 16 tokens, shuffled block tables.

    python benchmarks/attention_kernels.py            # decode batch 1/8/64 x context 1k/8k, prefill
    python benchmarks/attention_kernels.py --repeats 50 --dtype fp16

Prints a markdown table: milliseconds per call, sdpa/triton (above 1 = triton faster), the
triton decode split count, and max |triton - sdpa| as a sanity check.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

import torch

from brigade.interfaces import AttentionBackend, AttentionLayer, ModelInput, NoOptions
from brigade.model_input import SeqChunk, build_model_input
from brigade.plugins.attention.sdpa import SdpaBackend
from brigade.plugins.attention.triton_backend import TritonBackend, triton_interpreting

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DECODE_BATCHES = (1, 8, 64)
DECODE_CONTEXTS = (1024, 8192)
PREFILLS: tuple[tuple[str, list[tuple[int, int]]], ...] = (
    # (label, [(chunk tokens, cached tokens) per request])
    ("prefill 1 x 512", [(512, 0)]),
    ("prefill 1 x 2048", [(2048, 0)]),
    ("extend 1 x 512 after 4096", [(512, 4096)]),
    ("prefill 4 x 1024", [(1024, 0)] * 4),
    ("mixed: 32 decodes @2k + 1 x 512", [(1, 2048)] * 32 + [(512, 0)]),
)


@dataclasses.dataclass
class Case:
    label: str
    batch: ModelInput
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: tuple[torch.Tensor, torch.Tensor]


def make_case(
    label: str, rows: list[tuple[int, int]], dtype: torch.dtype, seed: int, device: str = "cuda"
) -> Case:
    """Rows of (new tokens, cached tokens) over shuffled pages of a fresh random pool."""
    generator = torch.Generator().manual_seed(seed)
    pages_per_row = [-(-(new + cached) // PAGE_SIZE) for new, cached in rows]
    order = torch.randperm(sum(pages_per_row), generator=generator).tolist()
    chunks, start = [], 0
    for (new, cached), count in zip(rows, pages_per_row, strict=True):
        chunks.append(SeqChunk([0] * new, cached, order[start : start + count]))
        start += count
    batch = build_model_input(chunks, PAGE_SIZE).to(device)
    tokens = batch.num_tokens
    pool = (len(order), PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return Case(
        label=label,
        batch=batch,
        query=torch.randn(tokens, NUM_HEADS, HEAD_DIM, device=device, dtype=dtype),
        key=torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=dtype),
        value=torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=dtype),
        kv_cache=(
            torch.randn(pool, device=device, dtype=dtype),
            torch.randn(pool, device=device, dtype=dtype),
        ),
    )


def median_ms(run: Callable[[], Any], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(
    backend: AttentionBackend, case: Case, layer: AttentionLayer, warmup: int, repeats: int
) -> tuple[float, torch.Tensor, Any]:
    """(median ms per forward, the output, the metadata)."""
    metadata = backend.build_metadata(case.batch)

    def run() -> torch.Tensor:
        return backend.forward(layer, case.query, case.key, case.value, case.kv_cache, metadata)

    return median_ms(run, warmup, repeats), run(), metadata


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(
            "attention_kernels.py times GPU kernels and needs a CUDA GPU; none is visible "
            "(torch.cuda.is_available() is False)"
        )
    if triton_interpreting():
        raise SystemExit("unset TRITON_INTERPRET: the interpreter would time Python, not kernels")
    dtype = DTYPES[args.dtype]
    layer = AttentionLayer(0, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    backends: dict[str, AttentionBackend] = {
        "sdpa": SdpaBackend(NoOptions()),
        "triton": TritonBackend(),
    }
    cases = [
        (f"decode batch {b} x ctx {c}", [(1, c - 1)] * b)
        for c in DECODE_CONTEXTS
        for b in DECODE_BATCHES
    ]
    cases += list(PREFILLS)
    print(f"# {torch.cuda.get_device_name()}, {args.dtype}, head_dim {HEAD_DIM}, ", end="")
    print(f"{NUM_HEADS}q/{NUM_KV_HEADS}kv heads, page {PAGE_SIZE}, median of {args.repeats}")
    print(f"# torch {torch.__version__}, triton {_triton_version()}")
    print()
    print("| case | sdpa ms | triton ms | sdpa/triton | splits | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|")
    for seed, (label, rows) in enumerate(cases):
        case = make_case(label, rows, dtype, seed)
        timings, outputs, splits = {}, {}, "-"
        for name, backend in backends.items():
            ms, output, metadata = measure(backend, case, layer, args.warmup, args.repeats)
            timings[name], outputs[name] = ms, output
            if name == "triton" and metadata.num_decodes:
                splits = str(metadata.kv_splits(NUM_KV_HEADS, None))
        diff = float((outputs["triton"].float() - outputs["sdpa"].float()).abs().max())
        ratio = timings["sdpa"] / timings["triton"]
        print(
            f"| {label} | {timings['sdpa']:.3f} | {timings['triton']:.3f} | {ratio:.2f}x "
            f"| {splits} | {diff:.2e} |",
            flush=True,
        )
        del case, outputs
        torch.cuda.empty_cache()


def _triton_version() -> str:
    import triton

    return str(triton.__version__)


if __name__ == "__main__":
    main()
