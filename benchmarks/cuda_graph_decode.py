"""Decode tokens/s on one GPU: the eager ``torch`` executor vs the ``cuda-graph`` executor.

A Llama-shaped model of about 1B parameters (hidden 2048, 16 layers, 32 query / 8 KV heads,
MLP 8192, vocabulary of the local tokenizer) is built locally with random bf16 weights. For
each decode batch size, every row has a context of ``--context`` tokens; ``--steps`` decode
steps are timed after ``--warmup`` (wall clock around ``execute``, synchronised), so host
overhead counts, as it does in the engine. Both executors use the ``triton`` backend.

    python benchmarks/cuda_graph_decode.py               # batch 1, 8, 64 at context 512

Prints a markdown table: tokens/s of each executor and cuda-graph/eager (above 1 = graphs
faster), then the batch-1 step time next to the memory-bandwidth limit (weight bytes /
``--bandwidth``, 4.8 TB/s for an H200) as a ratio. Refuses to run without CUDA.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from brigade.interfaces import Executor, ExecutorParams
from brigade.model_input import SeqChunk, build_model_input
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
    executor: Executor, batch_size: int, context: int, steps: int, warmup: int
) -> tuple[float, float]:
    """(tokens/s, seconds per step) of ``steps`` decode steps over ``batch_size`` rows."""
    pages_per_row = -(-(context + warmup + steps + 1) // PAGE_SIZE)
    tables = [list(range(r * pages_per_row, (r + 1) * pages_per_row)) for r in range(batch_size)]
    prompt = [(7 * i) % 200 + 3 for i in range(context)]
    executor.execute(build_model_input([SeqChunk(prompt, 0, t) for t in tables], PAGE_SIZE))
    batches = [
        build_model_input([SeqChunk([5], context + step, t) for t in tables], PAGE_SIZE)
        for step in range(warmup + steps)
    ]
    for batch in batches[:warmup]:
        executor.execute(batch)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for batch in batches[warmup:]:
        executor.execute(batch)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / steps
    return batch_size / seconds, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s (H200)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_graph_decode.py needs a CUDA GPU")
    with tempfile.TemporaryDirectory() as tmp:
        model = create_model(Path(tmp) / "llama-1b", "llama", dtype="bfloat16", overrides=SHAPE)
        weight_bytes = (model / "model.safetensors").stat().st_size
        pages = max(args.batches) * -(-(args.context + args.warmup + args.steps + 1) // PAGE_SIZE)
        results: dict[str, dict[int, tuple[float, float]]] = {}
        for name in ("eager", "cuda-graph"):
            params = ExecutorParams(
                model_path=str(model),
                dtype="bfloat16",
                attention=TritonBackend(),
                page_size=PAGE_SIZE,
                kv_cache_dtype="auto",
                max_model_len=args.context + args.warmup + args.steps + 16,
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
            executor.shutdown()
    print(f"\nmodel: {weight_bytes / 1e9:.2f} GB of bf16 weights; context {args.context}")
    print("| decode batch | eager tok/s | cuda-graph tok/s | cuda-graph / eager |")
    print("|---|---|---|---|")
    for size in args.batches:
        eager, graphed = results["eager"][size][0], results["cuda-graph"][size][0]
        print(f"| {size} | {eager:,.0f} | {graphed:,.0f} | {graphed / eager:.2f} |")
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
