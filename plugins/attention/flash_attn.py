"""The ``flash-attn`` attention backend: flash-attn 2's paged-KV kernels (block tables).

Per layer, :meth:`FlashAttentionBackend.forward`

1. writes the step's K and V at ``slot_mapping`` (an ``index_copy_`` into the flat pool, as
   ``sdpa`` does, so a padding row aimed at a scratch page writes only there);
2. runs the leading ``num_decodes`` rows through ``flash_attn_with_kvcache`` (one query each,
   ``cache_seqlens`` = context length, ``block_table`` = the rows' pages);
3. runs the prefill chunks through ``flash_attn_varlen_func`` with ``block_table``: keys are
   the whole context (cached and new), and flash-attn's causal mask is aligned to the bottom
   right, so query ``i`` of a chunk sees the keys up to its own position.

flash-attn's paged API reads pages whose size is a multiple of 256, in float16 or bfloat16
only. The package is imported on first use, never with this module: Brigade installs and
runs without it, and ``check_device`` names the extra that provides it.

Unverified: no test of this backend has run yet (it needs a CUDA GPU with flash-attn).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from types import ModuleType
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from brigade.interfaces import AttentionBackend, AttentionLayer, ModelInput, NoOptions, PageSizeRule

__all__ = ["FlashAttentionBackend", "FlashAttentionMetadata"]

PAGE_MULTIPLE = 256
"""flash-attn's paged KV kernels need ``page_block_size % 256 == 0``."""
_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _flash_attn() -> ModuleType:
    return importlib.import_module("flash_attn")


@dataclasses.dataclass(frozen=True, slots=True)
class FlashAttentionMetadata:
    """One step's device tensors and host maxima, built once and shared by every layer."""

    num_decodes: int
    num_prefills: int
    slot_mapping: torch.Tensor
    """[T] int64 where each new token's K/V is written."""
    decode_seq_lens: torch.Tensor
    """[D] int32 context length of each decode row (its new token included)."""
    decode_block_tables: torch.Tensor
    """[D, P] int32 pages of each decode row."""
    prefill_cu_seqlens_q: torch.Tensor
    """[num_prefills + 1] int32 offsets of the chunks' queries, counted from the first chunk."""
    prefill_cu_seqlens_k: torch.Tensor
    """[num_prefills + 1] int32 offsets of the chunks' contexts (cached + new keys)."""
    prefill_block_tables: torch.Tensor
    """[num_prefills, P] int32 pages of each chunk's request."""
    max_prefill_query_len: int
    max_prefill_seq_len: int


