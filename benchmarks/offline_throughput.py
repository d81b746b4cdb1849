"""Offline throughput: brigade's engine vs transformers ``generate`` on the same workloads.

Both run the same locally built model (random weights), greedy, EOS ignored, on the same
device in the same dtype (``--device``, ``--dtype``; CPU and fp32 by default), in one
invocation, and the script prints generated tokens/s and the ratio. transformers runs static
batches (left-padded, ``--hf-batch-size`` prompts at a time, each batch until its longest
output); only the tokens each request asked for are counted. ``--executor`` picks brigade's
executor (``torch``, or ``cuda-graph`` with ``--device cuda``); ``--set`` passes any other
brigade setting.

    python benchmarks/offline_throughput.py --size tiny --workload uniform
    python benchmarks/offline_throughput.py --size small --workload mixed
    python benchmarks/offline_throughput.py --size small --workload mixed --device cuda \
        --dtype bfloat16 --executor cuda-graph --set attention.plugin=triton

Workloads: ``uniform`` is PEERS.md's (32 prompts x 128 token ids, 128 new tokens each);
``mixed`` is 128 requests with prompt 16-512 and output 16-256 tokens (seeded).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import time
from pathlib import Path
from typing import Any

import torch

from brigade import LLM, SamplingParams
from brigade.models.create import create_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Target:
    """Where both engines run: torch device and dtype name, and brigade's executor plugin."""

    device: str = "cpu"
    dtype: str = "float32"
    executor: str = "torch"

    def synchronize(self) -> None:
        """Wait for queued GPU work, so a timer stopped next counts it."""
        if self.device == "cuda":
            torch.cuda.synchronize()


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(name: str, vocab_size: int, seed: int, scale: float) -> Workload:
    rng = random.Random(seed)
    if name == "uniform":
        count, prompt_lens, output_lens = 32, [128] * 32, [128] * 32
    elif name == "mixed":
        count = 128
        prompt_lens = [rng.randint(16, 512) for _ in range(count)]
        output_lens = [rng.randint(16, 256) for _ in range(count)]
    else:
        raise SystemExit(f"unknown workload {name!r}; use uniform or mixed")
    count = max(1, int(count * scale))
    prompts = [[rng.randrange(10, vocab_size) for _ in range(n)] for n in prompt_lens[:count]]
    return Workload(prompts, output_lens[:count])


def model_dir(size: str, arch: str) -> Path:
    root = Path(os.environ.get("BRIGADE_CACHE_DIR", Path.home() / ".cache" / "brigade"))
    path = root / "bench" / f"{arch}-{size}"
    if not (path / "model.safetensors").exists():
        create_model(path, arch, size)
    return path


def run_brigade(path: Path, workload: Workload, target: Target, settings: list[str]) -> float:
    llm = LLM(
        overrides=[
            f"model.path={path}",
            f"model.dtype={target.dtype}",
            f"executor.plugin={target.executor}",
            f"executor.device={target.device}",
            *settings,
        ]
    )
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    # On a GPU, warm up on a batch too: Triton compiles kernels for the shapes it first meets
    # (prefill chunks, batched decodes), and that belongs to startup, not to throughput.
    warm_prompts = [workload.prompts[0][:16]] if target.device == "cpu" else workload.prompts[:8]
    llm.generate(warm_prompts, warm, use_tqdm=False)
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens
    ]
    started = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    if produced != workload.num_output_tokens:
        raise SystemExit(
            f"brigade produced {produced} tokens, expected {workload.num_output_tokens}"
        )
    return elapsed


def run_transformers(path: Path, workload: Workload, target: Target, batch_size: int) -> float:
    from transformers import AutoModelForCausalLM

    # Any: transformers types PreTrainedModel.to as a wrapper mypy cannot call.
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[target.dtype])
    model = model.to(target.device).eval()
    pad = model.generation_config.pad_token_id or 0

    def generate(prompts: list[list[int]], max_new: int) -> None:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=target.device)
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=target.device
        )
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad,
        )

    with torch.inference_mode():
        generate([workload.prompts[0][:16]], 4)  # warm-up
        target.synchronize()
        started = time.perf_counter()
        for start in range(0, len(workload.prompts), batch_size):
            prompts = workload.prompts[start : start + batch_size]
            generate(prompts, max(workload.output_lens[start : start + batch_size]))
        target.synchronize()
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny", choices=("tiny", "small"))
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--workload", default="uniform", choices=("uniform", "mixed"))
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the requests")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="both engines")
    parser.add_argument("--dtype", default="float32", choices=tuple(DTYPES), help="both engines")
    parser.add_argument(
        "--executor", default="torch", choices=("torch", "cuda-graph"), help="brigade's executor"
    )
    parser.add_argument(
        "--set", action="append", default=[], help="brigade config override (repeatable)"
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU here")
    if args.executor == "cuda-graph" and args.device != "cuda":
        parser.error("--executor cuda-graph needs --device cuda")
    target = Target(args.device, args.dtype, args.executor)
    torch.set_num_threads(args.threads)
    path = model_dir(args.size, args.arch)
    workload = make_workload(args.workload, 4000, args.seed, args.scale)
    tokens = workload.num_output_tokens
    print(
        f"model {args.arch}-{args.size}, workload {args.workload}: {len(workload.prompts)} "
        f"requests, {sum(map(len, workload.prompts))} prompt tokens, {tokens} output tokens, "
        f"{args.threads} threads"
        + ("" if target == Target() else f", {target.device} {target.dtype}, {target.executor}")
    )
    brigade_s = run_brigade(path, workload, target, args.set)
    print(f"brigade       {tokens / brigade_s:9.1f} tok/s  ({brigade_s:.1f} s)")
    if args.skip_transformers:
        return
    hf_s = run_transformers(path, workload, target, args.hf_batch_size)
    print(
        f"transformers  {tokens / hf_s:9.1f} tok/s  ({hf_s:.1f} s, static batches of "
        f"{args.hf_batch_size})"
    )
    print(f"ratio brigade / transformers: {hf_s / brigade_s:.2f}x")


if __name__ == "__main__":
    main()
