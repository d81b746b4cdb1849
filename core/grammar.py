"""The structured-output station: core's manager over one grammar backend.

One object follows a constrained request from admission to its end:

- admission (``EngineCore.admit``) starts the compile once per prompt (:meth:`prepare`);
- while it compiles the request waits here with status ``WAITING_FOR_GRAMMAR``, holding
  no KV pages and unknown to the scheduler (:meth:`hold`); :meth:`take_ready` hands it to
  the scheduler once compiled, or reports it refused when its grammar is invalid; a request
  that leaves meanwhile cancels its compile (:meth:`drop`);
- it gets one matcher when it first takes a batch row, kept for its whole life in a
  :class:`~brigade.grammar_lane.GrammarLane`: a preempted request keeps it and comes back
  exactly where it stopped;
- every call on a matcher runs off the step thread, within ``[grammar] mask_budget_ms``
  (``brigade.grammar_lane``). After a step the sampled token is accepted and the next mask
  filled while the engine goes on (:meth:`advance`), waited for a little before the next
  forward pass (:meth:`settle`); the next step masks each constrained row with it
  (:meth:`begin_step`, then :meth:`apply` after every other logits stage). A row whose mask
  is late sits the step out rather than hold up the others (:meth:`skipped_indices`; core
  recomputes its token next step); a request whose grammar ended, or whose matcher overran
  the budget, is reported to core (:meth:`take_ended`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from brigade.grammar_lane import GrammarLane, LanePool
from brigade.interfaces import (
    GrammarBackend,
    LogitsProcessor,
    Request,
    RequestStatus,
    SamplingParams,
)

__all__ = ["DEFAULT_MASK_BUDGET_S", "SAMPLING_PATIENCE_S", "GrammarManager"]

logger = logging.getLogger(__name__)

DEFAULT_MASK_BUDGET_S = 0.1
"""``[grammar] mask_budget_ms``'s default, in seconds (for managers built outside an engine)."""
LATE_MASK_SHARE = 0.25
"""Before a step's forward pass, masks still being computed are waited for at most this share
of the previous forward pass: one slow grammar stretches the other requests' steps by a
quarter at most, and the usual quick masks are done before the forward pass starts instead
of competing with it for the CPU."""
MIN_PATIENCE_S = 0.002
SAMPLING_PATIENCE_S = 0.002
"""At sampling, a mask still late is waited for this long at most; its row then sits the step
out."""


