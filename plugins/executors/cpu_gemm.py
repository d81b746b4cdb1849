"""oneDNN GEMMs for a model's linear layers on a CPU, on weights prepacked at load.

``F.linear`` on a CPU in float32 calls MKL's sgemm. oneDNN's matmul
(``torch.ops.mkldnn._linear_pointwise``) is faster at the shapes of small decoders, and faster
again on a weight reordered once into the blocked layout its kernels read for this CPU
(``torch.ops.mkldnn._reorder_linear_weight``), which otherwise it reorders at every call: over
SmolLM2's 30 layers and LM head at 32 rows, 29.2 ms packed against 37.4 ms on the dense weight
in float32 and 16.1 against 21.6 ms in bfloat16 (AVX-512 with BF16; docs/benchmarks.md).

:func:`use_cpu_linears` swaps every ``nn.Linear`` of a model for a :class:`CpuLinear`, a
module swap (as ``torch.ao`` quantization does). In ``packed`` mode the packed copy replaces
the dense weight (as vLLM-CPU does), so memory stays as it was; ``onednn`` keeps the weight
as loaded.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

__all__ = [
    "CPU_LINEAR_MODES",
    "CpuLinear",
    "onednn_linear",
    "onednn_usable",
    "pack_weight",
    "use_cpu_linears",
]

logger = logging.getLogger(__name__)

CPU_LINEAR_MODES = ("packed", "onednn", "plain")
"""``[executor] cpu_linear``: oneDNN on prepacked weights, oneDNN on the weights as loaded,
or ``F.linear``."""
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


class CpuLinear(nn.Module):
    """A linear layer through oneDNN on its own (``packed``) or the loaded weight."""

    def __init__(self, linear: nn.Linear, packed: bool) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.bias = linear.bias
        self.packed: torch.Tensor | None = pack_weight(linear.weight) if packed else None
        """The weight in oneDNN's layout (the dense one is dropped), or None."""
        self.weight = None if packed else linear.weight  # shared: the checkpoint filled it

    @property
    def gemm_weight(self) -> torch.Tensor:
        """What oneDNN reads: the packed weight, or the dense one."""
        weight = self.packed if self.packed is not None else self.weight
        assert weight is not None  # one of the two is always set
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features]."""
        return onednn_linear(x, self.gemm_weight, self.bias)

    def extra_repr(self) -> str:
        layout = "packed" if self.packed is not None else "dense"
        return f"in_features={self.in_features}, out_features={self.out_features}, {layout}"


def use_cpu_linears(model: nn.Module, mode: str) -> int:
    """Swap every CPU ``nn.Linear`` of ``model`` in a dtype oneDNN runs here for a
    :class:`CpuLinear` (``mode`` ``packed`` or ``onednn``; ``plain`` changes nothing).

    Returns the number of layers swapped (0 where oneDNN's op is missing: a warning is logged
    and the model is left as it was).
    """
    if mode not in CPU_LINEAR_MODES:
        raise ValueError(f"cpu_linear {mode!r} is not allowed; allowed: {CPU_LINEAR_MODES}")
    if mode == "plain":
        return 0
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.device.type == "cpu"
    ]
    dtypes = {child.weight.dtype for _, _, child in targets}
    usable = {dtype for dtype in dtypes if onednn_usable(dtype)}
    if dtypes - usable:
        names = ", ".join(sorted(str(dtype).removeprefix("torch.") for dtype in dtypes - usable))
        logger.warning(
            "oneDNN's linear op does not run %s on this CPU and torch build; those GEMMs "
            "stay plain (F.linear)",
            names,
        )
    swapped = 0
    for parent, name, child in targets:
        if child.weight.dtype in usable:
            setattr(parent, name, CpuLinear(child, packed=mode == "packed"))
            swapped += 1
    logger.debug("%d linear layers run through oneDNN (%s)", swapped, mode)
    return swapped
