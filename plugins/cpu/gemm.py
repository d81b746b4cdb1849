"""Brigade's GEMMs for a model's linear layers on a CPU, on weights packed once at load.

``F.linear`` on a CPU in float32 calls MKL's sgemm. Faster paths:

- ``panels`` (the default): Brigade's own float32 kernel (``cpu_gemm.cpp``) on the weight
  packed into column panels, one vector of output columns each, k-major. Per step each weight
  vector is read once and feeds one FMA per row of the batch, so at decode batch sizes, where
  a layer is mostly a read of its weight, it streams at the memory's speed: on SmolLM2's
  shapes (AVX-512, 2 threads) 1.6-2.8x oneDNN's packed GEMM at one row, 1.1-1.4x at 8-32 rows,
  level at 128-512 (docs/benchmarks.md). In bfloat16 on CPUs with AVX512-BF16 the panels hold
  pairs of k and one ``vdpbf16ps`` adds both products in float32, as oneDNN's bf16 kernels do;
  elsewhere (AVX2) they are laid out as float32's and each weight vector is widened to float32
  as it is read: half float32's bytes, the same FMAs (oneDNN runs no bfloat16 there, and
  ``F.linear`` ran SmolLM2 in bfloat16 at a sixth of float32's speed).
  Bfloat16 weights take Brigade's AMX tile GEMM instead on CPUs with AMX (``cpu_tiles.cpp``,
  ``cpu_tile_loop.cpp``): blocks of 32 output columns in the layout of oneDNN's AMX
  micro-kernel, the products on AMX tiles while the next block's weights are fetched. On
  SmolLM2's layers with cold weights (an Intel Xeon, 2 threads, docs/benchmarks.md) 1.3-1.4x
  oneDNN's packed matmul at 1-16 rows, 1.0-1.2x at 112-512, 0.8-0.85x at 2048 (level at
  1024-4096 rows on a random Llama of hidden size 1024); the mixed, uniform and
  shared-prefix workloads 1-20% faster end to end (the panels, 3.5-12x slower than either
  from 32 rows on, keep no bfloat16 there).
- ``tiles``: the same as ``panels`` (the name of the tile GEMM's mode from when it was
  opt-in; configs that name it keep working).
- ``packed``: oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``) on the weight
  reordered once into the blocked layout its kernels read for this CPU
  (``torch.ops.mkldnn._reorder_linear_weight``), as vLLM-CPU does; ``onednn`` runs it on the
  weight as loaded (reordered at every call).

A gate_up projection (named to :func:`use_cpu_linears` by the executor, which learns them from the
model's ``decoder_weights()``) packs its gate and up columns in pairs on panels and tiles, so that
:meth:`CpuLinear.silu_mul` computes ``silu(gate) * up`` as the GEMM stores its output, without
writing the projection's output (on panels 4-6% faster than the GEMM and the SiLU-mul one after the
other; the same results).

:func:`use_cpu_linears` swaps every ``nn.Linear`` of a model for a :class:`CpuLinear`, a
module swap (as ``torch.ao`` quantization does). The packed copy replaces the dense weight, so
memory stays as it was; ``onednn`` keeps the weight as loaded.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Collection
from typing import Any, cast

import torch
from torch import nn

__all__ = [
    "CPU_LINEAR_MODES",
    "CpuLinear",
    "onednn_linear",
    "onednn_usable",
    "pack_weight",
    "panels_chosen",
    "panels_usable",
    "tiles_usable",
    "use_cpu_linears",
]

logger = logging.getLogger(__name__)

CPU_LINEAR_MODES = ("panels", "tiles", "packed", "onednn", "plain")
"""``[executor] cpu_linear``: Brigade's kernels (column panels for float32, and for bfloat16
where the CPU has no AMX; bfloat16 on the AMX tile GEMM where it has), the same under its
former name, oneDNN on prepacked weights, oneDNN on the weights as loaded, or ``F.linear``."""
PACK_ROWS = 32
"""The row count oneDNN chooses the packed layout for: a decode batch. Measured best or level
with packing for 1 or 512 rows at 1, 32 and 512 rows (docs/benchmarks.md)."""


@functools.cache
def onednn_usable(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build and CPU run oneDNN's linear op in ``dtype`` (float32, or
    bfloat16 where the CPU has the instructions for it), packed and not, with the right result."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        x, weight, bias = torch.ones(4, 3, dtype=dtype), torch.ones(2, 3, dtype=dtype), None
        dense = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        packed = torch.ops.mkldnn._linear_pointwise(x, pack_weight(weight), bias, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    expected = torch.full((4, 2), 3.0, dtype=dtype)
    return bool(torch.equal(dense, expected) and torch.equal(packed, expected))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A dense [out, in] weight reordered into oneDNN's layout for this CPU (an opaque
    tensor that only oneDNN's linear op reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through oneDNN: x [..., in]; weight [out, in] on a CPU,
    dense or from :func:`pack_weight` -> [..., out] (callers check :func:`onednn_usable`)."""
    in_features = x.shape[-1]
    flat = x.reshape(-1, in_features)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


