"""Brigade's C++ kernels for CPUs, built on first use and cached: decode attention over the
paged KV cache (``cpu_paged.cpp``, its per-row kernels in ``cpu_rows.h``; rows sharing a prefix
read it once, ``cpu_cascade.cpp``), prefill attention (``cpu_prefill.cpp``; in bfloat16 on AMX
tiles ``cpu_prefill_tiles.cpp``), a decoder layer's small fused operations
(``cpu_layer_ops.cpp``: RMSNorm with and without the residual add, SiLU-mul, RoPE) and every
layer of a step in one call (``cpu_fused.cpp``), the panel GEMM
(``cpu_gemm.cpp``), the bfloat16 GEMM on AMX tiles (``cpu_tiles.cpp``) and the standard
sampler's draw (``cpu_sample.cpp``), all in ``kernels/`` and all registered in
``torch.ops.brigade_cpu``.

The build (a minute or more on two cores, once per machine, checkout and torch install;
``brigade kernels build`` does it ahead of the first start) goes to
``$BRIGADE_CACHE_DIR/extensions/cpu_paged-<key>``. The key covers the sources, torch's version,
the compiler flags, the CPU's vector extensions and every path written into the build file (this
checkout's ``kernels/``, torch's and Python's headers): torch's ``load`` compiles whatever its
``build.ninja`` names, so two checkouts sharing one directory would each rewrite it with their
own paths and rebuild everything after the other ran. The code is compiled for this CPU
(``-march=native``) or for the target named by ``$BRIGADE_CPU_MARCH``, e.g. ``x86-64-v3`` to run
the AVX2 code paths on an AVX-512 machine. When the kernels cannot be built (no C++ compiler, no
ninja) the caller gets None and one warning says what to install; attention then takes its
portable path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from brigade.cache import cache_root

__all__ = [
    "KernelBuildError",
    "KernelCache",
    "amx_tiles_usable",
    "build_kernels",
    "cpu_ops",
    "exclusive_build",
    "has_amx",
    "kernel_cache",
    "kernels_take_head_dim",
    "paged_decode_kernel",
]

logger = logging.getLogger(__name__)

_NAME = "brigade_cpu_paged"
_KERNELS = Path(__file__).resolve().with_name("kernels")
_SOURCES = tuple(sorted(_KERNELS.glob("*.cpp")))
_HEADERS = tuple(sorted(_KERNELS.glob("*.h")))
_MARCH = os.environ.get("BRIGADE_CPU_MARCH") or "native"
_CFLAGS = [
    "-O3",
    f"-march={_MARCH}",
    "-fopenmp",
    "-fno-trapping-math",
    "-fno-math-errno",
]
"""As torch's own build: without the last two, GCC keeps the float clamps and exp of the
kernels' loops scalar. The target is part of the cache key."""
_INSTALL_HINT = (
    "install a C++ compiler (g++, or clang++ with libomp) and ninja (pip install ninja), then "
    "run `brigade kernels build`"
)
_LOCK = threading.Lock()


class KernelBuildError(RuntimeError):
    """The CPU kernels cannot be built here; the message says why and what to install."""


@dataclasses.dataclass(frozen=True)
class KernelCache:
    """Where this host's build of the CPU kernels lives and what it targets."""

    directory: Path
    """``$BRIGADE_CACHE_DIR/extensions/cpu_paged-<key>``, this checkout's and CPU's own."""
    march: str
    """The compiler's ``-march``: ``native`` unless ``$BRIGADE_CPU_MARCH`` names one."""

    @property
    def library(self) -> Path:
        """The shared library the build links."""
        return self.directory / f"{_NAME}.so"

    @property
    def built(self) -> bool:
        """Whether the library is there, so loading the kernels compiles nothing."""
        return self.library.is_file()


