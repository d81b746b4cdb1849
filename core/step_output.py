"""What becomes of a step's sampled tokens: the :class:`StepOutputProcessor`.

After the forward pass and the sampling stage, one call, :meth:`StepOutputProcessor.process`,
takes the step to its end, in this order:

1. the tokens each sampled request emits (its one sampled token, or with speculative decoding
   its accepted drafts and the token after them: ``Speculation.verify``), and the requests
   whose row failed;
2. the embedding requests' hidden states, pooled (``Pooler.collect``);
3. the requests whose grammar ended or failed since the last step, and those whose mask was
   late (their rows sit the step out: ``held_back``);
4. the remaining tokens written to the persistent batch and given to the logits processors
   (``record_tokens``), then appended to their requests up to a stop (finish detection), each
   request's :class:`StepUpdate` built;
5. the scheduler's view of the step (accepted drafts only, late rows held back, failed
   requests out), ``scheduler.update``, then ``kv.commit`` for every request that ran and
   ``kv.free`` for every one that finished.

The processor is the only writer of a request's ``output_token_ids`` and of the ``status`` of
a request that finishes in a step; it ends requests through the engine (``fail``, ``leave``),
which keeps the requests and the updates made outside a step's rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from brigade.grammar import GrammarManager
from brigade.interfaces import KVManager, Request, RequestStatus, SchedulerOutput
from brigade.persistent_batch import PersistentBatch, StepPlan
from brigade.pooling import Pooler
from brigade.sampling_stage import SampledTokens, SamplingStage, TokenLogprob
from brigade.scheduling import BatchScheduler
from brigade.speculative import Speculation, Verified
from brigade.step_tokens import asked, held_back, record_tokens, without

__all__ = ["FailRequest", "StepOutputProcessor", "StepUpdate"]


@dataclasses.dataclass(frozen=True, slots=True)
class StepUpdate:
    """What one step did for one request."""

    request: Request
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finished: bool
    error: str | None = None
    """Why the request ended without an answer: refused after it was queued (its grammar
    failed to compile; ``invalid``) or failed on its own while it ran (a plugin raised for it,
    its sampling distribution was undefined). Other requests are not affected."""
    invalid: bool = False
    """True when the request itself is at fault (it cannot succeed as sent)."""
    error_param: str | None = None
    """The request field an ``invalid`` error is about (``structured_output``), if known."""
    embedding: list[float] | None = None
    """An embedding request's vector, on its last update (``Request.pooling``)."""


class FailRequest(Protocol):
    """``EngineCore``'s way to end one request alone with an error (its update leaves with
    the step's)."""

    def __call__(
        self, request: Request, error: str, *, invalid: bool = False, param: str | None = None
    ) -> None: ...


class _Step:
    """One step's outcome while :meth:`StepOutputProcessor.process` builds it."""

    __slots__ = (
        "failed",
        "finished",
        "invalid",
        "late",
        "logprobs",
        "requests",
        "rows",
        "tokens",
        "updates",
        "verdicts",
    )

    def __init__(
        self,
        requests: tuple[Request, ...],
        rows: list[int],
        tokens: list[list[int]],
        logprobs: list[list[TokenLogprob | None]] | None,
        verdicts: list[Verified] | None,
        failed: dict[Request, str],
    ) -> None:
        self.requests = requests
        """The sampled requests still getting tokens (failed and late ones leave it)."""
        self.rows = rows
        """Their persistent rows."""
        self.tokens = tokens
        """The tokens each emits (one, or accepted drafts and the token after them)."""
        self.logprobs = logprobs
        self.verdicts = verdicts
        """Each one's verdict on its drafts; None when the step had no drafts."""
        self.failed = failed
        """Requests that fail alone in this step -> why."""
        self.invalid: set[Request] = set()
        """Failed requests that caused their failure (their grammar overran its budget)."""
        self.late: set[Request] = set()
        """Sampled requests whose row sat the step out (late mask, ended grammar)."""
        self.updates: list[StepUpdate] = []
        self.finished: list[Request] = []


