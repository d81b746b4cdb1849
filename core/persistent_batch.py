"""The persistent batch: one row per running request, kept in place across steps.

Token ids, block tables and sampling parameters live in preallocated host tensors indexed by
row. A step writes only what changed (joins, leaves, new tokens, new pages) and builds the
executor's :class:`ModelInput` and the sampler's :class:`SamplingBatch` with a few
vectorised gathers, so per-step Python work is proportional to the scheduled requests, not to
the tokens they hold.

Each request is laid out by its kind: a generating request is a chunk whose last token's
logits are sampled, an embedding request a chunk whose hidden states are pooled
(``brigade.pooling``), and a request verifying drafts one decode row per token, every one
sampled (``brigade.speculative``). The :class:`StepPlan` says which logits and hidden rows
belong to whom.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from brigade.interfaces import (
    KVManager,
    ModelInput,
    Request,
    SamplingBatch,
    ScheduledRequest,
)
from brigade.pooling import PooledChunk

__all__ = ["PersistentBatch", "PooledChunk", "StepPlan"]


@dataclasses.dataclass(frozen=True, slots=True)
class StepPlan:
    """A step's executor input plus which requests get a token sampled."""

    model_input: ModelInput
    sampled: tuple[Request, ...]
    """Requests whose last known token is computed this step, in logits-row order."""
    sampled_rows: list[int]
    """Their persistent rows."""
    pooled: tuple[PooledChunk, ...] = ()
    """Embedding requests in the step, in hidden-row order (``model_input.hidden_indices``)."""
    draft_counts: tuple[int, ...] = ()
    """Speculative decoding: per sampled request, its draft tokens in this step (its logits
    rows are its last token's and one per draft, in order); empty when no request has any."""

    @property
    def logits_offsets(self) -> list[int]:
        """Each sampled request's first logits row (its last token's; a speculating
        request's draft positions follow it)."""
        if not self.draft_counts:
            return list(range(len(self.sampled)))
        offsets, offset = [], 0
        for drafts in self.draft_counts:
            offsets.append(offset)
            offset += 1 + drafts
        return offsets

    @property
    def logits_rows(self) -> list[int]:
        """The persistent row of each logits row (a speculating request's, once per position)."""
        if not self.draft_counts:
            return self.sampled_rows
        return [
            row
            for row, drafts in zip(self.sampled_rows, self.draft_counts, strict=True)
            for _ in range(1 + drafts)
        ]