def kernel_cache() -> KernelCache:
    """This host's kernel directory (built or not); reads the sources, builds nothing."""
    from torch.utils.cpp_extension import include_paths

    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            flags = next((line for line in info if line.startswith("flags")), "")
    except OSError:
        pass
    sources = b"".join(source.read_bytes() for source in (*_SOURCES, *_HEADERS))
    # Every path torch writes into build.ninja: another checkout or torch install gets its own
    # directory instead of rewriting this one's build file (which rebuilds it all).
    paths = [
        *map(str, _SOURCES),
        *include_paths("cpu"),
        sysconfig.get_path("include", "posix_prefix") or "",
    ]
    build = "\n".join([torch.__version__, *_CFLAGS, flags, *paths]).encode()
    key = hashlib.sha256(sources + build).hexdigest()[:16]
    return KernelCache(cache_root() / "extensions" / f"cpu_paged-{key}", _MARCH)


@contextlib.contextmanager
def exclusive_build(directory: Path) -> Iterator[None]:
    """Hold the build directory against other processes for one build.

    torch's ``load`` guards a build with a ``lock`` file that only the builder deletes: a
    build killed midway (Ctrl-C during a first start) leaves it behind, and every later
    ``load`` of that directory waits for it forever, silently. Brigade's builds take an OS
    lock first, which dies with its process; whoever holds it is the only one building, so
    a ``lock`` file found then is stale and removed. A process that has to wait for another's
    build says so once.
    """
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "brigade-build.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning(
                "waiting for another process to finish building the CPU kernels in %s", directory
            )
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _missing_tools() -> list[str]:
    """What torch's ``load`` needs and this host lacks: the C++ compiler (``$CXX``, else
    ``c++``) and ninja, both looked up on ``PATH`` as ``load`` does."""
    from torch.utils.cpp_extension import get_cxx_compiler, is_ninja_available

    missing = []
    if shutil.which(get_cxx_compiler()) is None:
        missing.append(f"no C++ compiler: `{get_cxx_compiler()}` not found")
    if not is_ninja_available():
        missing.append("no ninja")
    return missing


def _build() -> Any:
    from torch.utils.cpp_extension import load

    cache = kernel_cache()
    # Checked before torch's load, which would log its own warnings and then fail in ninja.
    missing = [] if cache.built else _missing_tools()
    if missing:
        raise KernelBuildError(", ".join(missing))
    with exclusive_build(cache.directory):
        if not cache.built:
            logger.warning(
                "building the CPU kernels for this host in %s (once; a minute or more; "
                "`brigade kernels build` does it ahead of the first start)",
                cache.directory,
            )
        load(
            name=_NAME,
            sources=[str(source) for source in _SOURCES],
            build_directory=str(cache.directory),
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,  # registers torch.ops.brigade_cpu
            verbose=False,
        )
    return torch.ops.brigade_cpu


def _failure(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    reason = lines[-1] if lines else repr(error)
    # With the tools there, the compiler's own output says what failed.
    fix = (
        _INSTALL_HINT if _missing_tools() else "`brigade kernels build` shows the compiler's output"
    )
    return f"the CPU kernels could not be built ({reason}); {fix}"


def build_kernels() -> float:
    """Build this host's CPU kernels (or load them, already built); the seconds it took.

    Raises :class:`KernelBuildError` saying what failed and what to install."""
    started = time.perf_counter()
    with _LOCK:
        try:
            _build()
        except Exception as error:  # no tools, or a compiler, ninja or linker failure
            output = "" if isinstance(error, KernelBuildError) else f"\n{str(error).strip()}"
            raise KernelBuildError(_failure(error) + output) from error
    return time.perf_counter() - started


@functools.cache
def cpu_ops() -> Any:
    """The ``torch.ops.brigade_cpu`` namespace, or None when the kernels cannot be built here
    (one warning says why and what to install; callers take their portable paths)."""
    with _LOCK:
        try:
            return _build()
        except Exception as error:  # a compiler, ninja or linker failure: stay portable
            logger.warning(
                "%s; decode attention gathers pages for SDPA and a layer's small operations "
                "run unfused instead (slower)",
                _failure(error),
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
