"""Sampler and LogitsProcessor: from a batch of logits to token ids."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

from brigade.interfaces.request import Request

if TYPE_CHECKING:
    import torch

    from brigade.interfaces.model import Checkpoint

__all__ = ["LogitsProcessor", "SampleOutput", "Sampler", "SamplerParams", "SamplingBatch"]


@dataclasses.dataclass(frozen=True, slots=True)
class SamplerParams:
    """What core hands samplers and logits processors at construction."""

    max_num_seqs: int
    """Persistent-batch rows: every ``row`` argument is below this."""
    vocab_size: int
    device: str
    model_dir: str | None = None
    """Where the served model's files are (a directory or a GGUF file); None when there are
    none (unit tests). Read the tokenizer through :attr:`checkpoint`."""
    eos_token_ids: tuple[int, ...] = ()
    """Token ids that end a generation (the model's EOS ids)."""
    checkpoint: Checkpoint | None = None
    """The opened model, for stages that need the vocabulary's strings (grammars, banned
    words: ``checkpoint.tokenizer()``); None when there is none (API 1.2)."""
    logits_processors: tuple[LogitsProcessor, ...] = ()
    """The configured logits processors (``[sampler] logits_processors``), built by core in
    config order. A sampler must return each of them from :meth:`Sampler.logits_processors`,
    in this order (see there); empty in the params a logits processor is built with."""


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Per-row sampling parameters of the rows sampled this step (row i = logits row i).

    Core gathers these from the persistent batch once per step. The flags are computed on
    the host, so a sampler can pick fast paths without a device sync.
    """

    rows: torch.Tensor
    """[S] int64 persistent-batch row of each sampled row (logits processors key on it)."""
    temperature: torch.Tensor
    """[S] float32; 0 = greedy."""
    top_k: torch.Tensor
    """[S] int64; 0 = off."""
    top_p: torch.Tensor
    """[S] float32; 1 = off."""
    min_p: torch.Tensor
    """[S] float32; 0 = off."""
    generators: Mapping[int, torch.Generator]
    """Sampled-row index -> that request's own generator (requests with a seed only)."""
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_num_logprobs: int | None
    """Largest top-N any row asked for; None when no row wants logprobs."""


@dataclasses.dataclass(frozen=True, slots=True)
class SampleOutput:
    token_ids: torch.Tensor
    """[num_rows] int64 sampled ids (the step's one device-to-host sync reads these). A row
    that cannot be sampled (NaN logits, every token masked) may be answered with -1: core
    fails that row's request alone, as it does for any id outside the vocabulary."""
    logprobs: torch.Tensor | None = None
    """[num_rows, 1 + N] float32, N = ``batch.max_num_logprobs``: the sampled token's log
    probability, then the top-N in descending order (rows that asked for fewer ignore the
    extra columns)."""
    logprob_token_ids: torch.Tensor | None = None
    """[num_rows, 1 + N] int64 token ids matching ``logprobs``."""


class LogitsProcessor(abc.ABC):
    """One stage of the chain that edits logits before sampling (penalties, bias, bans).

    A registered ``logits_processor`` component is constructed as ``factory(params:
    SamplerParams, options)`` when ``[sampler] logits_processors`` names it; it sees every
    request of the engine (its options decide what it does to each).

    Rows are persistent-batch rows: a request keeps its row while it runs. State is kept per
    row in tensors so :meth:`apply` is one vectorised call for the whole batch; rows never
    registered with :meth:`add`, or removed since, must be left untouched.

    Lifecycle: core calls :meth:`add` when a request takes a row (again after a preemption,
    with its emitted tokens already in ``request.output_token_ids``), :meth:`begin_step` and
    :meth:`apply` each step while :attr:`is_active`, :meth:`accept_batch` with every step's
    sampled tokens, and :meth:`remove` when the request leaves its row.

    Failures stay with the request that caused them: when :meth:`add` raises, that request
    fails alone (its client gets the exception's message). When :meth:`begin_step`,
    :meth:`apply` or the sampler raises, core recomputes the step's logits (``apply`` may have
    edited them in place) and samples each row on its own, then fails the rows that raise
    again. When :meth:`accept_batch` raises, core retries it one row at a time, so it must
    raise before recording anything. A :meth:`remove` that raises is logged.

    Structured output is not a logits processor: it is its own station (a
    ``GrammarBackend``, ``[grammar]``), whose mask core applies after every processor.
    """

    needs_tokens: ClassVar[bool] = True
    """False when :meth:`accept_batch` is a no-op, so core can skip the call."""

    @abc.abstractmethod
    def add(self, row: int, request: Request) -> None:
        """Start tracking ``request`` in ``row`` (a no-op when it needs nothing here)."""

    @abc.abstractmethod
    def remove(self, row: int) -> None:
        """Forget ``row``; it may be reused by another request."""

    @property
    @abc.abstractmethod
    def is_active(self) -> bool:
        """True while any row needs this stage (core skips :meth:`apply` otherwise)."""

    @abc.abstractmethod
    def apply(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Edit ``logits`` [S, vocab] (in place allowed) for persistent rows ``rows`` [S]."""

    def accept_batch(self, rows: Sequence[int], token_ids: Sequence[int]) -> None:
        """Record one accepted token per row (default: :meth:`accept` per row)."""
        for row, token in zip(rows, token_ids, strict=True):
            self.accept(row, [token])

    def accept(self, row: int, token_ids: Sequence[int]) -> None:  # noqa: B027 - optional
        """Record tokens accepted for ``row``; stages that track no tokens ignore this."""

    def is_position_independent(self, request: Request) -> bool:
        """True when what :meth:`apply` does to ``request``'s row does not depend on the tokens
        it accepts from now on (API 2.4): one application is then right at every position of
        a step that verifies its draft tokens (speculative decoding). A request speculates only
        when every stage answers True or implements :meth:`rollback` (core then applies such a
        stage position by position, accepting each draft and rolling back after). Default:
        ``not needs_tokens``; a stage that tracks tokens answers True for requests it leaves
        alone (no penalty, say)."""
        return not self.needs_tokens

    def rollback(self, row: int, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding): afterwards
        :meth:`apply` edits the row exactly as before they were accepted
        (``check_logits_processor`` checks it). Core rolls back at most 64 tokens at a time."""
        raise NotImplementedError(f"{type(self).__name__} does not support rollback")

    def begin_step(self, rows: Sequence[int]) -> None:  # noqa: B027 - optional
        """Host-side work for the coming :meth:`apply`, given the persistent rows it will see
        (in logits order). Core calls it after launching the model step, so on a GPU this
        work (e.g. a look-up of recent tokens) overlaps the forward pass."""


class Sampler(abc.ABC):
    """Chooses one token per row, vectorised over the batch.

    Constructed as ``factory(params: SamplerParams, options)``. Per-request parameters arrive
    as per-row tensors in a :class:`SamplingBatch`; a sampler never loops over requests in
    Python on the hot path (seeded rows may draw from their own generators). Its
    :meth:`logits_processors` run, in order, before :meth:`sample`.

    A request's ``logit_bias``, penalties and ``min_tokens`` are the sampler's to apply, as
    logits processors (``brigade.plugins.samplers.processors`` has the built-in ones), as
    are the configured ``params.logits_processors``.
    """

    def logits_processors(self) -> Sequence[LogitsProcessor]:
        """The stages this sampler wants applied before it (penalties, bias, bans ...).

        Every one of ``params.logits_processors`` appears, in config order, after the stages
        that apply a request's ``logit_bias`` and penalties (a configured processor sees the
        request's own edits, and a request cannot bias its way past an engine-wide ban) and
        before the stages that mask tokens a request must not emit yet (``min_tokens``), so
        that no configured processor can re-enable a token they forbid. Core masks a
        request's grammar after all of them.
        """
        return ()

    @abc.abstractmethod
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        """logits: [S, vocab] float32 after the logits-processor chain (may be modified).

        Log probabilities, when asked for, are those of these logits (after the processors,
        before temperature, top-k/p and min-p).
        """
