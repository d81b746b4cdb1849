"""oneDNN GEMMs for a model's linear layers on a CPU.

``F.linear`` on a CPU in float32 calls MKL's sgemm. oneDNN's matmul
(``torch.ops.mkldnn._linear_pointwise``) on the same weight, as loaded (no copy), is faster at
the shapes of small decoders: 1.2-1.4x over SmolLM2's layers at 1-32 rows on the 2-core AVX2
machine, 2x on its LM head (docs/benchmarks.md). :func:`use_onednn_linears` swaps every float32
``nn.Linear`` of a model for a :class:`OneDnnLinear`, a module swap (as ``torch.ao``
quantization does) that keeps the original ``weight`` and ``bias`` parameters, so checkpoint
names, ``state_dict`` and memory stay as they were.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["OneDnnLinear", "onednn_linear", "onednn_usable", "use_onednn_linears"]

logger = logging.getLogger(__name__)


@functools.cache
def onednn_usable() -> bool:
    """Whether this torch build runs oneDNN's linear op (``mkldnn._linear_pointwise``) on a
    dense float32 weight, with the right result."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        out = torch.ops.mkldnn._linear_pointwise(
            torch.ones(4, 3), torch.ones(2, 3), torch.ones(2), "none", [], ""
        )
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.equal(out, torch.full((4, 2), 4.0)))


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through oneDNN: x [..., in], weight [out, in] float32 on a
    CPU -> [..., out] (callers check :func:`onednn_usable` once)."""
    flat = x.reshape(-1, weight.shape[1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], weight.shape[0])


class OneDnnLinear(nn.Linear):
    """An ``nn.Linear`` that runs inputs of ``min_rows`` rows or more through oneDNN and
    smaller ones through ``F.linear``, on the same parameters."""

    def __init__(self, linear: nn.Linear, min_rows: int) -> None:
        nn.Module.__init__(self)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight  # shared: the checkpoint filled this one
        self.bias = linear.bias
        self.min_rows = min_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features]."""
        if x.numel() < self.min_rows * self.in_features:
            return F.linear(x, self.weight, self.bias)
        return onednn_linear(x, self.weight, self.bias)


def use_onednn_linears(model: nn.Module, min_rows: int) -> int:
    """Swap every float32 CPU ``nn.Linear`` of ``model`` for a :class:`OneDnnLinear`.

    Returns the number of layers swapped (0 where oneDNN's op is missing: a warning is logged
    and the model is left as it was).
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
        setattr(parent, name, OneDnnLinear(child, min_rows))
    logger.debug("%d linear layers run through oneDNN at >= %d rows", len(targets), min_rows)
    return len(targets)
