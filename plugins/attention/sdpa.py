"""The reference attention backend: gathers paged KV into dense tensors and calls torch SDPA.

Pure torch, on any device: the backend other backends are checked against, and the one they
build on (the ``cpu`` backend in ``brigade.plugins.cpu`` overrides :meth:`SdpaBackend.
_attend_decodes` and :meth:`SdpaBackend._attend_prefills` with Brigade's C++ kernels and falls
back on these where its kernels do not apply).

Decode rows (one query each) run as one batched call in which each KV head's query heads
stand in for the query-length axis, so K/V are never repeated per query head. Prefill chunks
run one call each, with SDPA's grouped-query support.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from brigade.interfaces import AttentionBackend, AttentionLayer, ModelInput, NoOptions

__all__ = ["SdpaBackend", "SdpaMetadata"]


@dataclasses.dataclass(frozen=True, slots=True)
class _DecodeView:
    """What every layer with one sliding window reads for the decode rows."""

    pages: torch.Tensor
    """[num_decodes * pages_per_row] int64 page ids to gather, row-major (whole pages are
    copied, which is far cheaper than gathering single slots)."""
    pages_per_row: int
    mask: torch.Tensor
    """[num_decodes, 1, 1, pages_per_row * page_size] bool, True where the query attends."""


@dataclasses.dataclass(frozen=True, slots=True)
class _PrefillRow:
    """One prefill chunk as every layer with one sliding window reads it."""

    query_start: int
    query_end: int
    slots: torch.Tensor
    """[num_keys] int64 flat cache slots of the keys this chunk can see."""
    mask: torch.Tensor | None
    """[num_queries, num_keys] bool, True where the query attends; None = plain causal (a
    whole prompt in one chunk, no window), which SDPA does without a mask."""


@dataclasses.dataclass(slots=True)
class SdpaMetadata:
    """One step's gather indices and masks, built once and shared by every layer.

    Indices depend on the layer's sliding window, which the backend learns only from the
    layer; each distinct window's are derived on first use and reused by every later layer.
    """

    num_decodes: int
    page_size: int
    slot_mapping: torch.Tensor
    """[T] int64 where each new token's K/V is written."""
    seq_lens: torch.Tensor
    """[B] int64 context length of each row after this step."""
    block_tables: torch.Tensor
    """[B, P] int64 page ids."""
    max_decode_len: int
    prefill_rows: list[tuple[int, int, int, int]]
    """(row, query_start, query_end, seq_len) host integers of every prefill chunk."""
    prefill_chunks: torch.Tensor | None = None
    """``prefill_rows`` as an int64 tensor [chunks, 4] (for the CPU prefill kernel), or None
    when the step has no prefill chunk."""
    _decode_views: dict[int | None, _DecodeView] = dataclasses.field(default_factory=dict)
    _prefill_views: dict[int | None, list[_PrefillRow]] = dataclasses.field(default_factory=dict)

    def decode_view(self, window: int | None) -> _DecodeView:
        """Gather slots and mask of the decode rows for layers with this sliding window."""
        view = self._decode_views.get(window)
        if view is None:
            view = self._build_decode_view(window)
            self._decode_views[window] = view
        return view

    def prefill_view(self, window: int | None) -> list[_PrefillRow]:
        """Per-chunk slots and masks for layers with this sliding window."""
        rows = self._prefill_views.get(window)
        if rows is None:
            rows = [self._build_prefill_row(*row, window) for row in self.prefill_rows]
            self._prefill_views[window] = rows
        return rows

    def _slots(self, rows: torch.Tensor | int, key_positions: torch.Tensor) -> torch.Tensor:
        pages = self.block_tables[rows, key_positions // self.page_size]
        return pages * self.page_size + key_positions % self.page_size

    def _build_decode_view(self, window: int | None) -> _DecodeView:
        device = self.seq_lens.device
        page_size = self.page_size
        seq_lens = self.seq_lens[: self.num_decodes]  # [num_decodes]
        max_pages = -(-self.max_decode_len // page_size)
        if window is None:
            pages_per_row = max_pages
            first_page = torch.zeros_like(seq_lens)  # [num_decodes]
        else:
            # The window's keys span at most this many pages, wherever it starts in a page.
            pages_per_row = min(max_pages, -(-(window - 1) // page_size) + 1)
            first_key = (seq_lens - window).clamp(min=0)  # [num_decodes]
            first_page = (first_key // page_size).clamp(max=max_pages - pages_per_row)
        page_index = first_page[:, None] + torch.arange(pages_per_row, device=device)  # [D, P]
        rows = torch.arange(self.num_decodes, device=device)[:, None]  # [num_decodes, 1]
        pages = self.block_tables[rows, page_index]  # [num_decodes, pages_per_row]
        positions = first_page[:, None] * page_size + torch.arange(
            pages_per_row * page_size, device=device
        )  # [num_decodes, pages_per_row * page_size]
        valid = positions < seq_lens[:, None]
        if window is not None:
            valid &= positions >= (seq_lens - window)[:, None]
        # Table entries past a row's pages may be stale; point them at its first page so the
        # gather stays in bounds (masked anyway).
        pages = torch.where(page_index * page_size < seq_lens[:, None], pages, pages[:, :1])
        return _DecodeView(pages.reshape(-1), pages_per_row, valid[:, None, None, :])

    def _build_prefill_row(
        self,
        row: int,
        query_start: int,
        query_end: int,
        seq_len: int,
        window: int | None,
    ) -> _PrefillRow:
        device = self.seq_lens.device
        num_computed = seq_len - (query_end - query_start)
        first_key = 0 if window is None else max(0, num_computed - window + 1)
        key_positions = torch.arange(first_key, seq_len, device=device)  # [num_keys]
        slots = self._slots(row, key_positions)
        if num_computed == 0 and (window is None or window >= seq_len):
            return _PrefillRow(query_start, query_end, slots, None)
        query_positions = torch.arange(num_computed, seq_len, device=device)  # [num_queries]
        relative = query_positions[:, None] - key_positions[None, :]  # [num_queries, num_keys]
        mask = relative >= 0
        if window is not None:
            mask &= relative < window
        return _PrefillRow(query_start, query_end, slots, mask)


class SdpaBackend(AttentionBackend):
    """Paged attention on torch's ``scaled_dot_product_attention``; any device, any page size.

    :meth:`forward` writes the new K/V, then attends the decode rows
    (:meth:`_attend_decodes`) and the prefill chunks (:meth:`_attend_prefills`): the two
    pieces a subclass may replace with kernels of its own, calling these where they do not
    apply.
    """

    name: ClassVar[str] = "sdpa"
    supports_sliding_window: ClassVar[bool] = True

    def __init__(self, options: NoOptions | None = None) -> None:
        self.options: object = options if options is not None else NoOptions()
        """This backend's options (a subclass keeps its own here)."""

    def build_metadata(self, batch: ModelInput) -> SdpaMetadata:
        """Host maxima and per-chunk bounds from the ``*_cpu`` copies; no device sync."""
        num_decodes = batch.num_decodes
        starts = batch.query_start_loc_cpu.tolist()
        seq_lens_cpu = batch.seq_lens_cpu.tolist()
        prefill_rows = [
            (row, starts[row], starts[row + 1], seq_lens_cpu[row])
            for row in range(num_decodes, batch.num_reqs)
        ]
        return SdpaMetadata(
            num_decodes=num_decodes,
            page_size=batch.page_size,
            slot_mapping=batch.slot_mapping,
            seq_lens=batch.seq_lens.long(),
            block_tables=batch.block_tables.long(),
            max_decode_len=max(seq_lens_cpu[:num_decodes], default=0),
            prefill_rows=prefill_rows,
            prefill_chunks=torch.tensor(prefill_rows, dtype=torch.int64) if prefill_rows else None,
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
        meta: SdpaMetadata = metadata
        num_kv_heads, head_dim = layer.num_kv_heads, layer.head_dim
        key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)  # [slots, kv_heads, head_dim]
        value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)  # [slots, kv_heads, head_dim]
        key_cache.index_copy_(0, meta.slot_mapping, key.to(key_cache.dtype))
        value_cache.index_copy_(0, meta.slot_mapping, value.to(value_cache.dtype))

        output = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
        if meta.num_decodes:
            self._attend_decodes(layer, query, kv_cache, meta, output)
        if meta.prefill_rows:
            self._attend_prefills(layer, query, key, value, kv_cache, meta, output)
        return output

    def _attend_decodes(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: SdpaMetadata,
        output: torch.Tensor,
    ) -> None:
        """Attend the leading ``meta.num_decodes`` rows of ``query`` [T, heads, head_dim] over
        the pages (their new K/V already written) into the same rows of ``output``."""
        view = meta.decode_view(layer.sliding_window)
        output[: meta.num_decodes] = _decode(
            layer, query[: meta.num_decodes], kv_cache[0], kv_cache[1], view
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
        """Attend every prefill chunk's rows of ``query`` (causal over the pages, their new
        K/V already written; ``key``/``value`` are the step's new K/V [T, kv_heads, head_dim])
        into the same rows of ``output``."""
        num_kv_heads, head_dim = layer.num_kv_heads, layer.head_dim
        key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)  # [slots, kv_heads, head_dim]
        value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)  # [slots, kv_heads, head_dim]
        # A whole prompt in one chunk sees exactly its own new keys: attend to them as computed
        # instead of reading them back from the pages (same values when the cache has the
        # activations' dtype).
        fresh = key_cache.dtype == query.dtype
        for row in meta.prefill_view(layer.sliding_window):
            span = slice(row.query_start, row.query_end)
            if fresh and row.mask is None:
                keys, values = key[span], value[span]  # [n, kv_heads, head_dim]
            else:
                keys = key_cache[row.slots].to(query.dtype)  # [num_keys, kv_heads, head_dim]
                values = value_cache[row.slots].to(query.dtype)
            output[span] = _prefill(layer, query[span], keys, values, row.mask)


def _decode(
    layer: AttentionLayer,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    view: _DecodeView,
) -> torch.Tensor:
    """All decode rows at once: query [num_decodes, num_heads, head_dim] -> same shape.

    ``key_cache``/``value_cache`` are the paged pools [num_pages, page_size, kv_heads, hd].
    """
    num_decodes = query.shape[0]
    group = layer.num_heads // layer.num_kv_heads
    # Query heads of one KV head become that KV head's "query length".
    q = query.reshape(num_decodes, layer.num_kv_heads, group, layer.head_dim)  # [D, kvh, G, hd]
    # Whole pages are gathered (masked slots hold finite values: pages are zeroed before
    # their first use), then [D, pages * page_size, kvh, hd] -> [D, kvh, keys, hd].
    k, v = (
        cache.index_select(0, view.pages)
        .view(num_decodes, -1, *cache.shape[2:])
        .transpose(1, 2)
        .to(query.dtype)
        for cache in (key_cache, value_cache)
    )
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=view.mask, scale=layer.scale)
    return out.reshape(num_decodes, layer.num_heads, layer.head_dim)  # [D, heads, hd]


def _prefill(
    layer: AttentionLayer,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """One chunk: query [num_queries, num_heads, head_dim], the keys and values it can see
    [num_keys, kv_heads, head_dim] and its mask (None: plain causal) -> [num_queries, num_heads,
    head_dim]."""
    q = query.transpose(0, 1)[None]  # [1, heads, n, hd]
    k = keys.transpose(0, 1)[None]  # [1, kv_heads, keys, hd]
    v = values.transpose(0, 1)[None]  # [1, kv_heads, keys, hd]
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None,
        scale=layer.scale,
        enable_gqa=layer.num_heads != layer.num_kv_heads,
    )  # [1, heads, n, hd]
    return out[0].transpose(0, 1)  # [n, heads, hd]
