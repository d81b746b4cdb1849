"""Triton kernels of the ``triton`` attention backend (``triton_backend`` launches them).

Every kernel reads the paged KV layout of DESIGN.md: per layer a K and a V pool, each
``[num_pages, page_size, num_kv_heads, head_dim]``. A key at position ``p`` of a request lives
in page ``block_table[p // page_size]`` at offset ``p % page_size``; the kernels look that up
per key, so a tile of keys may span pages and any page size works. Scores, softmax statistics
and the output accumulator are fp32 whatever the input dtype; ``tl.dot`` runs at "ieee"
precision, so fp32 inputs are not rounded to tf32 on a GPU. Step-varying integers (window,
split count, number of decodes) are not specialised, so a value of 1 compiles no variant.

Importing this module decorates the kernels, and Triton decides then whether they run compiled
(GPU) or under its CPU interpreter (``TRITON_INTERPRET=1``): set the variable before importing.
"""
# The @triton.jit kernels cannot carry Python type hints (Triton reads parameter annotations
# itself), so this module opts out of mypy's disallow-untyped-defs, and compile-time constants
# keep Triton's UPPER_CASE convention.
# mypy: disallow-untyped-defs=False
# ruff: noqa: N803

import triton
import triton.language as tl

__all__ = ["decode_reduce_kernel", "decode_split_kernel", "prefill_kernel", "write_kv_kernel"]


@triton.jit
def write_kv_kernel(
    key_ptr,  # [T, KVH, D] new keys
    value_ptr,  # [T, KVH, D] new values
    key_cache_ptr,  # [num_pages, page_size, KVH, D]
    value_cache_ptr,  # [num_pages, page_size, KVH, D]
    slot_mapping_ptr,  # [T] int64
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cache_page,  # K and V pools share their strides
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_KVH: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per new token: copy its K and V (all KV heads) into their slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    offs_h = tl.arange(0, BLOCK_KVH)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)  # [KVH, D]
    key = tl.load(
        key_ptr + token * stride_k_token + offs_h[:, None] * stride_k_head + offs_d[None, :],
        mask=mask,
    )
    value = tl.load(
        value_ptr + token * stride_v_token + offs_h[:, None] * stride_v_head + offs_d[None, :],
        mask=mask,
    )
    dst = (
        page * stride_cache_page
        + offset * stride_cache_slot
        + offs_h[:, None] * stride_cache_head
        + offs_d[None, :]
    )  # [BLOCK_KVH, BLOCK_D]
    tl.store(key_cache_ptr + dst, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["window", "num_splits"])
