"""Draft model: a second, smaller model with the served model's tokenizer drafts the next tokens
greedily, one forward pass per draft token; one step of the served model verifies them all.

The draft model is loaded by core (``ProposerParams.load_model``) on the engine's executor and
attention plugins, with a KV pool of its own under a new instance of the engine's KV manager
plugin. Each request the engine speculates on has a shadow ``Request`` here whose tokens are
the engine request's own lists (read-only) and whose ``num_computed_tokens`` counts the draft
model's KV: a step computes what the draft model has not seen yet (the tokens the served model
emitted since, or the whole prompt the first time, from the draft pool's prefix cache where it
can), then feeds each draft back in. Drafts the served model rejected leave KV behind that the
next step overwrites: a draft fed at a position counts as computed only once the request's
token there turns out to be that draft.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from brigade.interfaces import (
    ConfigError,
    DraftModel,
    DraftSlot,
    Proposer,
    ProposerParams,
    Request,
    option,
)
from brigade.interfaces.executor import DTYPE_NAMES
from brigade.model_input import SeqChunk, build_model_input

__all__ = ["DraftModelOptions", "DraftModelProposer"]


@dataclasses.dataclass(frozen=True)
class DraftModelOptions:
    model: str = option(
        "",
        help="the draft model (required): a Hugging Face directory or a GGUF file with the "
        "served model's tokenizer, smaller than the served model (vLLM's "
        "speculative_config.model)",
    )
    dtype: str = option(
        "auto",
        help="the draft model's dtype; 'auto' = the served model's",
        choices=("auto", *DTYPE_NAMES),
    )
    num_pages: int = option(
        0, help="pages of the draft model's KV pool; 0 = as many as the served model's", ge=0
    )
    max_prefill_tokens: int = option(
        2048,
        help="most tokens one step feeds the draft model to catch up with requests (new "
        "prompts, preempted requests); a request still catching up drafts nothing that step",
        ge=1,
    )


class _Shadow:
    """A request as the draft model sees it."""

    __slots__ = ("fed", "request")

    def __init__(self, request: Request) -> None:
        self.request = Request(
            request.request_id, request.prompt_token_ids, request.sampling_params
        )
        self.request.output_token_ids = request.output_token_ids  # the engine's own list
        self.fed: list[int] = []
        """Drafts fed at positions ``request.num_computed_tokens`` onwards in the latest step:
        their KV is written, and valid where the request's tokens turn out to be them."""

    def follows(self, request: Request) -> bool:
        return (
            self.request.prompt_token_ids is request.prompt_token_ids
            and self.request.output_token_ids is request.output_token_ids
        )


@dataclasses.dataclass(slots=True)
class _Row:
    """One request's part of a draft-model forward pass."""

    shadow: _Shadow
    tokens: list[int]
    """Its new tokens this pass, fed at positions ``start`` onwards."""
    start: int
    drafts: list[int]
    max_tokens: int