def panels_usable(dtype: torch.dtype = torch.float32) -> bool:
    """Whether Brigade's panel GEMM runs ``dtype`` here: float32 and bfloat16 where the CPU
    kernels are built."""
    return dtype in (torch.float32, torch.bfloat16) and _panel_ops() is not None


def panels_chosen(dtype: torch.dtype = torch.float32) -> bool:
    """Whether ``cpu_linear = "panels"`` puts layers of ``dtype`` on the panel GEMM here: where
    it runs them (:func:`panels_usable`), except where the AMX tile GEMM runs ``dtype``
    (:func:`tiles_usable`: bfloat16 on a CPU with AMX), several times faster from a few rows on."""
    return panels_usable(dtype) and not tiles_usable(dtype)


def tiles_usable(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether Brigade's AMX tile GEMM runs ``dtype`` here: bfloat16 where the AMX tile kernels
    run (:func:`~brigade.plugins.cpu.build.amx_tiles_usable`)."""
    from brigade.plugins.cpu.build import amx_tiles_usable

    return dtype == torch.bfloat16 and amx_tiles_usable()


def _panel_ops() -> Any:
    from brigade.plugins.cpu.build import cpu_ops

    return cpu_ops()


class CpuLinear(nn.Module):
    """A linear layer on one of the CPU GEMMs, by ``layout``: ``panels`` (Brigade's kernel,
    float32 or bfloat16), ``tiles`` (Brigade's AMX kernel, bfloat16), ``packed`` (oneDNN on its
    own layout) or ``dense`` (oneDNN on the loaded weight). ``gate_up`` (panels and tiles): the
    layer is a gate_up projection, packed in pairs for :meth:`silu_mul` (``paired``)."""

    LAYOUTS = ("panels", "tiles", "packed", "dense")

    def __init__(self, linear: nn.Linear, layout: str, *, gate_up: bool = False) -> None:
        super().__init__()
        if layout not in self.LAYOUTS:
            raise ValueError(f"layout {layout!r} is not one of {', '.join(self.LAYOUTS)}")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.bias = linear.bias
        self.layout = layout
        self.paired = gate_up and layout in ("panels", "tiles")
        self.packed: torch.Tensor | None = None
        """The weight in the kernel's layout (the dense one is dropped), or None (dense)."""
        if layout == "panels":
            self.packed = _panel_ops().pack_panels(linear.weight.detach(), self.paired)
        elif layout == "tiles":
            self.packed = _panel_ops().tile_pack(linear.weight.detach(), self.paired)
        elif layout == "packed":
            self.packed = pack_weight(linear.weight)
        self.weight = None if self.packed is not None else linear.weight  # the checkpoint's

    @property
    def gemm_weight(self) -> torch.Tensor:
        """What the GEMM reads: the packed weight, or the dense one."""
        weight = self.packed if self.packed is not None else self.weight
        assert weight is not None  # one of the two is always set
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features]."""
        if self.layout not in ("panels", "tiles"):
            return onednn_linear(x, self.gemm_weight, self.bias)
        ops = _panel_ops()
        linear = ops.panel_linear if self.layout == "panels" else ops.tile_linear
        flat = self._rows(x)
        if self.paired:  # the projection itself, out of pair order (what silu_mul avoids)
            lanes = int(ops.panel_lanes() if self.layout == "panels" else ops.tile_width())
            half = self.out_features // 2
            pairs = -(-half // lanes)
            bias = None
            if self.bias is not None:  # [gate, up] -> pair order, each half padded
                halves = self.bias.detach().view(2, half)
                padded = torch.zeros(2, pairs * lanes, dtype=halves.dtype)
                padded[:, :half] = halves
                bias = padded.view(2, pairs, lanes).transpose(0, 1).contiguous().view(-1)
            raw = linear(flat, self.gemm_weight, bias, 2 * pairs * lanes)
            halves_out = raw.view(-1, pairs, 2, lanes).transpose(1, 2).reshape(-1, 2, pairs * lanes)
            out = halves_out[:, :, :half].reshape(-1, self.out_features)
        else:
            out = linear(flat, self.gemm_weight, self.bias, self.out_features)
        return cast("torch.Tensor", out).reshape(*x.shape[:-1], self.out_features)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """A paired gate_up projection and the SiLU-mul after it: x [..., in_features] ->
        silu(gate) * up [..., out_features // 2], in one pass of the GEMM."""
        if not self.paired:
            raise RuntimeError("silu_mul needs a gate_up projection packed in pairs")
        half = self.out_features // 2
        ops = _panel_ops()
        fused = ops.panel_silu_mul if self.layout == "panels" else ops.tile_silu_mul
        out = fused(self._rows(x), self.gemm_weight, self.bias, half)
        return cast("torch.Tensor", out).reshape(*x.shape[:-1], half)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        return flat if flat.stride(-1) == 1 else flat.contiguous()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.layout}"