def decode_split_kernel(
    query_ptr,  # [T, H, D]; decode row r's token is token r
    key_cache_ptr,  # [num_pages, page_size, KVH, D]
    value_cache_ptr,  # [num_pages, page_size, KVH, D]
    block_tables_ptr,  # [B, P] int32
    seq_lens_ptr,  # [B] int32
    partial_out_ptr,  # [num_decodes, H, num_splits, D] (the output itself when num_splits == 1)
    partial_lse_ptr,  # [num_decodes, H, num_splits] fp32
    scale,
    window,  # keys seen per query (itself included); 0 = unlimited
    num_splits,
    stride_q_token,
    stride_q_head,
    stride_cache_page,  # K and V pools share their strides
    stride_cache_slot,
    stride_cache_head,
    stride_table_row,
    stride_po_row,
    stride_po_head,
    stride_po_split,
    stride_lse_row,
    stride_lse_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (row, kv_head, split): the query heads of one KV head over one context range.

    Writes the range's softmax-normalised output and its log-sum-exp, which
    :func:`decode_reduce_kernel` combines across splits (flash-decoding).
    """
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_h  # [BLOCK_H] query heads sharing this KV head
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    query = tl.load(
        query_ptr + row * stride_q_token + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]

    seq_len = tl.load(seq_lens_ptr + row)
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    # Splits share the attended range in whole tiles; trailing splits may get nothing.
    split_len = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    table_ptr = block_tables_ptr + row * stride_table_row
    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for block_start in range(start, end, BLOCK_N):
        offs_n = block_start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        mask_n = offs_n < end
        pages = tl.load(table_ptr + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        slots = (
            pages * stride_cache_page
            + (offs_n % PAGE_SIZE) * stride_cache_slot
            + kv_head * stride_cache_head
        )  # [BLOCK_N] element offsets of the keys' rows in either pool
        kv_mask = mask_d[:, None] & mask_n[None, :]  # [BLOCK_D, BLOCK_N]
        keys = tl.load(
            key_cache_ptr + slots[None, :] + offs_d[:, None],
            mask=kv_mask,
            other=0.0,
        )  # [BLOCK_D, BLOCK_N], transposed for the dot
        scores = tl.dot(query, keys.to(query.dtype), input_precision="ieee") * scale
        scores = tl.where(mask_n[None, :], scores, float("-inf"))  # [BLOCK_H, BLOCK_N]
        # Every tile holds at least one key, so m_new is finite and nothing becomes NaN.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        probs = tl.exp(scores - m_new[:, None])
        values = tl.load(
            value_cache_ptr + slots[:, None] + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        l_i = l_i * alpha + tl.sum(probs, 1)
        acc = acc * alpha[:, None] + tl.dot(
            probs.to(query.dtype), values.to(query.dtype), input_precision="ieee"
        )
        m_i = m_new

    # An empty split stores zeros and lse = -inf, which the reduction weighs by zero.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    out_ptr = partial_out_ptr + row * stride_po_row + split * stride_po_split
    tl.store(
        out_ptr + heads[:, None] * stride_po_head + offs_d[None, :],
        out.to(partial_out_ptr.dtype.element_ty),
        mask=mask_h[:, None] & mask_d[None, :],
    )
    lse = tl.where(l_i > 0, m_i + tl.log(l_safe), float("-inf"))
    tl.store(
        partial_lse_ptr + row * stride_lse_row + heads * stride_lse_head + split, lse, mask=mask_h
    )


@triton.jit(do_not_specialize=["num_splits"])
def decode_reduce_kernel(
    partial_out_ptr,  # [num_decodes, H, num_splits, D] fp32
    partial_lse_ptr,  # [num_decodes, H, num_splits] fp32
    output_ptr,  # [T, H, D]
    num_splits,
    stride_po_row,
    stride_po_head,
    stride_po_split,
    stride_lse_row,
    stride_lse_head,
    stride_out_token,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (row, head): combine the splits' outputs, weighted by exp(lse - max lse)."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(
        partial_lse_ptr + row * stride_lse_row + head * stride_lse_head + offs_s,
        mask=mask_s,
        other=float("-inf"),
    )  # [BLOCK_S]; split 0 is never empty, so the maximum is finite
    weights = tl.exp(lse - tl.max(lse, 0))
    partial = tl.load(
        partial_out_ptr
        + row * stride_po_row
        + head * stride_po_head
        + offs_s[:, None] * stride_po_split
        + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    out = tl.sum(weights[:, None] * partial, 0) / tl.sum(weights, 0)
    tl.store(
        output_ptr + row * stride_out_token + head * stride_out_head + offs_d,
        out.to(output_ptr.dtype.element_ty),
        mask=mask_d,
    )


@triton.jit(do_not_specialize=["window", "first_row"])
def prefill_kernel(
    query_ptr,  # [T, H, D]
    key_cache_ptr,  # [num_pages, page_size, KVH, D], the chunk's own K/V already written
    value_cache_ptr,  # [num_pages, page_size, KVH, D]
    block_tables_ptr,  # [B, P] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B + 1] int32
    output_ptr,  # [T, H, D]
    scale,
    window,  # keys seen per query (itself included); 0 = unlimited
    first_row,  # the first prefill row (= num_decodes)
    stride_q_token,
    stride_q_head,
    stride_cache_page,  # K and V pools share their strides
    stride_cache_slot,
    stride_cache_head,
    stride_table_row,
    stride_out_token,
    stride_out_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (chunk, kv_head, query block): BLOCK_Q tokens of one chunk against its context.

    The tile's BLOCK_M rows are (token, query head) pairs of the GROUP query heads that share
    the KV head (BLOCK_Q = BLOCK_M // GROUP tokens), so each K/V tile serves the whole group
    and short chunks still fill the tile. The chunk's queries sit at positions
    ``num_computed .. seq_len - 1``; each attends to every key at or before its position
    (cached or new) and within the window.
    """
    row = first_row + tl.program_id(0)
    kv_head = tl.program_id(1)
    block_q = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + row)
    query_len = tl.load(query_start_loc_ptr + row + 1) - query_start
    if block_q * BLOCK_Q >= query_len:
        return  # the grid covers the longest chunk; shorter ones have fewer blocks
    seq_len = tl.load(seq_lens_ptr + row)
    num_computed = seq_len - query_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_q = block_q * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] token offsets in the chunk
    heads = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M] query heads
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = (offs_m < BLOCK_Q * GROUP) & (offs_q < query_len)
    mask_d = offs_d < HEAD_DIM
    tokens = (query_start + offs_q).to(tl.int64)  # [BLOCK_M] rows of the flat token array
    query = tl.load(
        query_ptr
        + tokens[:, None] * stride_q_token
        + heads[:, None] * stride_q_head
        + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    query_pos = num_computed + offs_q  # [BLOCK_M]

    # Keys this block can see: from the first token's window start to the last token. Without
    # a window every key before the block's first token is seen by all its tokens: those tiles
    # skip the mask; the rest (the diagonal, or everything under a window) apply it.
    first_pos = num_computed + block_q * BLOCK_Q
    end = num_computed + tl.minimum((block_q + 1) * BLOCK_Q, query_len)
    first = tl.where(window > 0, tl.maximum(first_pos - window + 1, 0), 0)
    unmasked_end = tl.where(window > 0, first, (first_pos // BLOCK_N) * BLOCK_N)

    table_ptr = block_tables_ptr + row.to(tl.int64) * stride_table_row
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634  # log2(e): exp2 below, as exp(x) = exp2(x log2 e)
    for block_start in range(first, unmasked_end, BLOCK_N):
        acc, l_i, m_i = _prefill_tile(
            acc, l_i, m_i, query, key_cache_ptr, value_cache_ptr, table_ptr, block_start,
            end, query_pos, window, qk_scale, kv_head * stride_cache_head, offs_d, mask_d,
            stride_cache_page, stride_cache_slot, PAGE_SIZE, BLOCK_N, False,
        )  # fmt: skip
    for block_start in range(unmasked_end, end, BLOCK_N):
        acc, l_i, m_i = _prefill_tile(
            acc, l_i, m_i, query, key_cache_ptr, value_cache_ptr, table_ptr, block_start,
            end, query_pos, window, qk_scale, kv_head * stride_cache_head, offs_d, mask_d,
            stride_cache_page, stride_cache_slot, PAGE_SIZE, BLOCK_N, True,
        )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # every real query sees itself: l_i > 0
    tl.store(
        output_ptr
        + tokens[:, None] * stride_out_token
        + heads[:, None] * stride_out_head
        + offs_d[None, :],
        out.to(output_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


@triton.jit
def _prefill_tile(
    acc,
    l_i,
    m_i,
    query,  # [BLOCK_M, BLOCK_D]
    key_cache_ptr,
    value_cache_ptr,
    table_ptr,  # this row's block table
    block_start,  # the tile's first key position
    end,  # one past the last key any query of the block sees
    query_pos,  # [BLOCK_M]
    window,
    qk_scale,  # scale * log2(e)
    head_offset,  # kv_head * stride_cache_head
    offs_d,
    mask_d,
    stride_cache_page,
    stride_cache_slot,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One K/V tile of the prefill's online softmax: the updated (acc, l_i, m_i).

    Unmasked tiles (MASKED False) lie wholly before every query of the block and inside the
    context: no bounds, causal or window test."""
    offs_n = block_start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    if MASKED:  # noqa: SIM108 - a compile-time branch, as Triton's code generator reads it
        mask_n = offs_n < end
    else:
        mask_n = offs_n >= 0  # all true
    pages = tl.load(table_ptr + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
    slots = pages * stride_cache_page + (offs_n % PAGE_SIZE) * stride_cache_slot + head_offset
    keys = tl.load(
        key_cache_ptr + slots[None, :] + offs_d[:, None],
        mask=mask_d[:, None] & mask_n[None, :],
        other=0.0,
    )  # [BLOCK_D, BLOCK_N], transposed for the dot
    scores = tl.dot(query, keys.to(query.dtype), input_precision="ieee") * qk_scale
    if MASKED:
        relative = query_pos[:, None] - offs_n[None, :]  # [BLOCK_M, BLOCK_N]
        allowed = mask_n[None, :] & (relative >= 0) & ((window <= 0) | (relative < window))
        scores = tl.where(allowed, scores, float("-inf"))
    # A query may see no key of a tile (window); keep its row at zero, not NaN.
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    probs = tl.exp2(scores - m_safe[:, None])
    values = tl.load(
        value_cache_ptr + slots[:, None] + offs_d[None, :],
        mask=mask_n[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_N, BLOCK_D]
    l_i = l_i * alpha + tl.sum(probs, 1)
    acc = acc * alpha[:, None] + tl.dot(
        probs.to(query.dtype), values.to(query.dtype), input_precision="ieee"
    )
    return acc, l_i, m_new