class FlashAttentionBackend(AttentionBackend):
    """Paged attention on flash-attn 2 (``flash_attn_with_kvcache``, ``flash_attn_varlen_func``).

    CUDA graphs: the decode call reads lengths and pages from device tensors only and its
    launch depends on the batch's row count alone, so pure decode steps can be captured.
    """

    name: ClassVar[str] = "flash-attn"
    supports_sliding_window: ClassVar[bool] = True
    supports_cuda_graphs: ClassVar[bool] = True

    def __init__(self, options: NoOptions | None = None) -> None:
        self.options = options if options is not None else NoOptions()

    @classmethod
    def supported_page_sizes(cls, options: Any) -> PageSizeRule:
        """Multiples of 256 (flash-attn's paged API)."""
        return PageSizeRule(multiple_of=PAGE_MULTIPLE, minimum=PAGE_MULTIPLE)

    @classmethod
    def check_device(cls, device: str) -> None:
        """flash-attn must import and the device must be a CUDA GPU."""
        try:
            _flash_attn()
        except ImportError as exc:
            raise RuntimeError(
                "the flash-attn attention backend needs the flash-attn package, which failed "
                f"to import ({exc}); install Brigade's 'flash-attn' extra "
                "(pip install 'brigade-llm[flash-attn]') or choose attention plugin 'triton'"
            ) from exc
        if not device.startswith("cuda") or not torch.cuda.is_available():
            raise RuntimeError(
                f"the flash-attn attention backend needs a CUDA GPU; device is {device!r}"
            )

    def build_metadata(self, batch: ModelInput) -> FlashAttentionMetadata:
        """Split the rows into decodes and prefill chunks; host maxima from ``*_cpu``."""
        num_decodes = batch.num_decodes
        num_prefills = batch.num_reqs - num_decodes
        seq_lens = batch.seq_lens.to(torch.int32)  # [B]
        block_tables = batch.block_tables.to(torch.int32)  # [B, P]
        query_start = batch.query_start_loc.to(torch.int32)  # [B + 1]
        prefill_lens_cpu = batch.seq_lens_cpu[num_decodes:]
        query_lens_cpu = batch.query_start_loc_cpu[1:] - batch.query_start_loc_cpu[:-1]  # [B]
        prefill_seq_lens = seq_lens[num_decodes:]  # [num_prefills]
        return FlashAttentionMetadata(
            num_decodes=num_decodes,
            num_prefills=num_prefills,
            slot_mapping=batch.slot_mapping.to(torch.int64),
            decode_seq_lens=seq_lens[:num_decodes],
            decode_block_tables=block_tables[:num_decodes],
            prefill_cu_seqlens_q=query_start[num_decodes:] - query_start[num_decodes],
            prefill_cu_seqlens_k=F.pad(
                torch.cumsum(prefill_seq_lens, 0, dtype=torch.int32), (1, 0)
            ),  # [num_prefills + 1]
            prefill_block_tables=block_tables[num_decodes:],
            max_prefill_query_len=int(query_lens_cpu[num_decodes:].max()) if num_prefills else 0,
            max_prefill_seq_len=int(prefill_lens_cpu.max()) if num_prefills else 0,
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
        meta: FlashAttentionMetadata = metadata
        key_cache, value_cache = kv_cache  # [num_pages, page_size, kv_heads, head_dim] each
        if query.dtype not in _DTYPES or key_cache.dtype != query.dtype:
            raise ValueError(
                "the flash-attn backend reads float16 or bfloat16, with the KV cache in the "
                f"model's dtype; got queries in {query.dtype} and a KV cache in {key_cache.dtype}"
            )
        flat_shape = (-1, layer.num_kv_heads, layer.head_dim)
        key_cache.view(flat_shape).index_copy_(0, meta.slot_mapping, key)
        value_cache.view(flat_shape).index_copy_(0, meta.slot_mapping, value)
        window = (-1, -1) if layer.sliding_window is None else (layer.sliding_window - 1, 0)
        flash_attn = _flash_attn()
        output = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
        decodes = meta.num_decodes
        if decodes:
            out = flash_attn.flash_attn_with_kvcache(
                query[:decodes].unsqueeze(1),  # [D, 1, num_heads, head_dim]
                key_cache,
                value_cache,
                cache_seqlens=meta.decode_seq_lens,
                block_table=meta.decode_block_tables,
                softmax_scale=layer.scale,
                causal=True,
                window_size=window,
            )  # [D, 1, num_heads, head_dim]
            output[:decodes] = out.squeeze(1)
        if meta.num_prefills:
            output[decodes:] = flash_attn.flash_attn_varlen_func(
                query[decodes:],  # [prefill tokens, num_heads, head_dim]
                key_cache,
                value_cache,
                cu_seqlens_q=meta.prefill_cu_seqlens_q,
                cu_seqlens_k=meta.prefill_cu_seqlens_k,
                max_seqlen_q=meta.max_prefill_query_len,
                max_seqlen_k=meta.max_prefill_seq_len,
                softmax_scale=layer.scale,
                causal=True,
                window_size=window,
                block_table=meta.prefill_block_tables,
            )  # [prefill tokens, num_heads, head_dim]
        return output
