"""Brigade's panel GEMM (and AMX tile GEMM) against oneDNN's packed one, at a model's linear
shapes, by batch rows.

    python benchmarks/cpu_gemm.py                  # SmolLM2's layer shapes at 1-512 rows
    python benchmarks/cpu_gemm.py --rows 1 32 --lm-head
    python benchmarks/cpu_gemm.py --shapes 4096x4096 11008x4096 --rows 1 8
    python benchmarks/cpu_gemm.py --dtype bfloat16    # needs oneDNN's bfloat16 (AVX512-BF16, AMX)
    python benchmarks/cpu_gemm.py --gate-up --rows 1 112 2048   # SiLU-mul in the GEMM or after
    python benchmarks/cpu_gemm.py --dtype bfloat16 --step 30 --rows 16 112 512 2048

Each shape is timed on as many distinct weights as make ~64 MB, so that a call reads its
weight from memory as a model's layer does rather than from the caches; the two kernels take
turns (two rounds, the best of each kept), 2 threads, float32 unless ``--dtype``. Prints ms per
call, the rate the weight was read at (what bounds a layer at one row) and GFLOP/s, the ratio,
and the largest difference from F.linear in float32 on the same inputs. In bfloat16 on a CPU
with AMX the tile GEMM (``cpu_linear = "tiles"``) takes its turn too. ``--gate-up`` times
SmolLM2's gate_up projection and its SiLU-mul instead: the panel GEMM then ``silu_mul``, against
``panel_silu_mul`` on paired panels (the product in the GEMM's epilogue), and checks that both
give the same bits. ``--step N`` times a step's worth instead: the shapes of N layers, each
layer's weights distinct (so read from memory, as in a model's step), called in the model's
order, oneDNN's packed GEMM against what ``cpu_linear = "panels"`` picks here (the panels, or
in bfloat16 on AMX the tile GEMM), both as the engine swaps them in (``use_cpu_linears``),
each output freed before the next call and large buffers kept in the heap as the CPU executor
keeps them (``keep_freed_memory``), so outputs land in reused memory as in a step.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from brigade.plugins.cpu import gemm as cpu_gemm
from brigade.plugins.cpu.build import cpu_ops
from brigade.plugins.cpu.gemm import pack_weight
from brigade.plugins.cpu.memory import keep_freed_memory

SMOLLM2 = ("960x576", "576x576", "3072x576", "576x1536")
"""out x in of SmolLM2-135M's qkv, o, gate_up and down projections."""
LM_HEAD = "49152x576"
GATE_UP_WIDTH, SMOLLM2_HIDDEN = 1536, 576
"""SmolLM2's MLP width (its gate_up projection is 2 x 1536 rows) and hidden size."""


def best_seconds(call: Callable[[int], object], count: int, repeats: int) -> float:
    """Seconds per call, over ``repeats`` passes of ``count`` weights, after one pass."""
    for index in range(count):
        call(index)
    started = time.perf_counter()
    for _ in range(repeats):
        for index in range(count):
            call(index)
    return (time.perf_counter() - started) / repeats / count


def take_turns(
    calls: dict[str, Callable[[int], object]], count: int, repeats: int, rounds: int
) -> dict[str, float]:
    """Each call's best seconds per call over ``rounds`` rounds, the calls taking turns."""
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, call in calls.items():
            best[name] = min(best.get(name, float("inf")), best_seconds(call, count, repeats))
    return best


