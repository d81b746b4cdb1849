"""The sampling half of an engine step, with each failure kept to the request that caused it.

One step samples every row at once: the active logits processors (``begin_step``, then
``apply`` in order; core's grammar station is the last of them), the sampler, then the
logprobs the rows asked for. When that raises, the
stage does not know whose row made it fail, and the processors may already have edited the
logits in place; so it recomputes the logits (the caller reruns the forward pass, which
rewrites the same KV) and samples each row on its own. The rows that fail again are reported
as failures (core fails those requests alone); every other row keeps the token it drew on its
own, which for a greedy or seeded row is the token the batch would have given it.

A row whose distribution is undefined (NaN logits, or every token masked) comes back from the
sampler as an id outside the vocabulary (the standard sampler answers -1); it fails alone too.
None of this costs the normal path anything but a ``try`` and a ``min``/``max`` over the ids.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from brigade.errors import describe
from brigade.grammar import GrammarManager
from brigade.interfaces import LogitsProcessor, Request, Sampler

if TYPE_CHECKING:
    from brigade.persistent_batch import PersistentBatch

__all__ = [
    "DraftRows",
    "SampledTokens",
    "SamplingStage",
    "TokenLogprob",
    "supports_rollback",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

UNDEFINED_DISTRIBUTION = (
    "its sampling distribution is undefined (the logits are NaN, or its sampling parameters "
    "mask every token)"
)


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log probability of a sampled token and the top alternatives at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class SampledTokens:
    """One token per sampled row, and the rows that failed."""

    token_ids: list[int]
    """One id per row; a failed row's entry is meaningless."""
    logprobs: list[TokenLogprob | None] | None
    """Per row when any row asked for logprobs, else None."""
    failures: dict[int, str]
    """Index of a failed row (in the step's sampled rows) -> why its request failed."""
    drafts_checked: bool = True
    """False when the step fell back to sampling row by row: the tokens at draft positions
    were drawn without the logits stages' state after the drafts, so no draft is accepted."""
    skipped: frozenset[int] = frozenset()
    """Indices of rows not sampled: their grammar's mask was late, or their grammar ended or
    failed (``GrammarManager.take_ended``). Their entries in ``token_ids`` are meaningless."""


@dataclasses.dataclass(frozen=True, slots=True)
class DraftRows:
    """A request that verifies drafts in this step, as the sampling stage sees it."""

    request: Request
    row: int
    """Its persistent row."""
    offset: int
    """The logits row of its last token; its drafts' positions follow it."""
    tokens: list[int]
    """Its drafts: ``tokens[j]`` is the input of logits row ``offset + j + 1``, so the token
    sampled at row ``offset + j`` verifies it."""


def supports_rollback(processor: LogitsProcessor) -> bool:
    """Whether ``processor`` overrides :meth:`LogitsProcessor.rollback` (so it can be advanced
    through a request's drafts and back)."""
    return type(processor).rollback is not LogitsProcessor.rollback


class _StageError(Exception):
    """A station raised while sampling; ``what`` names it for the request's error."""

    def __init__(self, what: str, cause: BaseException) -> None:
        super().__init__(what)
        self.what = what
        self.cause = cause

    def reason(self) -> str:
        return f"{self.what} failed for this request: {describe(self.cause)}"