class DraftModelProposer(Proposer):
    """Drafts with a second model: up to ``max_tokens`` greedy tokens per request, in at most
    ``num_speculative_tokens`` forward passes of the draft model per step (the first one also
    catches up with the tokens the request gained; the others are one decode row per
    request still drafting).

    Greedy drafts are point masses: core's verification keeps the served model's distribution
    exact at any temperature; the draft only decides how many tokens a step gains.
    """

    @classmethod
    def model_to_load(cls, options: DraftModelOptions) -> str:
        if not options.model:
            raise ConfigError(
                "[speculative] plugin = 'draft-model' needs model = <a Hugging Face directory "
                "or GGUF file with the served model's tokenizer>"
            )
        return options.model

    def __init__(self, params: ProposerParams, options: DraftModelOptions) -> None:
        super().__init__(params, options)
        self.model_to_load(options)
        if params.load_model is None:
            raise ConfigError(
                "[speculative] plugin = 'draft-model': this engine cannot load a second model; "
                "use ngram or suffix"
            )
        self.draft: DraftModel = params.load_model(
            options.model, dtype=options.dtype, num_pages=options.num_pages
        )
        self._returns_token_ids = type(self.draft.executor).returns_token_ids
        """The simulator's executor answers token ids (its time is the point), not logits."""
        self.vocab_size = min(params.vocab_size, self.draft.vocab_size)
        """Draft ids are argmaxes over the ids both models know."""
        self._shadows: dict[str, _Shadow] = {}
        """Per request id, in least recently drafted order (evicted first when pages run out)."""

    # -- the contract ---------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, slots: Sequence[DraftSlot]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in slots]
        rows: list[tuple[int, _Row]] = []
        budget = self.options.max_prefill_tokens
        wanted = {slot.request.request_id for slot in slots}
        for index, slot in enumerate(slots):
            row = self._prepare(slot, budget, wanted)
            if row is not None:
                budget -= len(row.tokens) - 1
                rows.append((index, row))
        # Pass 1 catches up (and drafts for the requests that caught up); each later pass
        # feeds the previous draft of the requests that want more.
        live = [row for _, row in rows]
        while live:
            tokens = self._forward(live)
            for row, token in zip(live, tokens, strict=True):
                if row.start + len(row.tokens) < row.shadow.request.num_tokens:
                    row.max_tokens = 0  # still catching up: no logits of use yet
                    continue
                row.drafts.append(token)
            for row in live:
                row.shadow.request.num_computed_tokens = row.start + len(row.tokens)
            live = [row for row in live if len(row.drafts) < row.max_tokens]
            for row in live:
                row.start += len(row.tokens)
                row.tokens = [row.drafts[-1]]
        for index, row in rows:
            shadow = row.shadow
            # The real tokens are computed; the drafts fed are so far only guesses.
            real = min(shadow.request.num_computed_tokens, shadow.request.num_tokens)
            shadow.fed = row.drafts[: len(row.drafts) - 1] if row.drafts else []
            shadow.request.num_computed_tokens = real
            self.draft.kv.commit(shadow.request)
            drafts[index] = row.drafts
        return drafts

    def remove(self, request: Request) -> None:
        shadow = self._shadows.pop(request.request_id, None)
        if shadow is not None:
            self.draft.kv.free(shadow.request)

    # -- the steps ------------------------------------------------------------------------

    def _prepare(self, slot: DraftSlot, budget: int, wanted: set[str]) -> _Row | None:
        """The slot's row of the first pass (its pages reserved), or None (no drafts)."""
        request = slot.request
        shadow = self._shadows.pop(request.request_id, None)
        if shadow is not None and not shadow.follows(request):
            self.draft.kv.free(shadow.request)  # another request with this id
            shadow = None
        if shadow is None:
            shadow = _Shadow(request)
        self._shadows[request.request_id] = shadow  # most recently drafted last
        mine = shadow.request
        self._credit_fed(shadow)
        num_tokens = mine.num_tokens
        # Its last token is fed again if it gained none since (same token, same K/V).
        mine.num_computed_tokens = min(mine.num_computed_tokens, num_tokens - 1)
        max_tokens = min(slot.max_tokens, self.draft.max_model_len - num_tokens + 1)
        if max_tokens < 1:
            return None
        # Room for the tokens it has not computed and the drafts fed after them.
        mine.draft_token_ids = [0] * (max_tokens - 1)
        try:
            if not self._allocate(mine, wanted):
                return None
        finally:
            mine.draft_token_ids = []
        start = mine.num_computed_tokens
        count = num_tokens - start
        if count - 1 > budget:
            count, max_tokens = max(1, budget + 1), 0  # catch up a chunk, draft nothing
        return _Row(shadow, _tokens(mine, start, count), start, [], max_tokens)

    def _credit_fed(self, shadow: _Shadow) -> None:
        """Count the drafts fed in the latest step that the request's tokens confirm (never
        its last token: that one must be fed to get the next logits)."""
        mine = shadow.request
        last = mine.num_tokens - 1
        for token in shadow.fed:
            position = mine.num_computed_tokens
            if position >= last or _token_at(mine, position) != token:
                break
            mine.num_computed_tokens += 1
        shadow.fed = []

    def _allocate(self, mine: Request, wanted: set[str]) -> bool:
        """Reserve ``mine``'s pages (its tokens and ``draft_token_ids``), evicting requests
        not drafting this step (least recently drafted first) while the pool is short."""
        kv = self.draft.kv
        needed = mine.num_tokens + len(mine.draft_token_ids)
        while True:
            admitting = not kv.block_table(mine)
            allocation = kv.allocate(mine, needed - mine.num_computed_tokens)
            if allocation is not None:
                if admitting:
                    mine.num_computed_tokens += allocation.num_cached_tokens
                if len(kv.block_table(mine)) * self.draft.page_size >= needed:
                    return True
                continue  # admitted (room for its tokens only): now grow into the drafts'
            idle = next((i for i in self._shadows if i not in wanted), None)
            if idle is None:
                return False
            evicted = self._shadows.pop(idle)
            kv.free(evicted.request)

    def _forward(self, rows: list[_Row]) -> list[int]:
        """One forward pass of the draft model over ``rows``: the argmax after each row's
        last token."""
        kv = self.draft.kv
        chunks = [
            SeqChunk(row.tokens, row.start, kv.block_table(row.shadow.request)) for row in rows
        ]
        order = sorted(range(len(rows)), key=lambda i: not chunks[i].is_decode)  # decodes first
        batch = build_model_input([chunks[i] for i in order], self.draft.page_size)
        output = self.draft.executor.execute(batch)
        if self._returns_token_ids:
            tokens = (output % self.vocab_size).tolist()
        else:
            tokens = output[:, : self.vocab_size].argmax(dim=-1).tolist()
        answer = [0] * len(rows)
        for position, i in enumerate(order):
            answer[i] = int(tokens[position])
        return answer


def _token_at(request: Request, position: int) -> int:
    prompt = request.prompt_token_ids
    if position < len(prompt):
        return prompt[position]
    return request.output_token_ids[position - len(prompt)]


def _tokens(request: Request, start: int, count: int) -> list[int]:
    prompt, output = request.prompt_token_ids, request.output_token_ids
    end = start + count
    if start >= len(prompt):
        return output[start - len(prompt) : end - len(prompt)]
    return [*prompt[start:end], *output[: max(0, end - len(prompt))]]
