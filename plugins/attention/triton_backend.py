"""The ``triton`` attention backend: paged decode (split-K), prefill/extend and KV-write kernels.

Per layer, :meth:`TritonBackend.forward` launches (kernels in ``triton_kernels``):

1. KV write: one program per new token copies its K and V to ``slot_mapping``.
2. Decode, for the leading ``num_decodes`` rows: flash-decoding. Program (row, KV head,
   split) takes the query heads that share the KV head (grouped-query attention reads each
   K/V tile once for the whole group) over one contiguous range of the context and stores a
   normalised partial output with its log-sum-exp; a reduction program per (row, head) merges
   the splits. With one split the first kernel writes the output directly.
3. Prefill/extend, for the remaining rows: program (chunk, KV head, query block) runs online
   softmax over the chunk's keys, cached and new alike (the write happened first), with a
   causal and sliding-window mask. Tile rows are (token, query head) pairs of the KV head's
   group, so short chunks fill the tile too.

Keys are looked up in the block table one position at a time, so a tile may span pages and
every page size >= 1 works. The kernels are imported on first use, not with this module,
because Triton decides between compiled and interpreted kernels when it defines them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from types import ModuleType
from typing import Any, ClassVar

import torch

from brigade.interfaces import AttentionBackend, AttentionLayer, ModelInput, PageSizeRule, option

__all__ = ["TritonAttentionOptions", "TritonBackend", "TritonMetadata", "triton_interpreting"]

_KERNELS_MODULE = "brigade.plugins.attention.triton_kernels"
_TILE_SIZES = (16, 32, 64, 128)
_MAX_AUTO_SPLITS = 32
_MIN_TILES_PER_SPLIT = 4
"""A split of fewer tiles costs more in launch and reduction than it gains in parallelism."""
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class TritonAttentionOptions:
    """Options of the ``triton`` attention backend (tile sizes are compile-time constants)."""

    num_kv_splits: int = option(
        0,
        help="decode context splits (split-K); 0 = chosen per step from the batch size, the "
        "longest context and the GPU's multiprocessor count",
        ge=0,
        le=256,
    )
    decode_block_n: int = option(64, help="keys per decode tile", choices=_TILE_SIZES)
    prefill_block_m: int = option(
        64,
        help="rows per prefill tile: (token, query head) pairs of one KV head's group",
        choices=_TILE_SIZES,
    )
    prefill_block_n: int = option(64, help="keys per prefill tile", choices=_TILE_SIZES)
    prefill_num_warps: int = option(
        0, help="warps per prefill program; 0 = Triton's default (4)", choices=(0, 1, 2, 4, 8, 16)
    )
    prefill_num_stages: int = option(
        0,
        help="software-pipelining stages of the prefill's K/V loads; 0 = Triton's default",
        ge=0,
        le=6,
    )


def triton_interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's CPU interpreter (as Triton parses it)."""
    value = os.environ.get("TRITON_INTERPRET", "").strip().lower()
    return value in {"1", "true", "on", "yes", "y"}


@functools.cache
def _kernels() -> ModuleType:
    from brigade.plugins.attention import triton_kernels

    return triton_kernels


@functools.cache
def _num_multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one at a time: splits only cost time
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _pow2(n: int) -> int:
    """The smallest power of two >= n (tile sizes must be powers of two)."""
    return 1 << max(n - 1, 0).bit_length()


