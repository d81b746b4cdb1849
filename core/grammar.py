"""The structured-output station: core's manager over one grammar backend.

One object follows a constrained request from admission to its end:

- admission (``EngineCore.admit``) starts the compile once per prompt (:meth:`prepare`);
- while it compiles the request waits here with status ``WAITING_FOR_GRAMMAR``, holding
  no KV pages and unknown to the scheduler (:meth:`hold`); :meth:`take_ready` hands it to
  the scheduler once compiled, or reports it refused when its grammar is invalid;
- it gets one matcher when it first takes a batch row, kept for its whole life: a preempted
  request keeps its matcher and comes back exactly where it stopped;
- each step the constrained rows' token bitmasks are filled on the host (:meth:`begin_step`,
  after the forward pass is launched), their logits masked after every other logits stage
  (:meth:`apply`), the sampled tokens accepted (:meth:`accept_batch`), and rows whose grammar
  has ended reported (:meth:`finished_rows`).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Sequence
from typing import Any

import torch

from brigade.interfaces import (
    GrammarBackend,
    GrammarMatcher,
    LogitsProcessor,
    Request,
    RequestStatus,
    SamplingParams,
)

__all__ = ["GrammarManager"]

logger = logging.getLogger(__name__)


class GrammarManager(LogitsProcessor):
    """Waiting requests, matchers and the step's masks of one engine.

    Core's own last logits stage (the sampling stage runs it after the sampler's chain, with
    the same failure isolation: a matcher that raises fails its request alone). It is not a
    plugin: backends implement ``GrammarBackend``.
    """

    def __init__(
        self,
        backend: GrammarBackend,
        name: str,
        *,
        max_num_seqs: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.backend = backend
        self.name = name
        self.vocab_size = vocab_size
        self.device = device
        self._waiting: dict[str, tuple[Request, concurrent.futures.Future[Any]]] = {}
        """Requests whose grammar is compiling, in arrival order, with the compile."""
        self._compiled: dict[str, concurrent.futures.Future[Any]] = {}
        """Each live constrained request's compile (done), until it gets its matcher."""
        self._matchers: dict[str, GrammarMatcher] = {}
        """Each constrained request's matcher, from its first row to its end."""
        self._rows: dict[int, GrammarMatcher] = {}
        """The matchers of the constrained requests holding a batch row."""
        self._bitmask = torch.full((max_num_seqs, -(-vocab_size // 32)), -1, dtype=torch.int32)
        self._step: tuple[list[int], torch.Tensor] | None = None
        self._finished: list[int] = []

    # -- admission ----------------------------------------------------------------------

    def prepare(self, params: SamplingParams) -> concurrent.futures.Future[Any] | None:
        """Start compiling the request's grammar (thread-safe); None without one."""
        spec = params.structured_output
        return None if spec is None else self.backend.compile(spec)

    def hold(self, request: Request, job: concurrent.futures.Future[Any]) -> bool:
        """Keep a new request until its grammar is compiled; False when it already is (queue
        it now). Raises ``ValueError`` when the compile already failed."""
        self._compiled[request.request_id] = job
        if job.done():
            error = job.exception()
            if error is not None:
                del self._compiled[request.request_id]
                raise ValueError(str(error))
            return False
        request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self._waiting[request.request_id] = (request, job)
        return True

    def take_ready(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose compile finished since the last call (arrival order): those to
        queue now, and those refused, with why."""
        ready: list[Request] = []
        refused: list[tuple[Request, str]] = []
        for request_id, (request, job) in list(self._waiting.items()):
            if not job.done():
                continue
            del self._waiting[request_id]
            error = job.exception()
            if error is None:
                ready.append(request)
            else:
                self._compiled.pop(request_id, None)
                refused.append((request, str(error)))
        return ready, refused

    def wait(self, timeout: float) -> None:
        """Block until a waiting compile is done, or ``timeout`` seconds (nothing else to do)."""
        if self._waiting:
            concurrent.futures.wait(
                [job for _, job in self._waiting.values()],
                timeout=timeout,
                return_when=concurrent.futures.FIRST_COMPLETED,
            )

    @property
    def num_waiting(self) -> int:
        """Requests waiting for their grammar."""
        return len(self._waiting)

    def drop(self, request: Request) -> None:
        """Forget a request that ended (finished, aborted, failed), wherever it was here."""
        request_id = request.request_id
        self._waiting.pop(request_id, None)
        self._compiled.pop(request_id, None)
        self._matchers.pop(request_id, None)

    # -- rows ---------------------------------------------------------------------------

    def add(self, row: int, request: Request) -> None:
        """Bind the request's matcher to its row: its own after a preemption (still where it
        stopped), else a new one, which replays any tokens already emitted."""
        if request.sampling_params.structured_output is None:
            return
        matcher = self._matchers.get(request.request_id)
        if matcher is None:
            job = self._compiled.pop(request.request_id, None)
            if job is None:  # not held at admission (a front end that skipped it)
                job = self.prepare(request.sampling_params)
                assert job is not None
            matcher = self.backend.matcher(job.result())
            for token in request.output_token_ids:
                if not matcher.accept(token):
                    raise RuntimeError(
                        f"emitted token {token} does not match the request's grammar"
                    )
            self._matchers[request.request_id] = matcher
        self._rows[row] = matcher

    def remove(self, row: int) -> None:
        """The row is free; its request keeps its matcher until :meth:`drop`."""
        self._rows.pop(row, None)

    @property
    def is_active(self) -> bool:
        return bool(self._rows)

    def is_position_independent(self, request: Request) -> bool:
        """True for a request without structured output (its rows are left alone)."""
        return request.sampling_params.structured_output is None

    # -- the step -----------------------------------------------------------------------

    def begin_step(self, rows: Sequence[int]) -> None:
        """Fill the bitmasks of the constrained rows among ``rows`` and start their copy."""
        matchers = self._rows
        indices = [index for index, row in enumerate(rows) if row in matchers]
        if not indices:
            self._step = None
            return
        if len(rows) > self._bitmask.shape[0]:  # speculating rows sample several positions
            self._bitmask = torch.full((len(rows), self._bitmask.shape[1]), -1, dtype=torch.int32)
        bitmask = self._bitmask[: len(rows)]
        for index in indices:
            matchers[rows[index]].fill_bitmask(self._bitmask, index)
        self._step = (indices, bitmask.to(self.device, non_blocking=True))

    def apply(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Mask the constrained rows' logits to what their grammar allows (last stage)."""
        if self._step is None:
            return logits
        indices, bitmask = self._step
        self._step = None
        self.backend.apply_bitmask(logits, bitmask, indices)
        return logits

    def accept_batch(self, rows: Sequence[int], token_ids: Sequence[int]) -> None:
        """Advance the constrained rows' matchers on the sampled tokens."""
        matchers = self._rows
        for row, token in zip(rows, token_ids, strict=True):
            matcher = matchers.get(row)
            if matcher is None:
                continue
            if not matcher.accept(token):
                # Only reachable if a stage or the sampler ignored the mask: end the row
                # rather than let it continue unconstrained.
                logger.error("row %d: token %d rejected by its grammar; finishing it", row, token)
                self._finished.append(row)
            elif matcher.is_terminated():
                self._finished.append(row)

    def finished_rows(self) -> set[int]:
        """Rows whose grammar ended with the latest :meth:`accept_batch`."""
        finished, self._finished = self._finished, []
        return set(finished)

    def rollback(self, row: int, num_tokens: int) -> None:
        """Undo the row's last ``num_tokens`` accepted tokens (speculative decoding)."""
        matcher = self._rows.get(row)
        if matcher is not None:
            matcher.rollback(num_tokens)

    def shutdown(self) -> None:
        self.backend.shutdown()
