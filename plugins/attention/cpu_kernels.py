"""Brigade's C++ attention kernel for CPUs (``cpu_paged.cpp``), built on first use and cached.

The build (a few seconds to a minute, once per machine and torch version) goes to
``$BRIGADE_CACHE_DIR/extensions/<key>``, where the key covers the source, torch's version and
the CPU's vector extensions (the code is compiled for this CPU: ``-march=native``). When it
cannot be built (no C++ compiler, no ninja) the caller gets None and a warning is logged once;
attention then takes its portable path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from brigade.cache import cache_root

__all__ = ["paged_decode_kernel"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_paged.cpp")
_LOCK = threading.Lock()


def _cache_dir() -> Path:
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            flags = next((line for line in info if line.startswith("flags")), "")
    except OSError:
        pass
    key = hashlib.sha256(
        _SOURCE.read_bytes() + torch.__version__.encode() + flags.encode()
    ).hexdigest()[:16]
    return cache_root() / "extensions" / f"cpu_paged-{key}"


def _build() -> Callable[..., torch.Tensor]:
    from torch.utils.cpp_extension import load

    directory = _cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    load(
        name="brigade_cpu_paged",
        sources=[str(_SOURCE)],
        build_directory=str(directory),
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,  # registers torch.ops.brigade_cpu
        verbose=False,
    )
    elapsed = time.perf_counter() - started
    if elapsed > 2:
        logger.info("built the CPU attention kernel in %.1f s (cached in %s)", elapsed, directory)
    return torch.ops.brigade_cpu.paged_decode


@functools.cache
def paged_decode_kernel() -> Callable[..., torch.Tensor] | None:
    """``paged_decode(query, key_cache, value_cache, block_tables, seq_lens, window, scale)``,
    or None when the kernel cannot be built here (the reason is logged once)."""
    with _LOCK:
        try:
            kernel = _build()
        except Exception as error:  # a compiler, ninja or linker failure: stay portable
            lines = str(error).strip().splitlines()
            logger.warning(
                "the CPU attention kernel could not be built (%s); decode attention gathers "
                "pages for SDPA instead (slower)",
                lines[-1] if lines else repr(error),
            )
            return None
    return kernel
