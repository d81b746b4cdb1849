"""The scheduling mechanics every policy shares: continuous batching, chunked prefill under
one token budget, admission through the KV manager, preemption by recompute.

A policy subclasses :class:`BatchScheduler` and overrides only the ordering of the waiting
queue (:meth:`~BatchScheduler.enqueue`, :meth:`~BatchScheduler.next_waiting`) and the choice of
a victim (:meth:`~BatchScheduler.choose_victim`).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

from brigade.interfaces import (
    KVManager,
    Request,
    RequestStatus,
    ScheduledRequest,
    Scheduler,
    SchedulerOutput,
    SchedulerParams,
    SchedulerStats,
)

__all__ = ["BatchScheduler"]


class BatchScheduler(Scheduler):
    """Plans each step: running requests first (decodes and prefill chunks), then admissions.

    Running requests are served in the order they were admitted; a request that cannot grow
    preempts victims chosen by the policy until it fits, or is preempted itself. Waiting
    requests are admitted in the policy's order while the token budget, ``max_num_seqs`` and
    the KV pool allow; no admission happens in a step that preempted.
    """

    def __init__(self, params: SchedulerParams, kv: KVManager) -> None:
        super().__init__(params, kv)
        self.running: list[Request] = []
        self.waiting: collections.deque[Request] = collections.deque()
        self.num_preemptions = 0

    # -- policy hooks -------------------------------------------------------------------

    def enqueue(self, request: Request, *, preempted: bool) -> None:
        """Put ``request`` in the waiting queue (FCFS: arrival order, preempted first)."""
        if preempted:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def next_waiting(self) -> Request | None:
        """The request to admit next, left in the queue (FCFS: the oldest)."""
        return self.waiting[0] if self.waiting else None

    def choose_victim(self, candidates: Sequence[Request]) -> Request:
        """Which running request loses its pages (FCFS: the latest admitted)."""
        return candidates[-1]

    # -- contract -----------------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.enqueue(request, preempted=False)

    def abort(self, request_id: str) -> Request | None:
        for queue in (self.running, self.waiting):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    if queue is self.running:
                        self.kv.free(request)
                    request.status = RequestStatus.FINISHED_ABORTED
                    return request
        return None

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.num_preemptions)

    def schedule(self) -> SchedulerOutput:
        budget = self.params.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        unscheduled = list(self.running)  # victims come from requests not yet given tokens
        while unscheduled and budget > 0:
            request = unscheduled.pop(0)
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                continue
            while self.kv.allocate(request, num_new) is None:
                victim = self.choose_victim([request, *unscheduled])  # admission order
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                unscheduled.remove(victim)
            else:
                scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
        if not preempted:
            budget = self._admit(budget, scheduled)
        # Decode rows first: the executor's batch layout needs them ahead of prefill chunks.
        scheduled.sort(key=lambda s: not _is_decode(s))
        return SchedulerOutput(tuple(scheduled), tuple(preempted))

    def update(self, output: SchedulerOutput, finished: Iterable[Request]) -> None:
        for item in output.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
        done = set(map(id, finished))
        if done:
            self.running = [r for r in self.running if id(r) not in done]

    # -- mechanics ----------------------------------------------------------------------

    def _admit(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        while budget > 0 and len(self.running) < self.params.max_num_seqs:
            request = self.next_waiting()
            if request is None:
                break
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                break  # a whole prompt must fit when chunked prefill is off
            allocation = self.kv.allocate(request, num_new)
            if allocation is None:
                break  # head of line waits for pages; later arrivals do not overtake it
            self.waiting.remove(request)
            request.num_computed_tokens += allocation.num_cached_tokens
            num_new = min(num_new, request.num_tokens - request.num_computed_tokens)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return budget

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining > budget and not self.params.enable_chunked_prefill:
            return 0
        return min(remaining, budget)

    def _preempt(self, request: Request) -> None:
        """Recompute-style: drop the pages, keep the emitted tokens, wait at the front."""
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.enqueue(request, preempted=True)


def _is_decode(item: ScheduledRequest) -> bool:
    return item.num_new_tokens == 1 and item.request.num_computed_tokens > 0
