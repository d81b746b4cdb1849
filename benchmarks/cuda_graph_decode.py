"""Decode and mixed-step speed on one GPU: the eager ``torch`` executor vs ``cuda-graph``.

A Llama-shaped model of about 1B parameters (hidden 2048, 16 layers, 32 query / 8 KV heads,
MLP 8192, vocabulary of the local tokenizer) is built locally with random bf16 weights. For
each decode batch size, every row has a context of ``--context`` tokens; ``--steps`` decode
steps are timed after ``--warmup`` (wall clock around ``execute``, synchronised), so host
overhead counts, as it does in the engine. Both executors use the ``triton`` backend.

Mixed steps (``--mixed D+C``, chunked prefill's steady state): ``D`` decode rows at context
``--context`` next to a ``C``-token prefill chunk that ends at the same context; the
cuda-graph executor runs them in piecewise graphs (dense layers replayed per token bucket,
attention eager), padded up to the nearest of its default ``mixed_capture_tokens``.

    python benchmarks/cuda_graph_decode.py    # batch 1, 8, 64; mixed 8+8, 32+256, 64+448

Prints markdown tables: decode tokens/s of each executor and cuda-graph/eager (above 1 = graphs
faster); mixed-step times and eager/cuda-graph (above 1 = graphs faster); then the batch-1
step time next to the memory-bandwidth limit (weight bytes / ``--bandwidth``, 4.8 TB/s for an
H200) as a ratio. Refuses to run without CUDA.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from brigade.interfaces import Executor, ExecutorParams
from brigade.model_input import SeqChunk, build_model_input
from brigade.models.checkpoint import open_checkpoint
from brigade.models.create import create_model
from brigade.plugins.attention.triton_backend import TritonBackend
from brigade.plugins.executors.cuda_graph import CudaGraphExecutor, CudaGraphExecutorOptions
from brigade.plugins.executors.torch_executor import TorchExecutor, TorchExecutorOptions

PAGE_SIZE = 16
SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
}


def decode_tokens_per_second(
    executor: Executor,
    batch_size: int,
    context: int,
    steps: int,
    warmup: int,
    after_each: Callable[[], object] = lambda: None,
) -> tuple[float, float]:
    """(tokens/s, seconds per step) of ``steps`` decode steps over ``batch_size`` rows;
    ``after_each`` is called after every ``execute`` (the prefill's too)."""
    pages_per_row = -(-(context + warmup + steps + 1) // PAGE_SIZE)
    tables = [list(range(r * pages_per_row, (r + 1) * pages_per_row)) for r in range(batch_size)]
    prompt = [(7 * i) % 200 + 3 for i in range(context)]
    executor.execute(build_model_input([SeqChunk(prompt, 0, t) for t in tables], PAGE_SIZE))
    after_each()
    batches = [
        build_model_input([SeqChunk([5], context + step, t) for t in tables], PAGE_SIZE)
        for step in range(warmup + steps)
    ]
    for batch in batches[:warmup]:
        executor.execute(batch)
        after_each()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for batch in batches[warmup:]:
        executor.execute(batch)
        after_each()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / steps
    return batch_size / seconds, seconds


def mixed_step_seconds(
    executor: Executor, num_decodes: int, chunk: int, context: int, steps: int, warmup: int
) -> float:
    """Seconds per step of ``num_decodes`` decodes next to one ``chunk``-token prefill chunk.

    Every row ends the step at ``context`` tokens; the same step is repeated (it rewrites the
    same KV slots), so each repetition does the same work.
    """
    pages_per_row = -(-context // PAGE_SIZE)
    tables = [
        list(range(r * pages_per_row, (r + 1) * pages_per_row)) for r in range(num_decodes + 1)
    ]
    prompt = [(7 * i) % 200 + 3 for i in range(context)]
    executor.execute(
        build_model_input([SeqChunk(prompt[:-1], 0, t) for t in tables[:-1]], PAGE_SIZE)
    )
    executor.execute(build_model_input([SeqChunk(prompt[:-chunk], 0, tables[-1])], PAGE_SIZE))
    step = build_model_input(
        [SeqChunk([5], context - 1, t) for t in tables[:-1]]
        + [SeqChunk(prompt[-chunk:], context - chunk, tables[-1])],
        PAGE_SIZE,
    )
    for _ in range(warmup):
        executor.execute(step)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        executor.execute(step)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps


def profile_decode(executor: Executor, name: str, context: int, steps: int = 20) -> None:
    """Print where a batch-1 decode step's device time goes (torch.profiler, CUPTI), and how
    much of the step's wall time the device is busy."""
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    # Skip the prefill and 3 warm-up steps; record the timed steps only.
    with profile(activities=activities, schedule=schedule(wait=1, warmup=3, active=steps)) as prof:
        _, seconds = decode_tokens_per_second(executor, 1, context, steps, 3, prof.step)
    kernels = [  # the step annotations carry device time of their own: not kernels
        e
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.key.startswith("Profiler")
    ]
    busy_us = sum(e.self_device_time_total for e in kernels) / steps
    print(
        f"\n{name}, batch 1: {seconds * 1e3:.2f} ms a step (profiled), device busy "
        f"{busy_us / 1e3:.2f} ms of it; kernels by device time per step:"
    )
    print("| kernel | calls / step | us / step |")
    print("|---|---:|---:|")
    for event in sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]:
        print(
            f"| {event.key[:70]} | {event.count / steps:.1f} | "
            f"{event.self_device_time_total / steps:.1f} |"
        )


def parse_mixed(spec: str) -> tuple[int, int]:
    """'32+256' -> (32 decodes, a 256-token chunk)."""
    decodes, _, chunk = spec.partition("+")
    try:
        return int(decodes), int(chunk)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected DECODES+CHUNK such as 32+256, got {spec!r}"
        ) from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s (H200)")
    parser.add_argument(
        "--mixed",
        type=parse_mixed,
        nargs="*",
        default=[(8, 8), (32, 256), (64, 448)],
        help="mixed steps DECODES+CHUNK to time (chunk <= --context)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="also profile batch-1 decode steps of each"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_graph_decode.py needs a CUDA GPU")
    if any(chunk < 1 or chunk >= args.context for _, chunk in args.mixed):
        raise SystemExit("--mixed: every chunk must be between 1 and --context - 1 tokens")
    with tempfile.TemporaryDirectory() as tmp:
        model = create_model(Path(tmp) / "llama-1b", "llama", dtype="bfloat16", overrides=SHAPE)
        weight_bytes = (model / "model.safetensors").stat().st_size
        pages = max(
            max(args.batches) * -(-(args.context + args.warmup + args.steps + 1) // PAGE_SIZE),
            max((d + 1 for d, _ in args.mixed), default=0) * -(-args.context // PAGE_SIZE),
        )
        results: dict[str, dict[int, tuple[float, float]]] = {}
        mixed: dict[str, dict[tuple[int, int], float]] = {}
        for name in ("eager", "cuda-graph"):
            params = ExecutorParams(
                model_path=str(model),
                dtype="bfloat16",
                attention=TritonBackend(),
                page_size=PAGE_SIZE,
                kv_cache_dtype="auto",
                max_model_len=args.context + args.warmup + args.steps + 16,
                checkpoint=open_checkpoint(str(model)),
            )
            executor: Executor
            started = time.perf_counter()
            if name == "eager":
                executor = TorchExecutor(params, TorchExecutorOptions(device="cuda"))
                executor.initialize_kv_cache(pages)
            else:
                options = CudaGraphExecutorOptions(capture_sizes=tuple(sorted(args.batches)))
                executor = CudaGraphExecutor(params, options)
                executor.initialize_kv_cache(pages)
            print(f"{name}: loaded (and captured) in {time.perf_counter() - started:.1f} s")
            results[name] = {
                size: decode_tokens_per_second(
                    executor, size, args.context, args.steps, args.warmup
                )
                for size in args.batches
            }
            mixed[name] = {
                (decodes, chunk): mixed_step_seconds(
                    executor, decodes, chunk, args.context, args.steps, args.warmup
                )
                for decodes, chunk in args.mixed
            }
            if args.profile:
                profile_decode(executor, name, args.context)
            buckets = getattr(getattr(executor, "pieces", None), "capture_tokens", ())
            executor.shutdown()
    print(f"\nmodel: {weight_bytes / 1e9:.2f} GB of bf16 weights; context {args.context}")
    print("| decode batch | eager tok/s | cuda-graph tok/s | cuda-graph / eager |")
    print("|---|---|---|---|")
    for size in args.batches:
        eager, graphed = results["eager"][size][0], results["cuda-graph"][size][0]
        print(f"| {size} | {eager:,.0f} | {graphed:,.0f} | {graphed / eager:.2f} |")
    if args.mixed:
        print(f"\nmixed steps (decodes at context {args.context} + one prefill chunk):")
        print(
            "| decodes + chunk | tokens | bucket | eager ms | cuda-graph ms | eager / cuda-graph |"
        )
        print("|---|---|---|---|---|---|")
        for decodes, chunk in args.mixed:
            eager_s, graphed_s = (
                mixed["eager"][(decodes, chunk)],
                mixed["cuda-graph"][(decodes, chunk)],
            )
            tokens = decodes + chunk
            bucket = next((b for b in buckets if b >= tokens), "eager")
            print(
                f"| {decodes} + {chunk} | {tokens} | {bucket} | {eager_s * 1e3:.2f} | "
                f"{graphed_s * 1e3:.2f} | {eager_s / graphed_s:.2f} |"
            )
    if 1 in args.batches:
        limit = weight_bytes / args.bandwidth
        for name in results:
            step = results[name][1][1]
            print(
                f"{name}: batch-1 step {step * 1e3:.2f} ms vs bandwidth limit "
                f"{limit * 1e3:.2f} ms -> {step / limit:.2f}x the limit"
            )


if __name__ == "__main__":
    main()
