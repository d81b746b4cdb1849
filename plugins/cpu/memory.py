"""How a CPU executor's process allocates: large freed buffers kept for the next step; huge
pages for the KV pool.

A prefill step of 2048 tokens allocates activations of tens of megabytes (SmolLM2's MLP
input alone is 50 MB in float32). glibc serves allocations above its mmap threshold (at most
32 MB by default) with fresh ``mmap`` regions and returns them at ``free``, so every step
faults such buffers in again, page by page: in a virtual machine that cost a 2048-token step
of SmolLM2 more than its SiLU (docs/benchmarks.md). :func:`keep_freed_memory` raises the
threshold and the trim threshold, so freed buffers stay in the heap for the next step (what
vLLM's CPU guide gets from tcmalloc). Measured on SmolLM2's mixed workload: 2% faster (paired
runs).

:func:`advise_huge_pages` asks for transparent huge pages on a range before its first touch
(Linux's ``madvise`` mode): the KV pool takes them when it is committed at start
(``[executor] kv_prefault``), where 2 MiB pages spare the decode kernel a TLB miss every 4 KiB
of the scattered pages it reads. Faulted in lazily, during steps, they were 5% slower (the
kernel compacts memory at the faults), hence only at start.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import platform

__all__ = ["advise_huge_pages", "keep_freed_memory"]

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
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
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
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


_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20


def advise_huge_pages(address: int, size: int) -> bool:
    """Ask Linux to back the 2 MiB-aligned part of ``[address, address + size)`` with
    transparent huge pages, before it is first touched; False where that is not done."""
    libc = _libc()
    start = -(-address // _HUGE_PAGE) * _HUGE_PAGE
    end = (address + size) // _HUGE_PAGE * _HUGE_PAGE
    if libc is None or end <= start:
        return False
    return libc.madvise(start, end - start, _MADV_HUGEPAGE) == 0