def compare(
    ops: object, rows: int, out_features: int, in_features: int, dtype: torch.dtype
) -> None:
    size = torch.finfo(dtype).bits // 8
    count = max(1, int(64e6 // (out_features * in_features * size)))
    weights = [torch.randn(out_features, in_features).to(dtype) for _ in range(count)]
    packed = [pack_weight(w) for w in weights]
    panels = [ops.pack_panels(w) for w in weights]  # type: ignore[attr-defined]
    x = torch.randn(rows, in_features).to(dtype)
    got = ops.panel_linear(x, panels[0], None, out_features)  # type: ignore[attr-defined]
    error = (got.float() - F.linear(x.float(), weights[0].float())).abs().max().item()
    flops = 2 * rows * out_features * in_features
    repeats = max(3, int(1e10 // (flops * count)))
    calls = {
        "oneDNN packed": lambda i: torch.ops.mkldnn._linear_pointwise(
            x, packed[i], None, "none", [], ""
        ),
        "panels": lambda i: ops.panel_linear(x, panels[i], None, out_features),  # type: ignore[attr-defined]
    }
    if cpu_gemm.tiles_usable(dtype) and in_features % 2 == 0:
        tiles = [ops.tile_pack(w) for w in weights]  # type: ignore[attr-defined]
        calls["tiles"] = lambda i: ops.tile_linear(x, tiles[i], None, out_features)  # type: ignore[attr-defined]
    best = take_turns(calls, count, repeats, rounds=2)
    parts = [f"rows {rows:4d}  {out_features:5d}x{in_features:<5d}"]
    for name, seconds in best.items():
        gb_per_s = out_features * in_features * size / seconds / 1e9
        gflops = flops / seconds / 1e9
        parts.append(f"{name} {seconds * 1e3:7.3f} ms ({gb_per_s:5.1f} GB/s, {gflops:4.0f} GF)")
    ratio = best["oneDNN packed"] / best["panels"]
    parts.append(f"panels {ratio:4.2f}x as fast")
    if "tiles" in best:
        parts.append(f"tiles {best['oneDNN packed'] / best['tiles']:4.2f}x as fast")
    parts.append(f"max |diff| {error:.1e}")
    print("  ".join(parts), flush=True)


def compare_gate_up(ops: Any, rows: int, width: int, in_features: int, dtype: torch.dtype) -> None:
    size = torch.finfo(dtype).bits // 8
    count = max(1, int(64e6 // (2 * width * in_features * size)))
    weights = [torch.randn(2 * width, in_features).to(dtype) for _ in range(count)]
    plain = [ops.pack_panels(w) for w in weights]
    paired = [ops.pack_panels(w, True) for w in weights]
    x = torch.randn(rows, in_features).to(dtype)
    separate = ops.silu_mul(ops.panel_linear(x, plain[0], None, 2 * width))
    same = bool(torch.equal(separate, ops.panel_silu_mul(x, paired[0], None, width)))
    flops = 2 * rows * 2 * width * in_features
    repeats = max(3, int(1e10 // (flops * count)))
    calls = {
        "GEMM, then silu_mul": lambda i: ops.silu_mul(
            ops.panel_linear(x, plain[i], None, 2 * width)
        ),
        "panel_silu_mul": lambda i: ops.panel_silu_mul(x, paired[i], None, width),
    }
    best = take_turns(calls, count, repeats, rounds=3)
    parts = [f"rows {rows:4d}  gate_up {2 * width}x{in_features}"]
    for name, seconds in best.items():
        parts.append(f"{name} {seconds * 1e3:7.3f} ms ({flops / seconds / 1e9:4.0f} GF)")
    ratio = best["GEMM, then silu_mul"] / best["panel_silu_mul"]
    parts.append(f"in the GEMM {ratio:4.2f}x as fast, same bits: {same}")
    print("  ".join(parts), flush=True)


def compare_step(rows: int, layers: int, shapes: list[str], dtype: torch.dtype) -> None:
    sizes = [tuple(int(n) for n in shape.lower().split("x")) for shape in shapes]
    xs = {i: torch.randn(rows, i).to(dtype) for _, i in sizes}
    steps = {}
    for mode in ("packed", "panels"):  # oneDNN's, and what the default picks here
        torch.manual_seed(0)
        step = nn.ModuleList(
            nn.Linear(i, o, bias=False, dtype=dtype) for _ in range(layers) for o, i in sizes
        )
        cpu_gemm.use_cpu_linears(step, mode)
        steps[mode] = step
    ours = steps["panels"][0].layout  # type: ignore[union-attr]

    def run(step: nn.ModuleList) -> None:
        for layer in step:  # each output freed before the next, as a step frees them
            layer(xs[layer.in_features])

    calls = {
        name: (lambda _, step=step: run(step))
        for name, step in (("oneDNN packed", steps["packed"]), (ours, steps["panels"]))
    }
    flops = 2 * rows * layers * sum(o * i for o, i in sizes)
    best = take_turns(calls, 1, max(3, int(3e10 // flops)), rounds=3)
    parts = [f"rows {rows:4d}  {layers} layers of {' '.join(shapes)}"]
    for name, seconds in best.items():
        parts.append(f"{name} {seconds * 1e3:7.2f} ms ({flops / seconds / 1e9:5.0f} GF)")
    parts.append(f"{ours} {best['oneDNN packed'] / best[ours]:4.2f}x as fast")
    print("  ".join(parts), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
    parser.add_argument("--shapes", nargs="+", default=list(SMOLLM2), help="OUTxIN")
    parser.add_argument("--lm-head", action="store_true", help=f"also SmolLM2's {LM_HEAD}")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--gate-up", action="store_true", help="SiLU-mul in the gate_up GEMM or after it"
    )
    parser.add_argument(
        "--step", type=int, default=0, metavar="LAYERS", help="a step's worth of LAYERS layers"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as the CPU executor allocates: outputs reuse freed memory
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("the CPU kernels could not be built here")
    from step_profile import cpu_flags  # benchmarks/ is this script's directory

    dtype = getattr(torch, args.dtype)
    if dtype == torch.bfloat16 and not cpu_gemm.onednn_usable(dtype):
        raise SystemExit("oneDNN runs no bfloat16 on this CPU: nothing to compare the panels with")
    print(f"{cpu_flags()}; torch {torch.__version__}, {args.threads} threads, {args.dtype}")
    if args.gate_up:
        for rows in args.rows:
            compare_gate_up(ops, rows, GATE_UP_WIDTH, SMOLLM2_HIDDEN, dtype)
        return
    shapes = [*args.shapes, *([LM_HEAD] if args.lm_head else [])]
    if args.step:
        for rows in args.rows:
            compare_step(rows, args.step, args.shapes, dtype)
        return
    for rows in args.rows:
        for shape in shapes:
            out_features, in_features = (int(n) for n in shape.lower().split("x"))
            compare(ops, rows, out_features, in_features, dtype)


if __name__ == "__main__":
    main()