class StepOutputProcessor:
    """Turns a step's sampled tokens and hidden states into updates, finished requests and
    the scheduler's and KV manager's view of the step (see the module docstring)."""

    def __init__(
        self,
        *,
        batch: PersistentBatch,
        sampling: SamplingStage,
        grammar: GrammarManager | None,
        scheduler: BatchScheduler,
        kv: KVManager,
        speculation: Speculation | None,
        pooler: Pooler,
        max_model_len: int,
        requests: Mapping[str, Request],
        fail: FailRequest,
        leave: Callable[[Request], None],
        take_pending: Callable[[], list[StepUpdate]],
    ) -> None:
        """``requests`` is the engine's table of live requests (read only); ``fail`` ends a
        request alone with an error, ``leave`` forgets a finished one everywhere, and
        ``take_pending`` hands over the updates made outside the step's rows."""
        self.batch = batch
        self.sampling = sampling
        self.grammar = grammar
        self.scheduler = scheduler
        self.kv = kv
        self.speculation = speculation
        self.pooler = pooler
        self.max_model_len = max_model_len
        self.requests = requests
        self._fail = fail
        self._leave = leave
        self._take_pending = take_pending

    def process(
        self,
        output: SchedulerOutput,
        plan: StepPlan,
        sampled: SampledTokens,
        hidden: torch.Tensor | None,
    ) -> list[StepUpdate]:
        """Take the step that ran ``output`` as ``plan`` to its end: ``sampled`` are its
        sampled tokens, ``hidden`` the hidden states of its pooled rows (None without).
        Returns the step's updates, those made outside its rows first."""
        step = self._emitted(plan, sampled)
        if plan.pooled:
            self._pool(step, plan, hidden)
        if sampled.skipped:
            step.late = self._skipped_requests(plan, sampled)
        self._end_grammars(step)
        if step.failed or step.late:  # rare: take the failed and skipped rows out of the step
            self._drop_rows(step)
        if step.requests:
            self._append(step)
        self._commit(self._scheduled(output, step), step.finished)
        pending = self._take_pending()
        if not pending:
            return step.updates
        pending.extend(step.updates)
        return pending

    def _emitted(self, plan: StepPlan, sampled: SampledTokens) -> _Step:
        """The tokens each sampled request emits, and the requests whose row failed."""
        verified = None if self.speculation is None else self.speculation.verify(plan, sampled)
        if verified is None:
            tokens = [[token] for token in sampled.token_ids]
            logprobs = None if sampled.logprobs is None else [[lp] for lp in sampled.logprobs]
            failures, verdicts = sampled.failures, None
        else:
            tokens, logprobs = verified.token_ids, verified.logprobs
            failures, verdicts = verified.failures, verified.verdicts
        requests = plan.sampled
        failed = {requests[index]: error for index, error in failures.items()}
        return _Step(requests, plan.sampled_rows, tokens, logprobs, verdicts, failed)

    def _pool(self, step: _Step, plan: StepPlan, hidden: torch.Tensor | None) -> None:
        """Hand each embedding request its hidden rows; finish those whose prompt ended."""
        pooled = self.pooler.collect(plan.pooled, hidden)
        step.failed.update(pooled.failures)
        for request, vector in pooled.vectors:
            request.status = RequestStatus.FINISHED_STOPPED
            step.finished.append(request)
            step.updates.append(StepUpdate(request, [], None, True, embedding=vector))

    @staticmethod
    def _skipped_requests(plan: StepPlan, sampled: SampledTokens) -> set[Request]:
        """The sampled requests whose logits row the sampling stage skipped (a late mask)."""
        return {
            request
            for request, offset in zip(plan.sampled, plan.logits_offsets, strict=True)
            if offset in sampled.skipped
        }

    def _end_grammars(self, step: _Step) -> None:
        """Requests whose grammar ended with their previous token finish; those whose grammar
        failed fail (their own fault). Either way their row sits this step out."""
        for request, error in self._grammar_ended():
            step.late.add(request)
            if error is None:
                request.status = RequestStatus.FINISHED_STOPPED
                step.finished.append(request)
                step.updates.append(StepUpdate(request, [], None, True))
            else:
                step.failed[request] = error
                step.invalid.add(request)

    def _grammar_ended(self) -> list[tuple[Request, str | None]]:
        """Requests whose grammar ended (None) or failed (why) since the last call, among
        those still in the engine."""
        if self.grammar is None:
            return []
        return [
            (request, error)
            for request, error in self.grammar.take_ended()
            if self.requests.get(request.request_id) is request
        ]

    @staticmethod
    def _drop_rows(step: _Step) -> None:
        """Take the failed and late requests out of the step's sampled requests."""
        failed, late = step.failed, step.late
        keep = [
            index
            for index, request in enumerate(step.requests)
            if request not in failed and request not in late
        ]
        step.requests = tuple(step.requests[index] for index in keep)
        step.rows = [step.rows[index] for index in keep]
        step.tokens = [step.tokens[index] for index in keep]
        if step.logprobs is not None:
            step.logprobs = [step.logprobs[index] for index in keep]
        if step.verdicts is not None:
            step.verdicts = [step.verdicts[index] for index in keep]

    def _append(self, step: _Step) -> None:
        """Record the step's tokens (batch, logits processors), append them to their
        requests up to a stop, and build each request's update."""
        requests = step.requests
        rejected, complete = record_tokens(
            self.batch, self.sampling, self.grammar, requests, step.rows, step.tokens
        )
        for request, error in self._grammar_ended():  # failed accepting several tokens
            if error is not None:
                rejected[requests.index(request)] = error
                step.invalid.add(request)
        self._emit(step, rejected, complete)

    def _emit(self, step: _Step, rejected: dict[int, str], complete: dict[int, int]) -> None:
        """Append each request's recorded tokens up to a stop and build its update:
        ``rejected`` (index -> why) fail instead, ``complete`` (index -> tokens) end where
        their grammar completed."""
        logprobs = step.logprobs
        for index, (request, new) in enumerate(zip(step.requests, step.tokens, strict=True)):
            if index in rejected:
                step.failed[request] = rejected[index]
                continue
            complete_after = complete.get(index)
            if complete_after is not None:
                new = new[:complete_after]
            status = None
            emitted = 0
            for token in new:  # several with accepted drafts; a stop ends them
                request.output_token_ids.append(token)
                emitted += 1
                status = self._finish_status(request, token)
                if status is not None:
                    break
            if status is None and complete_after is not None:
                status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                request.status = status
                step.finished.append(request)
            step.updates.append(
                StepUpdate(
                    request,
                    new if emitted == len(new) else new[:emitted],
                    asked(logprobs[index][:emitted]) if logprobs is not None else None,
                    status is not None,
                )
            )

    def _finish_status(self, request: Request, token: int) -> RequestStatus | None:
        """How ``request`` ends with ``token`` appended (None: it goes on)."""
        params = request.sampling_params
        if request.num_output_tokens > params.min_tokens:  # min_tokens: no stop before
            if token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _scheduled(self, output: SchedulerOutput, step: _Step) -> SchedulerOutput:
        """``output`` as the step really ran it: speculating requests computed only their
        accepted drafts, late rows one token fewer, failed requests (ended here) not at all."""
        if step.verdicts is not None:
            assert self.speculation is not None  # verdicts come from it
            output = self.speculation.accepted(output, step.requests, step.verdicts, step.failed)
        if step.late:
            output = held_back(output, step.late)
        for request, error in step.failed.items():
            if request in step.invalid:
                self._fail(request, error, invalid=True, param="structured_output")
            else:
                self._fail(request, error)
        if step.failed:
            output = without(output, step.failed)
        return output

    def _commit(self, output: SchedulerOutput, finished: list[Request]) -> None:
        """Tell the scheduler what ran and what finished; keep the computed KV, free the
        finished requests' pages and let them leave."""
        self.scheduler.update(output, finished)
        for item in output.scheduled:
            self.kv.commit(item.request)
        for request in finished:
            self.kv.free(request)
            self._leave(request)