class SamplingStage:
    """The logits-processor chain and the sampler of one engine, over its persistent batch."""

    def __init__(
        self,
        sampler: Sampler,
        sampler_name: str,
        processors: Sequence[LogitsProcessor],
        batch: PersistentBatch,
        device: torch.device,
        vocab_size: int,
    ) -> None:
        self.sampler = sampler
        self.sampler_name = sampler_name
        self.processors = list(processors)
        self.batch = batch
        self.device = device
        self.vocab_size = vocab_size

    # -- rows ---------------------------------------------------------------------------

    def add(self, row: int, request: Request) -> str | None:
        """Register ``request``'s row with every processor; the reason if one refused it."""
        for processor in self.processors:
            try:
                processor.add(row, request)
            except Exception as exc:
                return _StageError(_name(processor), exc).reason()
        return None

    def remove(self, row: int, request: Request) -> None:
        """Unregister ``row`` from every processor; a processor that raises is logged."""
        for processor in self.processors:
            try:
                processor.remove(row)
            except Exception as exc:
                logger.error(
                    "%s failed to release request %s: %s",
                    _name(processor),
                    request.request_id,
                    describe(exc),
                )

    # -- the step -----------------------------------------------------------------------

    def sample(
        self,
        logits: torch.Tensor,
        rows: list[int],
        recompute: Callable[[], torch.Tensor],
        drafts: Sequence[DraftRows] = (),
        *,
        patience_s: float | None = None,
    ) -> SampledTokens:
        """Sample one token for each logits row of ``logits`` [S, vocab]; ``rows`` [S] are
        their persistent rows (a request verifying drafts has one per position, in order).

        ``drafts`` lists the requests verifying drafts. Where a logits stage depends on a
        drafting request's tokens (its grammar), the stages run position by position: each
        is advanced through the drafts before the next position and rolled back after, so
        the logits at a draft's position are edited as if the drafts before it had been
        accepted. ``recompute`` returns the step's logits again (used only after a failure).
        ``patience_s`` is how long the step may wait for a late grammar mask before the row
        sits the step out (``GrammarManager.begin_step``).
        """
        try:
            tokens, logprobs, skipped = self._sample_rows(logits, rows, drafts, patience_s)
        except _StageError as failure:
            logger.warning(
                "sampling a batch of %d rows failed (%s); sampling each row alone",
                len(rows),
                failure.reason(),
            )
            sampled = self._sample_one_by_one(recompute(), rows)
            return dataclasses.replace(sampled, drafts_checked=not drafts)
        failures: dict[int, str] = {}
        if tokens and (min(tokens) < 0 or max(tokens) >= self.vocab_size):
            failures = self._out_of_vocabulary(tokens, skipped)
        return SampledTokens(tokens, logprobs, failures, skipped=frozenset(skipped))

    def accept(
        self, rows: list[int], token_ids: list[int], *, one_per_row: bool = False
    ) -> dict[int, str]:
        """Give each processor the step's tokens; index of a failed row -> why.

        A processor whose ``accept_batch`` raises is given the rows one at a time to find
        the ones it fails for (the contract asks it to raise before recording anything).
        With ``one_per_row`` (each row's one token of the step) the grammar takes them off
        the step thread (``GrammarManager.advance``).
        """
        failures: dict[int, str] = {}
        for processor in self.processors:
            if not processor.needs_tokens:
                continue
            try:
                if one_per_row and isinstance(processor, GrammarManager):
                    processor.advance(rows, token_ids)
                    continue
                processor.accept_batch(rows, token_ids)
            except Exception:
                for index, (row, token) in enumerate(zip(rows, token_ids, strict=True)):
                    try:
                        processor.accept_batch([row], [token])
                    except Exception as exc:
                        failures.setdefault(index, _StageError(_name(processor), exc).reason())
        return failures

    def finished_rows(self, grammar: GrammarManager) -> set[int]:
        """Rows whose grammar is complete (none when the station fails to say: logged)."""
        try:
            return grammar.finished_rows()
        except Exception as exc:
            logger.error("%s failed to report finished rows: %s", _name(grammar), describe(exc))
            return set()

    # -- internals ----------------------------------------------------------------------

    def _sample_rows(
        self,
        logits: torch.Tensor,
        rows: list[int],
        drafts: Sequence[DraftRows] = (),
        patience_s: float | None = None,
    ) -> tuple[list[int], list[TokenLogprob | None] | None, set[int]]:
        """The rows' tokens and logprobs, and the indices of the rows not sampled (-1)."""
        active = [processor for processor in self.processors if processor.is_active]
        batch = self.batch.sampling_batch(rows, self.device)
        skipped: set[int] = set()
        if drafts and _depends_on_drafts(active, drafts):
            logits = self._apply_by_position(logits, rows, drafts, active)
        else:
            for processor in active:  # host work (bitmasks) while the device runs the model
                if isinstance(processor, GrammarManager):
                    _guarded(_name(processor), processor.begin_step, rows, patience_s)
                    skipped = set(processor.skipped_indices())
                else:
                    _guarded(_name(processor), processor.begin_step, rows)
            for processor in active:
                logits = _guarded(_name(processor), processor.apply, logits, batch.rows)
        sampled_rows = rows
        if skipped:  # rare: sample only the others (no seeded generator advances for them)
            kept = [index for index in range(len(rows)) if index not in skipped]
            if not kept:
                return [-1] * len(rows), None, skipped
            sampled_rows = [rows[index] for index in kept]
            logits = logits[kept]
            batch = self.batch.sampling_batch(sampled_rows, self.device)
        sampler = f"the sampler {self.sampler_name!r}"
        result = _guarded(sampler, self.sampler.sample, logits, batch)
        tokens: list[int] = result.token_ids.tolist()  # the step's one device-to-host sync
        logprobs: list[TokenLogprob | None] | None = None
        if result.logprobs is not None and result.logprob_token_ids is not None:
            values, ids = result.logprobs.tolist(), result.logprob_token_ids.tolist()
            logprobs = []
            for index, row in enumerate(sampled_rows):
                wanted = self.batch.num_logprobs[row]
                top = tuple(
                    zip(ids[index][1 : 1 + wanted], values[index][1 : 1 + wanted], strict=True)
                )
                logprobs.append(
                    TokenLogprob(ids[index][0], values[index][0], top) if wanted >= 0 else None
                )
        if skipped:
            tokens, logprobs = _spread(tokens, logprobs, len(rows), skipped)
        return tokens, logprobs, skipped

    def _apply_by_position(
        self,
        logits: torch.Tensor,
        rows: list[int],
        drafts: Sequence[DraftRows],
        active: list[LogitsProcessor],
    ) -> torch.Tensor:
        """Run the stages over the logits rows one draft position at a time (see
        :meth:`sample`); a draft the stages mask at its position ends its request's walk
        (verification rejects it there, so the positions after it are never used)."""
        trackers = [p for p in active if p.needs_tokens and supports_rollback(p)]
        draft_position: set[int] = set()
        for draft in drafts:
            draft_position.update(range(draft.offset + 1, draft.offset + 1 + len(draft.tokens)))
        indices = [i for i in range(len(rows)) if i not in draft_position]  # position 0
        walking = list(range(len(drafts)))  # the drafts still being walked through
        advanced = [[0] * len(drafts) for _ in trackers]  # per tracker, per draft: accepted
        position = 0
        try:
            while True:
                logits = self._apply_at(logits, rows, indices, active)
                walking = [i for i in walking if len(drafts[i].tokens) > position]
                if not walking:
                    break
                offsets = [drafts[i].offset + position for i in walking]
                tokens = [drafts[i].tokens[position] for i in walking]
                allowed = (logits[offsets, tokens] > float("-inf")).tolist()
                walking = [i for i, ok in zip(walking, allowed, strict=True) if ok]
                if not walking:
                    break
                walked_rows = [drafts[i].row for i in walking]
                tokens = [drafts[i].tokens[position] for i in walking]
                for counts, processor in zip(advanced, trackers, strict=True):
                    _guarded(_name(processor), processor.accept_batch, walked_rows, tokens)
                    for i in walking:
                        counts[i] += 1
                position += 1
                indices = [drafts[i].offset + position for i in walking]
        finally:
            for counts, processor in zip(advanced, trackers, strict=True):
                for i, count in enumerate(counts):
                    if count:
                        _guarded(_name(processor), processor.rollback, drafts[i].row, count)
                if isinstance(processor, GrammarManager):
                    processor.finished_rows()  # what the walk marked finished is not finished
        return logits

    def _apply_at(
        self,
        logits: torch.Tensor,
        rows: list[int],
        indices: list[int],
        active: list[LogitsProcessor],
    ) -> torch.Tensor:
        """Apply the stages to the logits rows ``indices`` (one position of each request)."""
        subset_rows = [rows[i] for i in indices]
        index = torch.tensor(indices, dtype=torch.int64, device=logits.device)
        row_index = torch.tensor(subset_rows, dtype=torch.int64, device=logits.device)
        subset = logits.index_select(0, index)
        for processor in active:
            _guarded(_name(processor), processor.begin_step, subset_rows)
        for processor in active:
            subset = _guarded(_name(processor), processor.apply, subset, row_index)
        logits.index_copy_(0, index, subset)
        return logits

    def _sample_one_by_one(self, logits: torch.Tensor, rows: list[int]) -> SampledTokens:
        tokens: list[int] = []
        logprobs: list[TokenLogprob | None] = []
        any_logprobs = False
        failures: dict[int, str] = {}
        skipped: set[int] = set()
        for index, row in enumerate(rows):
            try:
                row_tokens, row_logprobs, row_skipped = self._sample_rows(
                    logits[index : index + 1], [row]
                )
            except _StageError as failure:
                failures[index] = failure.reason()
                tokens.append(-1)
                logprobs.append(None)
                continue
            token = row_tokens[0]
            if row_skipped:
                skipped.add(index)
            elif not 0 <= token < self.vocab_size:
                failures[index] = self._token_failure(token)
            tokens.append(token)
            any_logprobs = any_logprobs or row_logprobs is not None
            logprobs.append(None if row_logprobs is None else row_logprobs[0])
        return SampledTokens(
            tokens, logprobs if any_logprobs else None, failures, skipped=frozenset(skipped)
        )

    def _out_of_vocabulary(self, tokens: list[int], skipped: set[int]) -> dict[int, str]:
        return {
            index: self._token_failure(token)
            for index, token in enumerate(tokens)
            if not 0 <= token < self.vocab_size and index not in skipped
        }

    def _token_failure(self, token: int) -> str:
        if token == -1:
            return UNDEFINED_DISTRIBUTION
        return (
            f"the sampler {self.sampler_name!r} returned token id {token}, outside the "
            f"vocabulary [0, {self.vocab_size})"
        )