@dataclasses.dataclass(slots=True)
class TritonMetadata:
    """One step's device tensors and host maxima, built once and shared by every layer."""

    num_decodes: int
    num_prefills: int
    max_decode_len: int
    max_prefill_query_len: int
    query_start_loc: torch.Tensor
    """[B + 1] int32 token offsets of the rows."""
    seq_lens: torch.Tensor
    """[B] int32 context length of each row after this step."""
    block_tables: torch.Tensor
    """[B, P] int32 page ids."""
    slot_mapping: torch.Tensor
    """[T] int64 where each new token's K/V is written."""
    num_multiprocessors: int
    forced_kv_splits: int
    decode_block_n: int
    _kv_splits: dict[tuple[int, int | None], int] = dataclasses.field(default_factory=dict)

    def kv_splits(self, num_kv_heads: int, window: int | None) -> int:
        """Decode splits for layers of this shape; derived from host values once per step."""
        key = (num_kv_heads, window)
        splits = self._kv_splits.get(key)
        if splits is None:
            splits = self.forced_kv_splits or self._auto_kv_splits(num_kv_heads, window)
            self._kv_splits[key] = splits
        return splits

    def _auto_kv_splits(self, num_kv_heads: int, window: int | None) -> int:
        # Enough programs to fill every multiprocessor about twice, but no split shorter than
        # a few tiles: large batches get one split, a lone long request up to 32.
        attended = self.max_decode_len if window is None else min(window, self.max_decode_len)
        wanted = -(-2 * self.num_multiprocessors // (self.num_decodes * num_kv_heads))
        by_length = -(-attended // (_MIN_TILES_PER_SPLIT * self.decode_block_n))
        return max(1, min(wanted, by_length, _MAX_AUTO_SPLITS))


class TritonBackend(AttentionBackend):
    """Paged attention in Triton kernels: CUDA GPUs, or Triton's CPU interpreter for tests."""

    name: ClassVar[str] = "triton"
    supports_sliding_window: ClassVar[bool] = True
    supports_cuda_graphs: ClassVar[bool] = True
    """Pure decode steps only: the decode grid is (rows, KV heads, splits), and the split
    count, chosen from the capture batch's host maxima, stays valid for any shorter context
    (each split's range is derived from the device-side length; empty splits weigh zero)."""

    def __init__(self, options: TritonAttentionOptions | None = None) -> None:
        self.options = options if options is not None else TritonAttentionOptions()
        warps, stages = self.options.prefill_num_warps, self.options.prefill_num_stages
        launch = {"num_warps": warps, "num_stages": stages}
        self._prefill_launch = {name: value for name, value in launch.items() if value}
        """The prefill's launch settings that override Triton's defaults (0 = the default)."""

    @classmethod
    def supported_page_sizes(cls, options: Any) -> PageSizeRule:
        """Any page size: the kernels find every key's page through the block table."""
        return PageSizeRule()

    @classmethod
    def check_device(cls, device: str) -> None:
        """Triton must import; the device must be CUDA, or the interpreter switched on."""
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            raise RuntimeError(
                f"the triton backend needs the 'triton' package, which failed to import: {exc}"
            ) from exc
        if device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise RuntimeError(f"the triton backend was given {device!r}, but no CUDA GPU")
            return
        if not triton_interpreting():
            raise RuntimeError(
                "the triton backend needs a CUDA GPU (or TRITON_INTERPRET=1 for testing); "
                f"device is {device!r}"
            )
        loaded = sys.modules.get(_KERNELS_MODULE)
        if loaded is not None and type(loaded.write_kv_kernel).__name__ != "InterpretedFunction":
            raise RuntimeError(
                "TRITON_INTERPRET=1 was set after the triton kernels were defined for a GPU; "
                f"set it before {_KERNELS_MODULE} is imported"
            )

    def build_metadata(self, batch: ModelInput) -> TritonMetadata:
        """Host maxima from the ``*_cpu`` copies; no device sync."""
        num_decodes = batch.num_decodes
        num_prefills = batch.num_reqs - num_decodes
        query_lens = batch.query_start_loc_cpu[1:] - batch.query_start_loc_cpu[:-1]  # [B]
        return TritonMetadata(
            num_decodes=num_decodes,
            num_prefills=num_prefills,
            max_decode_len=int(batch.seq_lens_cpu[:num_decodes].max()) if num_decodes else 0,
            max_prefill_query_len=int(query_lens[num_decodes:].max()) if num_prefills else 0,
            query_start_loc=batch.query_start_loc.to(torch.int32),
            seq_lens=batch.seq_lens.to(torch.int32),
            block_tables=batch.block_tables.to(torch.int32),
            slot_mapping=batch.slot_mapping.to(torch.int64),
            num_multiprocessors=_num_multiprocessors(batch.seq_lens.device),
            forced_kv_splits=self.options.num_kv_splits,
            decode_block_n=self.options.decode_block_n,
        )

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: Any,
    ) -> torch.Tensor:
        """Write the new K/V at ``slot_mapping``, then attend (see the contract)."""
        meta: TritonMetadata = metadata
        key_cache, value_cache = kv_cache
        _check_inputs(layer, query, key_cache, value_cache)
        query, key, value = (
            t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value)
        )
        output = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
        if query.shape[0] == 0:
            return output
        kernels = _kernels()
        head_dim, page_size, block_d = layer.head_dim, key_cache.shape[1], _pow2(layer.head_dim)
        cache_strides = key_cache.stride()[:3]  # page, slot, head
        kernels.write_kv_kernel[(key.shape[0],)](
            key, value, key_cache, value_cache, meta.slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1), *cache_strides,
            NUM_KV_HEADS=layer.num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
            BLOCK_KVH=_pow2(layer.num_kv_heads), BLOCK_D=block_d,
        )  # fmt: skip
        group = layer.num_heads // layer.num_kv_heads
        window = layer.sliding_window or 0
        if meta.num_decodes:
            self._decode(layer, query, kv_cache, output, meta, window)
        if meta.num_prefills:
            block_m = max(self.options.prefill_block_m, _pow2(group))
            block_q = block_m // group  # tokens per tile
            grid = (
                meta.num_prefills,
                layer.num_kv_heads,
                -(-meta.max_prefill_query_len // block_q),
            )
            kernels.prefill_kernel[grid](
                query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                meta.query_start_loc, output, layer.scale, window, meta.num_decodes,
                query.stride(0), query.stride(1), *cache_strides, meta.block_tables.stride(0),
                output.stride(0), output.stride(1),
                GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_M=block_m,
                BLOCK_Q=block_q, BLOCK_N=self.options.prefill_block_n, BLOCK_D=block_d,
                **self._prefill_launch,
            )  # fmt: skip
        return output

    def _decode(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        output: torch.Tensor,
        meta: TritonMetadata,
        window: int,
    ) -> None:
        """Flash-decoding of the leading ``num_decodes`` rows into ``output``."""
        kernels = _kernels()
        num_decodes, num_heads, head_dim = meta.num_decodes, layer.num_heads, layer.head_dim
        group = num_heads // layer.num_kv_heads
        splits = meta.kv_splits(layer.num_kv_heads, layer.sliding_window)
        if splits == 1:
            # The one split's normalised output is the answer: write it in place.
            partial_out = output[:num_decodes].unsqueeze(2)  # [num_decodes, heads, 1, hd]
        else:
            partial_out = query.new_empty(
                (num_decodes, num_heads, splits, head_dim), dtype=torch.float32
            )
        partial_lse = query.new_empty((num_decodes, num_heads, splits), dtype=torch.float32)
        kernels.decode_split_kernel[(num_decodes, layer.num_kv_heads, splits)](
            query, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens,
            partial_out, partial_lse, layer.scale, window, splits,
            query.stride(0), query.stride(1), *kv_cache[0].stride()[:3],
            meta.block_tables.stride(0), *partial_out.stride()[:3], *partial_lse.stride()[:2],
            GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=kv_cache[0].shape[1],
            BLOCK_H=max(16, _pow2(group)), BLOCK_N=self.options.decode_block_n,
            BLOCK_D=_pow2(head_dim),
        )  # fmt: skip
        if splits > 1:
            kernels.decode_reduce_kernel[(num_decodes, num_heads)](
                partial_out, partial_lse, output, splits,
                *partial_out.stride()[:3], *partial_lse.stride()[:2],
                output.stride(0), output.stride(1),
                HEAD_DIM=head_dim, BLOCK_S=_pow2(splits), BLOCK_D=_pow2(head_dim),
            )  # fmt: skip


def _check_inputs(
    layer: AttentionLayer, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> None:
    if query.dtype not in _DTYPES or key_cache.dtype not in _DTYPES:
        raise ValueError(
            f"the triton backend reads float32, bfloat16 or float16; got queries in "
            f"{query.dtype} and a KV cache in {key_cache.dtype}"
        )
    if layer.num_heads % layer.num_kv_heads:
        raise ValueError(
            f"num_heads ({layer.num_heads}) must be a multiple of num_kv_heads "
            f"({layer.num_kv_heads})"
        )
    if key_cache.stride() != value_cache.stride() or key_cache.stride(-1) != 1:
        raise ValueError(
            "the triton backend needs K and V caches with the same strides and a contiguous "
            f"last dimension; got {key_cache.stride()} and {value_cache.stride()}"
        )
