"""The ``gather-sdpa`` attention backend: the contract and nothing more, in plain torch.

Each step it works out, once, which cache slots every row reads; each layer then writes the
new K/V at ``slot_mapping``, gathers those slots into dense tensors and calls torch's
``scaled_dot_product_attention``: all decode rows in one call (padded to the longest context
and masked), each prefill chunk in a call of its own. Any device, any page size, no sliding
window, no CUDA graphs.

What it does not do, compared with Brigade's built-in ``sdpa`` on a CPU: read the pages in
place (the gather copies every decode row's context up to the longest row's, each layer),
score a shared prefix once for the rows that share it (cascade), or let the model run a
step's layers in one fused C++ call, which the model does only with the backend whose
metadata it knows.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from brigade.interfaces import AttentionBackend, AttentionLayer, ModelInput, NoOptions
from torch.nn.functional import scaled_dot_product_attention

__all__ = ["GatherMetadata", "GatherSdpaBackend", "PrefillChunk"]


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillChunk:
    """One prefill chunk: its tokens in the flat batch and the keys it reads."""

    query_start: int
    query_end: int
    slots: torch.Tensor
    """[seq_len] int64 cache slot of each key position 0 .. seq_len - 1."""
    mask: torch.Tensor | None
    """[num_queries, seq_len] bool, True where a query attends; None for a whole prompt in
    one chunk (plain causal attention)."""


@dataclasses.dataclass(frozen=True, slots=True)
class GatherMetadata:
    """One step's gather indices and masks, shared by every layer."""

    slot_mapping: torch.Tensor
    """[T] int64 where each new token's K/V is written."""
    num_decodes: int
    decode_slots: torch.Tensor | None
    """[D, L] int64 slots of each decode row's keys, L = the longest decode context; past a
    row's length, its first slot (finite, and masked)."""
    decode_mask: torch.Tensor | None
    """[D, 1, 1, L] bool, True where the decode row attends."""
    prefill_chunks: tuple[PrefillChunk, ...]


class GatherSdpaBackend(AttentionBackend):
    """Paged attention as gather + ``scaled_dot_product_attention`` (see the module)."""

    name: ClassVar[str] = "gather-sdpa"

    def __init__(self, options: NoOptions) -> None:
        self.options = options

    def build_metadata(self, batch: ModelInput) -> GatherMetadata:
        """Slots and masks from the block tables; host integers from the ``*_cpu`` copies."""
        device = batch.block_tables.device
        page_size = batch.page_size
        block_tables = batch.block_tables.long()  # [B, P]
        starts = batch.query_start_loc_cpu.tolist()
        seq_lens = batch.seq_lens_cpu.tolist()
        decodes = batch.num_decodes
        decode_slots = decode_mask = None
        if decodes:
            longest = max(seq_lens[:decodes])
            positions = torch.arange(longest, device=device)  # [L]
            pages = block_tables[:decodes, positions // page_size]  # [D, L]
            slots = pages * page_size + positions % page_size  # [D, L]
            lengths = batch.seq_lens[:decodes].long().unsqueeze(1)  # [D, 1]
            valid = positions < lengths  # [D, L]
            decode_slots = torch.where(valid, slots, slots[:, :1])
            decode_mask = valid[:, None, None, :]  # [D, 1, 1, L]
        chunks = []
        for row in range(decodes, batch.num_reqs):
            query_start, query_end, seq_len = starts[row], starts[row + 1], seq_lens[row]
            positions = torch.arange(seq_len, device=device)  # [seq_len]
            slots = block_tables[row, positions // page_size] * page_size + positions % page_size
            num_cached = seq_len - (query_end - query_start)
            mask = None
            if num_cached:
                query_positions = torch.arange(num_cached, seq_len, device=device)  # [n]
                mask = positions[None, :] <= query_positions[:, None]  # [n, seq_len]
            chunks.append(PrefillChunk(query_start, query_end, slots, mask))
        return GatherMetadata(batch.slot_mapping, decodes, decode_slots, decode_mask, tuple(chunks))

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
        meta: GatherMetadata = metadata
        # key_cache, value_cache: [num_slots, kv_heads, head_dim] views of the paged pool
        key_cache = kv_cache[0].view(-1, layer.num_kv_heads, layer.head_dim)
        value_cache = kv_cache[1].view(-1, layer.num_kv_heads, layer.head_dim)
        key_cache.index_copy_(0, meta.slot_mapping, key.to(key_cache.dtype))
        value_cache.index_copy_(0, meta.slot_mapping, value.to(value_cache.dtype))
        grouped = layer.num_heads != layer.num_kv_heads
        output = torch.empty_like(query)  # [T, heads, head_dim]
        if meta.decode_slots is not None:
            decodes = meta.num_decodes
            q = query[:decodes].unsqueeze(2)  # [D, heads, 1, head_dim]
            # [D, L, kv_heads, head_dim] -> [D, kv_heads, L, head_dim]
            k = key_cache[meta.decode_slots].transpose(1, 2).to(query.dtype)
            v = value_cache[meta.decode_slots].transpose(1, 2).to(query.dtype)
            attended = scaled_dot_product_attention(
                q, k, v, attn_mask=meta.decode_mask, scale=layer.scale, enable_gqa=grouped
            )  # [D, heads, 1, head_dim]
            output[:decodes] = attended.squeeze(2)
        for chunk in meta.prefill_chunks:
            span = slice(chunk.query_start, chunk.query_end)
            q = query[span].transpose(0, 1)  # [heads, n, head_dim]
            k = key_cache[chunk.slots].transpose(0, 1).to(query.dtype)  # [kv_heads, keys, hd]
            v = value_cache[chunk.slots].transpose(0, 1).to(query.dtype)  # [kv_heads, keys, hd]
            attended = scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=chunk.mask,
                is_causal=chunk.mask is None,
                scale=layer.scale,
                enable_gqa=grouped,
            )  # [heads, n, head_dim]
            output[span] = attended.transpose(0, 1)
        return output