def _spread(
    tokens: list[int],
    logprobs: list[TokenLogprob | None] | None,
    num_rows: int,
    skipped: set[int],
) -> tuple[list[int], list[TokenLogprob | None] | None]:
    """The kept rows' tokens (and logprobs) at their places among ``num_rows``; -1 (and
    None) at the skipped ones."""
    sampled = iter(tokens)
    spread = [-1 if index in skipped else next(sampled) for index in range(num_rows)]
    if logprobs is None:
        return spread, None
    sampled_logprobs = iter(logprobs)
    return spread, [
        None if index in skipped else next(sampled_logprobs) for index in range(num_rows)
    ]


def _depends_on_drafts(active: Sequence[LogitsProcessor], drafts: Sequence[DraftRows]) -> bool:
    """Whether an active stage edits a drafting request's rows by the tokens before them."""
    return any(
        not _guarded(_name(p), p.is_position_independent, d.request) for p in active for d in drafts
    )


def _guarded(what: str, call: Callable[..., T], *args: Any) -> T:
    try:
        return call(*args)
    except Exception as exc:
        raise _StageError(what, exc) from exc


def _name(processor: LogitsProcessor) -> str:
    if isinstance(processor, GrammarManager):
        return f"the grammar backend {processor.name!r}"
    return f"the logits processor {type(processor).__name__}"