class GrammarManager(LogitsProcessor):
    """Waiting requests, matchers and the step's masks of one engine.

    Core's own last logits stage (the sampling stage runs it after the sampler's chain, with
    the same failure isolation). It is not a plugin: backends implement ``GrammarBackend``.
    """

    def __init__(
        self,
        backend: GrammarBackend,
        name: str,
        *,
        max_num_seqs: int,
        vocab_size: int,
        device: torch.device,
        mask_budget_s: float = DEFAULT_MASK_BUDGET_S,
    ) -> None:
        self.backend = backend
        self.name = name
        self.vocab_size = vocab_size
        self.device = device
        self.mask_budget_s = mask_budget_s
        self._num_words = -(-vocab_size // 32)
        self._waiting: dict[str, tuple[Request, concurrent.futures.Future[Any]]] = {}
        """Requests whose grammar is compiling, in arrival order, with the compile."""
        self._compiled: dict[str, concurrent.futures.Future[Any]] = {}
        """Each live constrained request's compile, until it gets its matcher."""
        self._lanes: dict[str, GrammarLane] = {}
        """Each constrained request's matcher, from its first row to its end."""
        self._rows: dict[int, GrammarLane] = {}
        """The lanes of the constrained requests holding a batch row."""
        self._pool = LanePool(mask_budget_s, max(4, os.cpu_count() or 1))
        self._bitmask = torch.full((max_num_seqs, self._num_words), -1, dtype=torch.int32)
        self._step: tuple[list[int], torch.Tensor] | None = None
        self._skipped: set[int] = set()
        self._finished: list[int] = []
        self._ended: dict[str, tuple[Request, str | None]] = {}
        self.num_late = 0
        """Rows that sat a step out because their mask was late, so far."""
        self.num_over_budget = 0
        """Requests failed because their grammar overran the mask budget, so far."""

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
            error = None if job.cancelled() else job.exception()
            if error is not None or job.cancelled():
                del self._compiled[request.request_id]
                raise ValueError(str(error) if error is not None else "its compile was cancelled")
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
            error = "its compile was cancelled" if job.cancelled() else job.exception()
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
        """Forget a request that ended (finished, aborted, failed), wherever it was here; a
        compile it was still waiting for is cancelled (the backend stops it unless another
        request waits for the same grammar)."""
        request_id = request.request_id
        self._waiting.pop(request_id, None)
        job = self._compiled.pop(request_id, None)
        # A prompt's n choices share one compile: cancel it only when the last one leaves.
        if job is not None and not job.done() and job not in self._compiled.values():
            job.cancel()
        self._lanes.pop(request_id, None)  # a job still running on it finishes unread
        self._ended.pop(request_id, None)

    # -- rows ---------------------------------------------------------------------------

    def add(self, row: int, request: Request) -> None:
        """Bind the request's lane to its row: its own after a preemption (still where it
        stopped), else a new matcher, which replays any tokens already emitted and fills its
        first mask off the step thread."""
        if request.sampling_params.structured_output is None:
            return
        lane = self._lanes.get(request.request_id)
        if lane is None:
            job = self._compiled.pop(request.request_id, None)
            if job is None:  # not held at admission (a front end that skipped it)
                job = self.prepare(request.sampling_params)
                assert job is not None
            lane = GrammarLane(request, self.backend.matcher(job.result()), self._num_words)
            lane.replay(self._pool, request.output_token_ids)
            self._lanes[request.request_id] = lane
        self._rows[row] = lane

    def remove(self, row: int) -> None:
        """The row is free; its request keeps its lane until :meth:`drop`."""
        self._rows.pop(row, None)

    @property
    def is_active(self) -> bool:
        return bool(self._rows)

    def is_position_independent(self, request: Request) -> bool:
        """True for a request without structured output (its rows are left alone)."""
        return request.sampling_params.structured_output is None

    # -- the step -----------------------------------------------------------------------

    def settle(self, last_forward_s: float) -> None:
        """Before a forward pass: wait for the masks still being computed, a share of the
        last forward pass at most (:data:`LATE_MASK_SHARE`)."""
        busy = [lane for lane in self._rows.values() if lane.busy]
        if busy:
            self._pool.settle(busy, max(MIN_PATIENCE_S, LATE_MASK_SHARE * last_forward_s))

    def begin_step(self, rows: Sequence[int], patience_s: float | None = None) -> None:
        """Put the masks of the constrained rows among ``rows`` in the step's bitmask.

        A mask still being computed is waited for ``patience_s`` seconds at most (None, or
        when no row of the step could go on without waiting: as long as the budget allows);
        the rows left without a mask (late, ended, failed) are :meth:`skipped_indices`."""
        self._skipped = set()
        lanes = self._rows
        indices = [index for index, row in enumerate(rows) if row in lanes]
        if not indices:
            self._step = None
            return
        stepping = [lanes[rows[index]] for index in indices]
        for lane in stepping:
            if lane.usable and not lane.busy and not lane.mask_ready:
                lane.refill(self._pool)  # after a rollback, or a matcher that was late
        if len(indices) == len(rows) and all(lane.busy for lane in stepping):
            patience_s = None  # nobody in this step would go on meanwhile
        self._pool.settle(stepping, patience_s)
        if len(rows) > self._bitmask.shape[0]:  # speculating rows sample several positions
            self._bitmask = torch.full((len(rows), self._num_words), -1, dtype=torch.int32)
        bitmask = self._bitmask[: len(rows)]
        masked: list[int] = []
        for index, lane in zip(indices, stepping, strict=True):
            if lane.failure is not None or lane.ended:
                self._end(lane)
            elif lane.busy or not lane.mask_ready:
                self.num_late += 1  # it sits this step out
            else:
                bitmask[index] = lane.mask[0]
                masked.append(index)
                continue
            self._skipped.add(index)
        self._step = (masked, bitmask.to(self.device, non_blocking=True)) if masked else None

    def skipped_indices(self) -> set[int]:
        """Indices into the last :meth:`begin_step`'s ``rows`` that got no mask: their
        tokens must not be sampled (a late mask: recomputed next step; an ended or failed
        grammar: :meth:`take_ended`)."""
        return self._skipped

    def apply(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Mask the constrained rows' logits to what their grammar allows (last stage)."""
        if self._step is None:
            return logits
        indices, bitmask = self._step
        self._step = None
        self.backend.apply_bitmask(logits, bitmask, indices)
        return logits

    def advance(self, rows: Sequence[int], token_ids: Sequence[int]) -> None:
        """Give the constrained rows their sampled token and start filling their next mask,
        off the step thread: a grammar that ended with the token shows at the next
        :meth:`begin_step` (the row is skipped and its request reported by
        :meth:`take_ended`). The engine's usual path: one token per row."""
        lanes = self._rows
        advancing: list[tuple[GrammarLane, int]] = []
        for row, token in zip(rows, token_ids, strict=True):
            lane = lanes.get(row)
            if lane is not None and lane.usable:
                advancing.append((lane, token))
        self._pool.settle([lane for lane, _ in advancing if lane.busy], None)
        for lane, token in advancing:
            if lane.failure is None:
                lane.advance(self._pool, [token], final=True)

    def accept_batch(self, rows: Sequence[int], token_ids: Sequence[int]) -> None:
        """Advance the constrained rows' matchers on the tokens and wait for it (within the
        budget): rows whose grammar ended are then :meth:`finished_rows`. For steps that
        need the answer at once (several tokens per row, draft positions)."""
        lanes = self._rows
        stepping: list[tuple[int, GrammarLane, int]] = []
        for row, token in zip(rows, token_ids, strict=True):
            lane = lanes.get(row)
            if lane is not None and lane.usable:
                stepping.append((row, lane, token))
        self._settle_now([lane for _, lane, _ in stepping])
        for _, lane, token in stepping:
            if lane.failure is None:
                lane.advance(self._pool, [token], final=False)
        self._settle_now([lane for _, lane, _ in stepping])
        for row, lane, token in stepping:
            if lane.failure is not None:
                continue
            if lane.rejected:
                # Only reachable if a stage or the sampler ignored the mask: end the row
                # rather than let it continue unconstrained.
                logger.error("row %d: token %d rejected by its grammar; finishing it", row, token)
                self._finished.append(row)
            elif lane.terminated:
                self._finished.append(row)

    def finished_rows(self) -> set[int]:
        """Rows whose grammar ended with the latest :meth:`accept_batch`."""
        finished, self._finished = self._finished, []
        return set(finished)

    def rollback(self, row: int, num_tokens: int) -> None:
        """Undo the row's last ``num_tokens`` accepted tokens (speculative decoding)."""
        lane = self._rows.get(row)
        if lane is None or lane.failure is not None or not num_tokens:
            return
        self._settle_now([lane])
        if lane.failure is None:
            lane.rollback(self._pool, num_tokens)
            self._settle_now([lane])

    def take_ended(self) -> list[tuple[Request, str | None]]:
        """Requests to end since the last call: their grammar ended (None; finish them,
        reason ``stop``), or their matcher failed or overran the budget (why; the request
        is at fault)."""
        if not self._ended:
            return []
        ended = list(self._ended.values())
        self._ended = {}
        return ended

    def warm_up(self) -> None:
        """The backend's one-time set-up, now (``GrammarBackend.warm_up``)."""
        self.backend.warm_up()

    def shutdown(self) -> None:
        self._pool.shutdown()
        self.backend.shutdown()

    # -- internals ----------------------------------------------------------------------

    def _settle_now(self, lanes: list[GrammarLane]) -> None:
        """Wait for the lanes' jobs within the budget; report those that failed."""
        self._pool.settle(lanes, None)
        for lane in lanes:
            if lane.failure is not None:
                self._end(lane)

    def _end(self, lane: GrammarLane) -> None:
        request = lane.request
        if request.request_id not in self._lanes or request.request_id in self._ended:
            return
        if lane.failure is not None and lane.over_budget:
            self.num_over_budget += 1
        if lane.failure is None and lane.rejected and lane.ended:
            logger.error(
                "request %s: a token was rejected by its grammar; finishing it", request.request_id
            )
        self._ended[request.request_id] = (request, lane.failure)
