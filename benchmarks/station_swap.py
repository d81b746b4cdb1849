"""Swapping one station keeps the rest fast: third-party stations against the default stack.

Runs the default model (SmolLM2-135M-Instruct) on the uniform workload (32 prompts x 128 token
ids -> 128 new tokens each, greedy, EOS ignored so every length is exact, prefix caching off)
in each dtype of ``--dtypes``, with one engine per configuration, built once and run in turns
(A B C D A B C D ..., ``--rounds`` rounds) in this one invocation:

- ``default``: Brigade's built-in stations;
- ``sampler``: ``[sampler] plugin = "plain-torch"``, a sampler in plain torch;
- ``logits-processor``: the built-in sampler with ``[sampler] logits_processors =
  ["repeat-last-n"]`` at its defaults, so it penalises every request's last 64 tokens;
- ``attention``: ``[attention] plugin = "gather-sdpa"``, a pure-Python backend that implements
  only the contract (gather pages, torch SDPA).

The three stations come from the out-of-tree example package
``examples/plugins/brigade-example-stations``, which must be installed. For each engine it
prints generated tokens/s (median over rounds), the ratio to the default stack's median, the
lowest and highest of the per-round ratios, and how many requests produced the default stack's
tokens; and first, from a profile of a few steps of each engine, which of Brigade's CPU fast
paths ran: packed GEMMs, the fused small operations (RMSNorm, RoPE, SiLU-mul), the C++ paged
attention kernels, a step's layers in one C++ call, the C++ sampler.

    pip install --no-deps --no-build-isolation -e examples/plugins/brigade-example-stations
    python benchmarks/station_swap.py                      # fp32 and bf16, 3 rounds
    python benchmarks/station_swap.py --dtypes float32 --rounds 5
    python benchmarks/station_swap.py --scale 0.25 --rounds 1   # a quick look
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.metadata
import statistics
import time

import torch
from offline_throughput import Workload, make_workload  # benchmarks/ is this directory
from step_profile import cpu_flags
from torch.profiler import ProfilerActivity, profile

from brigade import LLM, SamplingParams

PACKAGE = "brigade-example-stations"
INSTALL = f"pip install --no-deps --no-build-isolation -e examples/plugins/{PACKAGE}"

CONFIGS: dict[str, tuple[str, ...]] = {
    "default": (),
    "sampler": ('sampler.plugin="plain-torch"',),
    "logits-processor": ('sampler.logits_processors=["repeat-last-n"]',),
    "attention": ('attention.plugin="gather-sdpa"',),
}
"""Configuration name -> its overrides of the default stack."""

FAST_PATHS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("packed GEMMs", ("panel_", "tile_")),
    ("fused norms/RoPE/SiLU", ("rms_norm", "rope", "silu_mul", "decode_layers")),
    ("C++ paged attention", ("paged_decode", "paged_prefill", "decode_layers")),
    ("layers in one call", ("decode_layers",)),
    ("C++ sampler", ("sample_rows",)),
)
"""Fast path -> fragments of the profiler's op names that show it ran (``decode_layers`` runs
a step's layers, attention and small operations included, in one C++ call)."""


@dataclasses.dataclass
class Engine:
    name: str
    llm: LLM
    rates: list[float] = dataclasses.field(default_factory=list)
    tokens: list[list[int]] = dataclasses.field(default_factory=list)


def check_installed() -> None:
    try:
        importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(
            f"the example plugin package {PACKAGE} is not installed; from the repository "
            f"root run:\n  {INSTALL}"
        ) from None


def build_engine(name: str, dtype: str, settings: list[str]) -> Engine:
    llm = LLM(
        overrides=[
            "model.path=default",
            f"model.dtype={dtype}",
            "kv.num_pages=1024",  # 16384 tokens: the whole batch, never preempted
            "kv.enable_prefix_caching=false",  # every round prefills its prompts again
            *CONFIGS[name],
            *settings,
        ]
    )
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([[7, 8, 9, 10], [11, 12]], warm, use_tqdm=False)
    return Engine(name, llm)


def run_once(engine: Engine, workload: Workload) -> None:
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens
    ]
    started = time.perf_counter()
    outputs = engine.llm.generate(workload.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    produced = sum(map(len, tokens))
    if produced != workload.num_output_tokens:
        raise SystemExit(
            f"{engine.name} produced {produced} tokens, expected {workload.num_output_tokens}"
        )
    engine.rates.append(produced / elapsed)
    engine.tokens = tokens


def fast_paths(engine: Engine, workload: Workload) -> str:
    """Which fast paths one prefill and a few decode steps ran, from a profile of them."""
    prompts = workload.prompts[:4]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        engine.llm.generate(prompts, params, use_tqdm=False)
    names = collections.Counter(event.name for event in profiler.events())
    ran = [
        label
        for label, fragments in FAST_PATHS
        if any(fragment in name for name in names for fragment in fragments)
    ]
    lost = [label for label, _ in FAST_PATHS if label not in ran]
    return "ran: " + (", ".join(ran) or "none") + ("; not: " + ", ".join(lost) if lost else "")


def report(dtype: str, engines: list[Engine]) -> None:
    default = engines[0]
    base = statistics.median(default.rates)
    print(f"\n{dtype}: tokens/s, median of {len(default.rates)} rounds")
    print(f"{'engine':<17} {'tok/s':>8} {'ratio':>6} {'per round':>12} {'same tokens':>12}")
    for engine in engines:
        rate = statistics.median(engine.rates)
        turns = [mine / theirs for mine, theirs in zip(engine.rates, default.rates, strict=True)]
        same = sum(
            mine == theirs for mine, theirs in zip(engine.tokens, default.tokens, strict=True)
        )
        print(
            f"{engine.name:<17} {rate:>8.1f} {rate / base:>5.3f}x "
            f"{min(turns):>5.3f}-{max(turns):<5.3f} {same:>5}/{len(engine.tokens)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=3, help="turns of every engine")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the 32 requests")
    parser.add_argument("--set", action="append", default=[], help="a setting for every engine")
    args = parser.parse_args()
    check_installed()
    torch.set_num_threads(args.threads)
    print(f"{cpu_flags()}; torch {torch.__version__}, {args.threads} threads")
    workload: Workload | None = None
    for dtype in args.dtypes.split(","):
        engines = [build_engine(name, dtype, args.set) for name in CONFIGS]
        if workload is None:
            vocab_size = engines[0].llm.engine.vocab_size
            workload = make_workload("uniform", vocab_size, seed=0, scale=args.scale)
            print(
                f"SmolLM2, {len(workload.prompts)} prompts x 128 -> 128 tokens, greedy, "
                f"{args.rounds} rounds, engines in turns"
            )
        print(f"\n{dtype}: fast paths (profile of 4 prompts, 3 tokens each)")
        for engine in engines:
            print(f"{engine.name:<17} {fast_paths(engine, workload)}")
        for _ in range(args.rounds):
            for engine in engines:
                run_once(engine, workload)
        report(dtype, engines)
        del engines  # frees this dtype's models and KV pools before the next


if __name__ == "__main__":
    main()