class PersistentBatch:
    """Rows of running requests and the host buffers a step is built from."""

    def __init__(
        self, max_num_seqs: int, max_model_len: int, page_size: int, max_num_tokens: int
    ) -> None:
        self.page_size = page_size
        self.max_pages = -(-max_model_len // page_size)
        self.token_ids = torch.zeros(max_num_seqs, max_model_len, dtype=torch.int64)
        self.block_tables = torch.zeros(max_num_seqs, self.max_pages, dtype=torch.int32)
        self.num_pages = [0] * max_num_seqs
        """Pages of each row already written to ``block_tables``."""
        self.temperature = torch.zeros(max_num_seqs, dtype=torch.float32)
        self.top_k = torch.zeros(max_num_seqs, dtype=torch.int64)
        self.top_p = torch.ones(max_num_seqs, dtype=torch.float32)
        self.min_p = torch.zeros(max_num_seqs, dtype=torch.float32)
        self.num_logprobs = [-1] * max_num_seqs
        self.generators: dict[int, torch.Generator] = {}
        self.rows: dict[str, int] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._arange = torch.arange(max(max_num_tokens, max_model_len), dtype=torch.int64)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self.rows

    def assign(self, request: Request, generator: torch.Generator | None) -> int:
        """Give ``request`` a row and write its tokens and sampling parameters into it."""
        row = self._free_rows.pop()
        self.rows[request.request_id] = row
        tokens = request.all_token_ids
        self.token_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        self.num_pages[row] = 0
        params = request.sampling_params
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        if generator is not None:
            self.generators[row] = generator
        return row

    def release(self, request: Request) -> int:
        """Free the request's row; returns it."""
        row = self.rows.pop(request.request_id)
        self.generators.pop(row, None)
        self._free_rows.append(row)
        return row

    def append_tokens(
        self, rows: Sequence[int], positions: Sequence[int], tokens: list[int]
    ) -> None:
        """Record sampled tokens: ``tokens[i]`` at ``positions[i]`` of ``rows[i]`` (one
        vectorised write; a row may appear once per token it gained)."""
        self.token_ids[list(rows), list(positions)] = torch.tensor(tokens, dtype=torch.int64)

    def prepare(self, scheduled: Sequence[ScheduledRequest], kv: KVManager) -> StepPlan:
        """Build the step's ModelInput: decode rows first (the layout every attention backend
        expects), each group in the scheduler's order. Each request is laid out by its kind:
        one that generates (:meth:`_prepare_sampled`), an embedding request
        (:meth:`_prepare_pooled`) or one verifying drafts (:meth:`_prepare_drafting`)."""
        decodes: list[ScheduledRequest] = []
        prefills: list[ScheduledRequest] = []
        for item in scheduled:
            (decodes if item.is_decode else prefills).append(item)
        layout = _Layout()
        self._lay_out(decodes, True, kv, layout)
        self._lay_out(prefills, False, kv, layout)
        return StepPlan(
            self._model_input(layout),
            tuple(layout.sampled),
            layout.sampled_rows,
            tuple(layout.pooled),
            layout.draft_counts(),
        )

    def sampling_batch(self, rows: list[int], device: torch.device) -> SamplingBatch:
        """Gather the sampled rows' parameters (host flags, device tensors)."""
        index = torch.tensor(rows, dtype=torch.int64)
        temperature = self.temperature[index]
        top_k = self.top_k[index]
        top_p = self.top_p[index]
        min_p = self.min_p[index]
        generators = {
            i: self.generators[row] for i, row in enumerate(rows) if row in self.generators
        }
        max_logprobs = max(self.num_logprobs[row] for row in rows)
        return SamplingBatch(
            rows=index.to(device),
            temperature=temperature.to(device),
            top_k=top_k.to(device),
            top_p=top_p.to(device),
            min_p=min_p.to(device),
            generators=generators,
            all_greedy=bool((temperature == 0).all()),
            any_top_k=bool((top_k > 0).any()),
            any_top_p=bool((top_p < 1).any()),
            any_min_p=bool((min_p > 0).any()),
            max_num_logprobs=None if max_logprobs < 0 else max_logprobs,
        )

    def _lay_out(
        self,
        items: list[ScheduledRequest],
        is_decode: bool,
        kv: KVManager,
        layout: _Layout,
    ) -> None:
        """Add ``items`` (all decodes, or all prefill chunks) to ``layout`` in order, each
        request by its kind."""
        for item in items:
            request = item.request
            row = self.rows[request.request_id]
            self._sync_pages(row, kv.block_table(request))
            if item.num_draft_tokens:
                self._prepare_drafting(item, row, layout)
            elif request.pooling is not None:
                self._prepare_pooled(item, row, is_decode, layout)
            else:
                self._prepare_sampled(item, row, is_decode, layout)

    def _prepare_sampled(
        self, item: ScheduledRequest, row: int, is_decode: bool, layout: _Layout
    ) -> None:
        """A generating request's chunk; its last row's logits are sampled when the chunk
        reaches the request's last known token."""
        request, num_new = item.request, item.num_new_tokens
        computed = request.num_computed_tokens
        # layout.add_chunk, inlined: this runs for nearly every row of every step
        layout.rows.append(row)
        layout.computed.append(computed)
        layout.counts.append(num_new)
        layout.num_decodes += is_decode
        layout.num_tokens += num_new
        if computed + num_new == request.num_tokens:
            layout.sampled.append(request)
            layout.sampled_rows.append(row)
            layout.logits_rows.append(layout.num_tokens - 1)

    def _prepare_pooled(
        self, item: ScheduledRequest, row: int, is_decode: bool, layout: _Layout
    ) -> None:
        """An embedding request's chunk: it samples nothing; the executor returns the hidden
        states of its rows the pooler needs (every row for mean pooling, the prompt's last
        for last pooling)."""
        request, num_new = item.request, item.num_new_tokens
        assert request.pooling is not None
        computed = request.num_computed_tokens
        layout.add_chunk(row, computed, num_new, is_decode)
        completes = computed + num_new == request.num_tokens
        if request.pooling.needs_every_position:
            layout.hidden_rows.extend(range(layout.num_tokens - num_new, layout.num_tokens))
            num_rows = num_new
        else:
            if completes:
                layout.hidden_rows.append(layout.num_tokens - 1)
            num_rows = int(completes)
        layout.pooled.append(PooledChunk(request, num_rows, computed, completes))

    def _prepare_drafting(self, item: ScheduledRequest, row: int, layout: _Layout) -> None:
        """Lay out a request verifying drafts as one decode row per token (its last one, then
        each draft), each seeing the tokens before it: every backend writes a step's K/V
        before it attends, so a verification is a pure decode step (fused CPU decode, CUDA
        graphs), and rows that share a context read it once (cascade decode). Every row's
        logits are sampled (``StepPlan.draft_counts``)."""
        request, num_drafts = item.request, item.num_draft_tokens
        start = request.num_tokens  # the drafts' ids go where they would be if accepted
        drafts = request.draft_token_ids[:num_drafts]
        self.token_ids[row, start : start + num_drafts] = torch.tensor(drafts, dtype=torch.int64)
        first = layout.num_tokens
        for offset in range(1 + num_drafts):
            layout.add_chunk(row, request.num_computed_tokens + offset, 1, True)
        layout.drafts[len(layout.sampled)] = num_drafts
        layout.sampled.append(request)
        layout.sampled_rows.append(row)
        layout.logits_rows.extend(range(first, layout.num_tokens))

    def _model_input(self, layout: _Layout) -> ModelInput:
        """The executor's tensors for ``layout``: a few vectorised gathers from the
        persistent buffers."""
        row_index = torch.tensor(layout.rows, dtype=torch.int64)
        num_computed = torch.tensor(layout.computed, dtype=torch.int64)
        query_lens = torch.tensor(layout.counts, dtype=torch.int64)
        seq_lens = num_computed + query_lens
        query_start_loc = torch.zeros(len(layout.rows) + 1, dtype=torch.int32)
        torch.cumsum(query_lens, dim=0, out=query_start_loc[1:])
        num_tokens = layout.num_tokens
        # positions: for each token, its row's computed count plus its offset in the chunk
        token_rows = torch.repeat_interleave(torch.arange(len(layout.rows)), query_lens)  # [T]
        starts = query_start_loc[:-1].to(torch.int64)
        positions = self._arange[:num_tokens] - (starts - num_computed)[token_rows]  # [T]
        persistent_rows = row_index[token_rows]  # [T]
        input_ids = self.token_ids[persistent_rows, positions]  # [T]
        max_pages = int(-(-int(seq_lens.max()) // self.page_size))
        block_tables = self.block_tables[row_index, :max_pages]  # [B, P]
        pages = block_tables[token_rows, positions // self.page_size].to(torch.int64)  # [T]
        slot_mapping = pages * self.page_size + positions % self.page_size  # [T]
        seq_lens_i32 = seq_lens.to(torch.int32)
        hidden_rows = layout.hidden_rows
        return ModelInput(
            input_ids=input_ids,
            positions=positions,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens_i32,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            logits_indices=torch.tensor(layout.logits_rows, dtype=torch.int64),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens_i32,
            num_decodes=layout.num_decodes,
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            page_size=self.page_size,
            hidden_indices=torch.tensor(hidden_rows, dtype=torch.int64) if hidden_rows else None,
        )

    def _sync_pages(self, row: int, block_table: Sequence[int]) -> None:
        known = self.num_pages[row]
        if len(block_table) > known:
            new = torch.tensor(block_table[known:], dtype=torch.int32)
            self.block_tables[row, known : len(block_table)] = new
            self.num_pages[row] = len(block_table)


class _Layout:
    """A step's rows as :meth:`PersistentBatch.prepare` lays them out, before they become
    tensors."""

    __slots__ = (
        "computed",
        "counts",
        "drafts",
        "hidden_rows",
        "logits_rows",
        "num_decodes",
        "num_tokens",
        "pooled",
        "rows",
        "sampled",
        "sampled_rows",
    )

    def __init__(self) -> None:
        self.rows: list[int] = []
        """The persistent row of each query row (a chunk, or one token of a drafting one)."""
        self.computed: list[int] = []
        """Tokens of its request computed before each query row."""
        self.counts: list[int] = []
        """Tokens in each query row."""
        self.num_decodes = 0
        self.num_tokens = 0
        self.sampled: list[Request] = []
        self.sampled_rows: list[int] = []
        self.logits_rows: list[int] = []
        """The token rows whose logits are sampled, in ``sampled`` order."""
        self.drafts: dict[int, int] = {}
        """Index in ``sampled`` of each request verifying drafts -> its drafts."""
        self.pooled: list[PooledChunk] = []
        self.hidden_rows: list[int] = []

    def add_chunk(self, row: int, computed: int, count: int, is_decode: bool) -> None:
        """A query row of ``count`` tokens after ``computed`` ones, from persistent ``row``."""
        self.rows.append(row)
        self.computed.append(computed)
        self.counts.append(count)
        self.num_decodes += is_decode
        self.num_tokens += count

    def draft_counts(self) -> tuple[int, ...]:
        """``StepPlan.draft_counts``: empty when no request verifies drafts."""
        if not self.drafts:
            return ()
        return tuple(self.drafts.get(index, 0) for index in range(len(self.sampled)))
