"""The scheduling mechanics every policy shares: continuous batching, chunked prefill under
one token budget, admission through the KV manager, preemption by recompute.

A policy subclasses :class:`BatchScheduler` and overrides only the ordering of the waiting
queue (:meth:`~BatchScheduler.enqueue`, :meth:`~BatchScheduler.next_waiting`) and the choice of
victims (:meth:`~BatchScheduler.choose_victim` when a running request cannot grow,
:meth:`~BatchScheduler.victim_for` when a waiting request cannot be admitted).
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
    the KV pool allow; when they do not, the policy may preempt a running request for the next
    waiting one (:meth:`victim_for`). No admission happens in a step where a running request
    had to be preempted to grow, and a request preempted in a step is not readmitted in it.
    """

    def __init__(self, params: SchedulerParams, kv: KVManager) -> None:
        super().__init__(params, kv)
        self.running: list[Request] = []
        self.waiting: collections.deque[Request] = collections.deque()
        self.gated: list[Request] = []
        """Requests that are not ready yet (grammar compiling): queued once they are."""
        self.num_preemptions = 0
        # Swap preemption: host pages hold a victim's KV until it is admitted again.
        self._host_free: list[int] = list(params.host_pages)
        self._host_released: list[int] = []
        """Freed by this step's swap-ins: reusable once their copies have run (next step)."""
        self._swapped: dict[str, list[int]] = {}
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self.num_swapped_out = 0
        self.num_swapped_in = 0
        self._admitted_now: set[int] = set()

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

    def victim_for(self, waiting: Request, running: Sequence[Request]) -> Request | None:
        """A running request to preempt so that ``waiting`` can be admitted now, or None.

        Called when ``waiting`` is next in line but the batch is full (``max_num_seqs``) or
        the KV pool cannot hold it. ``running`` lists the candidates in admission order. The
        request returned is preempted (recompute, back through :meth:`enqueue`) and admission
        is retried; None leaves ``waiting`` at the head of the queue (FCFS: always None).
        """
        return None

    # -- contract -----------------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        if request.ready:
            self.enqueue(request, preempted=False)
        else:
            self.gated.append(request)

    def abort(self, request_id: str) -> Request | None:
        for queue in (self.running, self.waiting, self.gated):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    if queue is self.running:
                        self.kv.free(request)
                    self._host_released.extend(self._swapped.pop(request_id, ()))
                    request.status = RequestStatus.FINISHED_ABORTED
                    return request
        return None

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self.gated)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            len(self.running), len(self.waiting) + len(self.gated), self.num_preemptions
        )

    def schedule(self) -> SchedulerOutput:
        if self.gated:
            self._open_gates()
        self._host_free.extend(self._host_released)
        self._host_released.clear()
        self._swap_out, self._swap_in = [], []
        self._admitted_now = set()
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
            budget = self._admit(budget, scheduled, preempted)
        # Decode rows first: the executor's batch layout needs them ahead of prefill chunks.
        scheduled.sort(key=lambda s: not _is_decode(s))
        return SchedulerOutput(
            tuple(scheduled), tuple(preempted), tuple(self._swap_out), tuple(self._swap_in)
        )

    def update(self, output: SchedulerOutput, finished: Iterable[Request]) -> None:
        for item in output.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
        done = set(map(id, finished))
        if done:
            self.running = [r for r in self.running if id(r) not in done]

    # -- mechanics ----------------------------------------------------------------------

    def _open_gates(self) -> None:
        """Queue the gated requests that became ready, in arrival order."""
        still_gated = []
        for request in self.gated:
            if request.ready:
                self.enqueue(request, preempted=False)
            else:
                still_gated.append(request)
        self.gated = still_gated

    def _admit(
        self, budget: int, scheduled: list[ScheduledRequest], preempted: list[Request]
    ) -> int:
        while budget > 0:
            request = self.next_waiting()
            if request is None or request in preempted:
                break
            if len(self.running) >= self.params.max_num_seqs:
                budget, made_room = self._preempt_for(request, budget, scheduled, preempted)
                if made_room:
                    continue
                break
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                break  # a whole prompt must fit when chunked prefill is off
            allocation = self.kv.allocate(request, num_new)
            if allocation is None:
                budget, made_room = self._preempt_for(request, budget, scheduled, preempted)
                if made_room:
                    continue
                break  # head of line waits for pages; later arrivals do not overtake it
            self.waiting.remove(request)
            self._admitted_now.add(id(request))
            self._swap_back(request)
            request.num_computed_tokens += allocation.num_cached_tokens
            num_new = min(num_new, request.num_tokens - request.num_computed_tokens)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return budget

    def _preempt_for(
        self,
        waiting: Request,
        budget: int,
        scheduled: list[ScheduledRequest],
        preempted: list[Request],
    ) -> tuple[int, bool]:
        """Preempt the policy's victim for ``waiting``, if any; returns (budget, preempted?).

        A victim already planned in this step gives its tokens back to the budget.
        """
        # Requests admitted in this step are not candidates: a swapped-in one would be copied
        # out before its swap-in ran.
        candidates = tuple(r for r in self.running if id(r) not in self._admitted_now)
        victim = self.victim_for(waiting, candidates)
        if victim is None:
            return budget, False
        for index, item in enumerate(scheduled):
            if item.request is victim:
                budget += item.num_new_tokens
                del scheduled[index]
                break
        self._preempt(victim)
        preempted.append(victim)
        return budget, True

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining > budget and not self.params.enable_chunked_prefill:
            return 0
        return min(remaining, budget)

    def _preempt(self, request: Request) -> None:
        """Take the request's pages; it waits at the front with its emitted tokens.

        With ``preemption = "swap"`` and room in the host pool its KV is copied there first
        (it resumes where it stopped); otherwise it recomputes from scratch.
        """
        self.running.remove(request)
        pages = list(self.kv.block_table(request))
        swap = self.params.preemption == "swap" and request.num_computed_tokens > 0
        if swap and len(pages) <= len(self._host_free):
            host = [self._host_free.pop() for _ in pages]
            self._swap_out.extend(zip(pages, host, strict=True))
            self._swapped[request.request_id] = host
            self.num_swapped_out += 1
        else:
            request.num_computed_tokens = 0
        self.kv.free(request)
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.enqueue(request, preempted=True)

    def _swap_back(self, request: Request) -> None:
        """Plan the copy of a swapped request's KV into the pages it was just given."""
        host = self._swapped.pop(request.request_id, None)
        if host is None:
            return
        # The first pages of the new table cover every computed token (both tables do).
        self._swap_in.extend(zip(host, self.kv.block_table(request), strict=False))
        self._host_released.extend(host)
        self.num_swapped_in += 1


def _is_decode(item: ScheduledRequest) -> bool:
    return item.num_new_tokens == 1 and item.request.num_computed_tokens > 0
