"""Whether Brigade's Triton kernels run unasked on a CUDA GPU: the one rule for the decoder's
fused small operations (``layer_ops``), the ``triton`` attention backend and the machine's
default plugins."""

from __future__ import annotations

import functools
import importlib.util

import torch

__all__ = ["MIN_TRITON_CAPABILITY", "triton_runs_on"]

MIN_TRITON_CAPABILITY = (8, 0)
"""The oldest GPUs given Brigade's Triton kernels unasked (attention by default, the decoder's
fused small operations): Ampere. The kernels ran on an H200 (9.0); bf16 in Triton needs 8.0.
Older GPUs keep sdpa and torch's operations unless a config names ``triton``."""


@functools.cache
def triton_runs_on(index: int | None) -> bool:
    """Whether Brigade's Triton kernels are used unasked on CUDA device ``index`` (None: the
    current one): Triton imports and the GPU is at least ``MIN_TRITON_CAPABILITY``."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        return torch.cuda.get_device_capability(index) >= MIN_TRITON_CAPABILITY
    except (AssertionError, RuntimeError):  # no usable CUDA after all
        return False
