"""Brigade's C++ kernels for CPUs, built on first use and cached: decode attention over the
paged KV cache (``cpu_paged.cpp``, its per-row kernels in ``cpu_rows.h``; rows sharing a prefix
read it once, ``cpu_cascade.cpp``), prefill attention (``cpu_prefill.cpp``; in bfloat16 on AMX
tiles ``cpu_prefill_tiles.cpp``), a decoder layer's small fused operations
(``cpu_layer_ops.cpp``: RMSNorm with and without the residual add, SiLU-mul, RoPE) and every
layer of a step in one call (``cpu_fused.cpp``), the panel GEMM
(``cpu_gemm.cpp``), the bfloat16 GEMM on AMX tiles (``cpu_tiles.cpp``) and the standard
sampler's draw (``cpu_sample.cpp``), all in ``kernels/`` and all registered in
``torch.ops.brigade_cpu``.

The build (a few seconds to a minute, once per machine and torch version) goes to
``$BRIGADE_CACHE_DIR/extensions/<key>``, where the key covers the source, torch's version and
the CPU's vector extensions (the code is compiled for this CPU: ``-march=native``, or the
target named by ``$BRIGADE_CPU_MARCH``, e.g. ``x86-64-v3`` to run the AVX2 code paths on an
AVX-512 machine). When it cannot be built (no C++ compiler, no ninja) the caller gets None and
a warning is logged once; attention then takes its portable path.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from brigade.cache import cache_root

__all__ = [
    "amx_tiles_usable",
    "cpu_ops",
    "exclusive_build",
    "has_amx",
    "kernels_take_head_dim",
    "paged_decode_kernel",
]

logger = logging.getLogger(__name__)

_KERNELS = Path(__file__).with_name("kernels")
_SOURCES = tuple(sorted(_KERNELS.glob("*.cpp")))
_HEADERS = tuple(sorted(_KERNELS.glob("*.h")))
_CFLAGS = [
    "-O3",
    f"-march={os.environ.get('BRIGADE_CPU_MARCH') or 'native'}",
    "-fopenmp",
    "-fno-trapping-math",
    "-fno-math-errno",
]
"""As torch's own build: without the last two, GCC keeps the float clamps and exp of the
kernels' loops scalar. The target is part of the cache key."""
_LOCK = threading.Lock()


def _cache_dir() -> Path:
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            flags = next((line for line in info if line.startswith("flags")), "")
    except OSError:
        pass
    sources = b"".join(source.read_bytes() for source in (*_SOURCES, *_HEADERS))
    build = " ".join([torch.__version__, *_CFLAGS, flags]).encode()
    key = hashlib.sha256(sources + build).hexdigest()[:16]
    return cache_root() / "extensions" / f"cpu_paged-{key}"


@contextlib.contextmanager
def exclusive_build(directory: Path) -> Iterator[None]:
    """Hold the build directory against other processes for one build.

    torch's ``load`` guards a build with a ``lock`` file that only the builder deletes: a
    build killed midway (Ctrl-C during a first start) leaves it behind, and every later
    ``load`` of that directory waits for it forever, silently. Brigade's builds take an OS
    lock first, which dies with its process; whoever holds it is the only one building, so
    a ``lock`` file found then is stale and removed.
    """
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "brigade-build.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build() -> Any:
    from torch.utils.cpp_extension import load

    directory = _cache_dir()
    started = time.perf_counter()
    with exclusive_build(directory):
        load(
            name="brigade_cpu_paged",
            sources=[str(source) for source in _SOURCES],
            build_directory=str(directory),
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,  # registers torch.ops.brigade_cpu
            verbose=False,
        )
    elapsed = time.perf_counter() - started
    if elapsed > 2:
        logger.info("built the CPU kernels in %.1f s (cached in %s)", elapsed, directory)
    return torch.ops.brigade_cpu


@functools.cache
def cpu_ops() -> Any:
    """The ``torch.ops.brigade_cpu`` namespace, or None when the kernels cannot be built here
    (the reason is logged once; callers take their portable paths)."""
    with _LOCK:
        try:
            return _build()
        except Exception as error:  # a compiler, ninja or linker failure: stay portable
            lines = str(error).strip().splitlines()
            logger.warning(
                "the CPU kernels could not be built (%s); decode attention gathers pages for "
                "SDPA and a layer's small operations run unfused instead (slower)",
                lines[-1] if lines else repr(error),
            )
            return None


def has_amx() -> bool:
    """Whether the CPU has AMX tiles (Intel Xeons from Sapphire Rapids on), per torch."""
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return bool(check()) if check is not None else False
    except Exception:  # a private torch helper: never let it stop a model from loading
        return False


def amx_tiles_usable() -> bool:
    """Whether the AMX tile kernels (``cpu_tiles.cpp``, ``cpu_prefill_tiles.cpp``) run here: the
    CPU has AMX tiles, the kernels are built and torch packs bfloat16 for oneDNN's AMX
    micro-kernel."""
    if not has_amx():
        return False
    ops = cpu_ops()
    return ops is not None and bool(ops.tiles_usable())


def kernels_take_head_dim(head_dim: int, lanes: int) -> bool:
    """Whether the vector attention kernels take ``head_dim`` on a CPU with ``lanes`` floats
    per vector (``ops.vector_lanes()``): 1-8 whole vectors, or 128 (as ``cpu_vec.h`` says)."""
    return head_dim == 128 or (head_dim % lanes == 0 and head_dim <= 8 * lanes)


def paged_decode_kernel() -> Callable[..., torch.Tensor] | None:
    """``paged_decode(query, key_cache, value_cache, block_tables, seq_lens, window, scale,
    cascade=True)``, or None when the kernels cannot be built here."""
    ops = cpu_ops()
    return None if ops is None else ops.paged_decode
