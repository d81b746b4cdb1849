"""oneDNN GEMMs for a model's linear layers on a CPU.

``F.linear`` on a CPU calls MKL's sgemm on the weight as loaded. At the row counts of a
batched decode step (a few to a few hundred rows) oneDNN's matmul on a weight copied once
into its own layout is faster at the shapes of small decoders (docs/benchmarks.md); at one or
two rows the plain GEMM is as fast or faster. :func:`pack_linears` swaps every float32
``nn.Linear`` of a model for a :class:`PackedLinear` that picks per call, by row count.

The swap is a module swap (as ``torch.ao`` quantization does): the ``PackedLinear`` shares
the original ``weight`` and ``bias`` parameters, so checkpoint names, ``state_dict`` and
parity with the unpacked model are kept; the packed copy is one more copy of the weights.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PackedLinear", "onednn_usable", "pack_linears"]

logger = logging.getLogger(__name__)


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` that runs inputs of ``min_rows`` rows or more through oneDNN on a
    copy of its weight in oneDNN's layout, and smaller ones through ``F.linear``."""

    def __init__(self, linear: nn.Linear, min_rows: int) -> None:
        nn.Module.__init__(self)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight  # shared: the checkpoint fills this one
        self.bias = linear.bias
        self.min_rows = min_rows
        self.packed: torch.Tensor | None = None
        """The weight in oneDNN's layout, made by :meth:`pack` (after the weights load)."""

    def pack(self) -> None:
        """(Re)make the packed copy from ``weight``; call after the weight changes."""
        self.packed = self.weight.detach().to_mkldnn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features]."""
        rows = x.numel() // self.in_features if self.in_features else 0
        if self.packed is None or rows < self.min_rows:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


def onednn_usable() -> bool:
    """Whether this torch build has oneDNN's linear op (``mkldnn._linear_pointwise``)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.ones(2, 3).to_mkldnn()
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(4, 3), weight, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.equal(out, torch.full((4, 2), 3.0)))


def pack_linears(model: nn.Module, min_rows: int) -> int:
    """Swap every float32 CPU ``nn.Linear`` of ``model`` (loaded) for a packed one.

    Returns the number of layers packed (0 where oneDNN's op is missing: a warning is
    logged and the model is left as it was).
    """
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
        and child.weight.device.type == "cpu"
        and child.weight.dtype == torch.float32
    ]
    if not targets:
        return 0
    if not onednn_usable():
        logger.warning("oneDNN's linear op is not usable in this torch build; GEMMs stay plain")
        return 0
    for parent, name, child in targets:
        packed = PackedLinear(child, min_rows)
        packed.pack()
        setattr(parent, name, packed)
    megabytes = sum(child.weight.numel() for _, _, child in targets) * 4 / 2**20
    logger.info(
        "packed %d linear layers for oneDNN (%.0f MiB more memory; used at >= %d rows)",
        len(targets),
        megabytes,
        min_rows,
    )
    return len(targets)
