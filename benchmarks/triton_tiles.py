"""Tune the ``triton`` backend's prefill on this GPU: every tile/warp/stage setting, timed.

For each prefill case of ``attention_kernels.py`` (same shapes: head dim 128, 32 query heads
over 8 KV heads, pages of 16) and each combination of ``prefill_block_m``, ``prefill_block_n``,
``prefill_num_warps`` and ``prefill_num_stages``, one layer's ``forward`` is timed with CUDA
events (median), next to sdpa's. Settings the GPU cannot compile (shared memory) are listed as
such. The output is checked against sdpa's on every setting.

    python benchmarks/triton_tiles.py                  # bf16, the full sweep
    python benchmarks/triton_tiles.py --warps 8 --stages 3

Prints, per case, the settings from fastest to slowest, then the setting with the best geometric
mean over the cases and the default's rank; pass the winner as ``[attention]`` options.
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
from attention_kernels import (
    DTYPES,
    HEAD_DIM,
    NUM_HEADS,
    NUM_KV_HEADS,
    PREFILLS,
    make_case,
    measure,
)

from brigade.interfaces import AttentionLayer, NoOptions
from brigade.plugins.attention.sdpa import SdpaBackend
from brigade.plugins.attention.triton_backend import (
    TritonAttentionOptions,
    TritonBackend,
    triton_interpreting,
)

Setting = tuple[int, int, int, int]  # block_m, block_n, num_warps, num_stages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--block-m", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available() or triton_interpreting():
        raise SystemExit("triton_tiles.py times compiled kernels: it needs a CUDA GPU and no "
                         "TRITON_INTERPRET")  # fmt: skip
    dtype = DTYPES[args.dtype]
    layer = AttentionLayer(0, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    settings: list[Setting] = list(
        itertools.product(args.block_m, args.block_n, args.warps, args.stages)
    )
    print(f"# {torch.cuda.get_device_name()}, {args.dtype}, capability ", end="")
    print(
        f"{torch.cuda.get_device_capability()}, {len(settings)} settings, median of {args.repeats}"
    )
    timings: dict[Setting, list[float]] = {setting: [] for setting in settings}
    for seed, (label, rows) in enumerate(PREFILLS):
        case = make_case(label, rows, dtype, seed)
        sdpa_ms, reference, _ = measure(SdpaBackend(NoOptions()), case, layer, 1, args.repeats)
        results: list[tuple[float, Setting]] = []
        for setting in settings:
            if setting not in timings:
                continue  # failed to compile on an earlier case
            block_m, block_n, warps, stages = setting
            options = TritonAttentionOptions(
                prefill_block_m=block_m, prefill_block_n=block_n,
                prefill_num_warps=warps, prefill_num_stages=stages,
            )  # fmt: skip
            try:
                ms, output, _ = measure(TritonBackend(options), case, layer, args.warmup,
                                        args.repeats)  # fmt: skip
            except Exception as error:
                print(f"  {setting}: cannot run here ({type(error).__name__})")
                del timings[setting]
                continue
            diff = float((output.float() - reference.float()).abs().max())
            if diff > 0.05:
                raise SystemExit(f"{setting} on {label}: max |triton - sdpa| = {diff:.3g}")
            timings[setting].append(ms)
            results.append((ms, setting))
        results.sort()
        print(f"\n## {label}: sdpa {sdpa_ms:.3f} ms")
        print("| block_m | block_n | warps | stages | ms | sdpa/triton |")
        print("|---:|---:|---:|---:|---:|---:|")
        for ms, (block_m, block_n, warps, stages) in results[:8]:
            print(
                f"| {block_m} | {block_n} | {warps} | {stages} | {ms:.3f} | {sdpa_ms / ms:.2f}x |"
            )
        del case
        torch.cuda.empty_cache()
    means = sorted(
        (math.exp(sum(map(math.log, ms)) / len(ms)), setting)
        for setting, ms in timings.items()
        if len(ms) == len(PREFILLS)
    )
    print("\n## geometric mean over the cases")
    for rank, (mean, setting) in enumerate(means, 1):
        if rank <= 5 or (setting[:2] == (64, 64) and setting[2] == 4):
            print(f"{rank:3d}. block_m, block_n, warps, stages = {setting}: {mean:.3f} ms")


if __name__ == "__main__":
    main()