def use_cpu_linears(model: nn.Module, mode: str, *, gate_up: Collection[nn.Module] = ()) -> int:
    """Swap every CPU ``nn.Linear`` of ``model`` in a dtype oneDNN runs here for a
    :class:`CpuLinear` (``mode`` ``panels``, ``tiles``, ``packed`` or ``onednn``; ``plain``
    changes nothing). ``gate_up``: the model's gate_up projections (their output is ``[gate,
    up]`` halves that only ever feed ``silu(gate) * up``), packed in pairs on panels and tiles
    for :meth:`CpuLinear.silu_mul`; ``ValueError`` for one of odd width. In ``panels`` mode
    (``tiles`` is the same) bfloat16 layers take the AMX tile GEMM where it runs
    (:func:`tiles_usable`; a layer of odd in_features excepted), the layers in a dtype the
    panel kernel takes here (see :func:`panels_chosen`) take it, and the others oneDNN's packed
    layout, as do all of them when the kernels cannot be built here (with a warning).

    Returns the number of layers swapped (0 where oneDNN's op is missing: a warning is logged
    and the model is left as it was).
    """
    if mode not in CPU_LINEAR_MODES:
        raise ValueError(f"cpu_linear {mode!r} is not allowed; allowed: {CPU_LINEAR_MODES}")
    paired = {id(linear) for linear in gate_up}
    for linear in gate_up:
        if isinstance(linear, nn.Linear) and linear.out_features % 2:
            raise ValueError(f"a gate_up projection needs an even width, not {linear.out_features}")
    if mode == "plain":
        return 0
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.device.type == "cpu"
    ]
    dtypes = {child.weight.dtype for _, _, child in targets}
    ours = mode in ("panels", "tiles")
    tiles = {dtype for dtype in dtypes if ours and tiles_usable(dtype)}
    panels = {dtype for dtype in dtypes - tiles if ours and panels_chosen(dtype)}
    if ours and torch.float32 in dtypes - panels:
        logger.warning(
            "the CPU kernels are not built here: float32 linear layers run on oneDNN's "
            "packed weights instead of Brigade's panel GEMM (slower at decode batch sizes)"
        )
    usable = panels | tiles | {dtype for dtype in dtypes - panels if onednn_usable(dtype)}
    if dtypes - usable:
        names = ", ".join(sorted(str(dtype).removeprefix("torch.") for dtype in dtypes - usable))
        logger.warning(
            "oneDNN's linear op does not run %s on this CPU and torch build; those GEMMs "
            "stay plain (F.linear)",
            names,
        )
    swapped = 0
    for parent, name, child in targets:
        dtype, pairs = child.weight.dtype, id(child) in paired
        if dtype in panels:
            layer = CpuLinear(child, "panels", gate_up=pairs)
        elif dtype in tiles and child.in_features % 2 == 0:
            layer = CpuLinear(child, "tiles", gate_up=pairs)
        elif dtype in usable and onednn_usable(dtype):
            layer = CpuLinear(child, "dense" if mode == "onednn" else "packed")
        else:
            continue
        setattr(parent, name, layer)
        swapped += 1
    logger.debug("%d linear layers swapped (cpu_linear %s)", swapped, mode)
    return swapped
