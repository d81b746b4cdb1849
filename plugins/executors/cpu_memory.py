"""How a CPU executor's process allocates: large buffers kept for reuse, the KV pool on huge pages.

A prefill step of 2048 tokens allocates activations of tens of megabytes (SmolLM2's MLP
input alone is 50 MB in float32). glibc serves allocations above its mmap threshold (at most
32 MB by default) with fresh ``mmap`` regions and returns them at ``free``, so every step
faults such buffers in again, page by page: in a virtual machine that cost a 2048-token step
of SmolLM2 more than its SiLU (docs/benchmarks.md). :func:`keep_freed_memory` raises the
threshold and the trim threshold, so freed buffers stay in the heap for the next step (what
vLLM's CPU guide gets from tcmalloc).

The KV pool is zeroed page by page as steps first write it; :func:`advise_huge_pages` asks the
kernel for transparent huge pages there, so each first touch faults in 2 MB rather than 4 KB.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import platform

import torch

__all__ = ["advise_huge_pages", "keep_freed_memory"]

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20
_KEEP_BYTES = 1 << 30
"""Allocations up to this size come from the heap, and up to this much free memory at its top
is kept there."""


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc


@functools.cache
def keep_freed_memory() -> bool:
    """Serve large allocations from glibc's heap and keep freed memory there (once per
    process); False where the C library is not glibc or refuses the settings."""
    libc = _libc()
    if libc is None:
        return False
    done = bool(libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES)
    )
    if not done:
        logger.debug("glibc refused the heap thresholds; large buffers stay mmap'd")
    return done


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask for transparent huge pages under ``tensor``'s memory (the 2 MB-aligned part of it);
    False where the kernel or C library cannot (nothing changes then)."""
    libc = _libc()
    if libc is None or tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    aligned = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    length = (end - aligned) // _HUGE_PAGE * _HUGE_PAGE
    if length <= 0:
        return False
    return libc.madvise(aligned, length, _MADV_HUGEPAGE) == 0
