"""The ``cpu`` attention backend: the reference ``sdpa`` backend with Brigade's C++ kernels.

Decode rows go through the C++ decode kernel (``native_decode``, the default): it reads each
row's pages in place up to that row's own length, where the gather copies every row's pages up
to the longest row's; rows whose block tables start with the same pages score those keys
together, once per step (``cascade_decode``). Prefill chunks go through the C++ prefill kernel
(``native_prefill``): every chunk of the step in one call, causal over the pages in place, no
gathered keys and no mask tensors; in bfloat16 on a CPU with AMX its tile version
(``cpu_prefill_tiles.cpp``: both products of flash attention on AMX tiles). The build is cached
(``brigade.plugins.cpu.build``); where it cannot be built, off a CPU, or where the head size
does not fit the kernels' vectors, attention takes the ``sdpa`` paths it inherits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from brigade.interfaces import AttentionLayer, NoOptions, option
from brigade.plugins.attention import SdpaBackend, SdpaMetadata
from brigade.plugins.cpu.build import (
    amx_tiles_usable,
    cpu_ops,
    kernels_take_head_dim,
    paged_decode_kernel,
)

__all__ = ["CpuAttentionBackend", "CpuAttentionOptions", "PrefillKernel"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class CpuAttentionOptions:
    """Options of the ``cpu`` attention backend."""

    native_decode: bool = option(
        True,
        help="on a CPU, decode rows read the paged KV in place with Brigade's C++ kernel "
        "(built once and cached) instead of gathering pages for SDPA",
    )
    cascade_decode: bool = option(
        True,
        help="with native_decode, decode rows whose block tables start with the same pages "
        "(a prompt prefix held once by the prefix cache, at least 64 tokens) score those keys "
        "together, reading them once per step instead of once per row (cascade attention)",
    )
    native_prefill: bool = option(
        True,
        help="on a CPU, prefill chunks attend causally over the paged KV in place with "
        "Brigade's C++ kernel instead of SDPA on gathered keys and masks (float32 or "
        "bfloat16, head sizes a multiple of the CPU's vector width; bfloat16 on a CPU with AMX "
        "takes a version whose products run on AMX tiles)",
    )


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillKernel:
    """The C++ prefill kernel that takes a layer's chunks."""

    run: Callable[..., torch.Tensor]
    """``(query, key_cache, value_cache, block_tables, chunks, window, scale)`` -> the chunks'
    attention [tokens of the chunks, heads, head_dim]."""
    tiles: bool
    """Whether it is the bfloat16 version on AMX tiles."""


class CpuAttentionBackend(SdpaBackend):
    """Paged attention with Brigade's C++ decode and prefill kernels on a CPU; the ``sdpa``
    backend's torch paths elsewhere (other devices and dtypes, the kernels unavailable)."""

    name: ClassVar[str] = "cpu"
    supports_sliding_window: ClassVar[bool] = True

    def __init__(self, options: CpuAttentionOptions | NoOptions | None = None) -> None:
        super().__init__()
        # NoOptions (tests, other backends' fallbacks) means the defaults.
        chosen = options if isinstance(options, CpuAttentionOptions) else CpuAttentionOptions()
        self.options = chosen
        self._native_decode = chosen.native_decode
        self._native_prefill = chosen.native_prefill
        self.cascade = chosen.cascade_decode
        """Whether decode rows sharing their first pages read them once (the C++ kernel)."""
        self._decode: Any = None
        """The C++ decode kernel once resolved (False: unavailable here)."""
        self._prefill: Any = None
        """(the C++ prefill kernel, the CPU's vector lanes) once resolved (False: unavailable)."""
        self._prefill_tiles: Any = None
        """The bfloat16 prefill kernel on AMX tiles where it runs, else None (learned with the
        prefill kernel)."""

    def decode_kernel(self, device: torch.device) -> Callable[..., torch.Tensor] | None:
        """``paged_decode`` when decode rows on ``device`` take the C++ kernel, else None."""
        if device.type != "cpu" or not self._native_decode:
            return None
        if self._decode is None:
            self._decode = paged_decode_kernel() or False
        return self._decode or None

    def prefill_kernel(
        self, query: torch.Tensor, key_cache: torch.Tensor, layer: AttentionLayer
    ) -> PrefillKernel | None:
        """The C++ prefill kernel when it takes this layer's tensors here, else None."""
        if query.device.type != "cpu" or not self._native_prefill:
            return None
        if {query.dtype, key_cache.dtype} - set(_KERNEL_DTYPES):
            return None
        if self._prefill is None:
            ops = cpu_ops()
            self._prefill = (ops.paged_prefill, int(ops.vector_lanes())) if ops else False
            self._prefill_tiles = ops.paged_prefill_tiles if amx_tiles_usable() else None
        if not self._prefill:
            return None
        kernel, lanes = self._prefill
        if not kernels_take_head_dim(layer.head_dim, lanes):
            return None
        # bfloat16 on a CPU with AMX: the products on AMX tiles, faster there than torch's flash
        # attention and the vector kernel (measured in docs/benchmarks.md).
        if self._prefill_tiles is not None and query.dtype == key_cache.dtype == torch.bfloat16:
            return PrefillKernel(self._prefill_tiles, tiles=True)
        return PrefillKernel(kernel, tiles=False)

    def _attend_decodes(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: SdpaMetadata,
        output: torch.Tensor,
    ) -> None:
        kernel = self.decode_kernel(query.device)
        if kernel is None:
            super()._attend_decodes(layer, query, kv_cache, meta, output)
            return
        decodes = meta.num_decodes
        native = query.dtype in _KERNEL_DTYPES
        output[:decodes] = kernel(
            # [D, heads, head_dim], float32 or bfloat16 as the kernel reads them
            (query[:decodes] if native else query[:decodes].float()).contiguous(),
            kv_cache[0],
            kv_cache[1],
            meta.block_tables[:decodes],
            meta.seq_lens[:decodes],
            layer.sliding_window or 0,
            layer.scale,
            self.cascade,
        )

    def _attend_prefills(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: SdpaMetadata,
        output: torch.Tensor,
    ) -> None:
        kernel = self.prefill_kernel(query, kv_cache[0], layer)
        if kernel is None or meta.prefill_chunks is None:
            super()._attend_prefills(layer, query, key, value, kv_cache, meta, output)
            return
        start = meta.prefill_rows[0][1]
        output[start:] = kernel.run(
            query.contiguous(),  # [T, heads, head_dim]: the chunks' tokens are read
            kv_cache[0],
            kv_cache[1],
            meta.block_tables,
            meta.prefill_chunks,
            layer.sliding_window or 0,
            layer.scale,
        )  # [tokens of the chunks, heads, head_dim]
