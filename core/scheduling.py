"""The scheduling mechanics every policy shares: continuous batching, chunked prefill under
one token budget, admission through the KV manager, preemption by recompute or swap.

A policy (``brigade.interfaces.SchedulingPolicy``, the ``scheduler`` plugin kind) decides only
the order: which waiting request is admitted next and which running one is preempted.
:class:`BatchScheduler` does the rest and is the view the policy reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

from brigade.interfaces import (
    KVManager,
    Request,
    RequestStatus,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerParams,
    SchedulingPolicy,
)
from brigade.swap import SwapSpace

__all__ = ["BatchScheduler", "PolicyFactory", "SchedulerStats"]

PolicyFactory = Callable[["BatchScheduler"], SchedulingPolicy]
"""Builds the policy from the scheduler it will read (its ``SchedulerView``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int


class BatchScheduler:
    """Plans each step: running requests first (decodes and prefill chunks), then admissions.

    A running request whose next token is a decode and that carries draft tokens
    (``request.draft_token_ids``, speculative decoding) gets as many of them as the budget
    leaves, after its decode token (``ScheduledRequest.num_draft_tokens``); when the KV pool
    cannot hold them it decodes without them before anyone is preempted.

    Running requests are served in the policy's order (:meth:`SchedulingPolicy.order_running`,
    admission order by default); a request that cannot grow preempts victims chosen by the
    policy until it fits, or is preempted itself. Waiting requests are admitted in the
    policy's order while the token budget, ``max_num_seqs`` and the KV pool allow; when they
    do not, the policy may preempt a running request for the next waiting one
    (:meth:`SchedulingPolicy.victim_for`). No admission happens in a step where a running
    request had to be preempted to grow, and a request preempted in a step is not readmitted
    in it.

    Ownership: the scheduler is the KV manager's only caller during :meth:`schedule` and
    writes ``status``, ``num_computed_tokens`` and ``num_preemptions`` of its requests. Core
    appends sampled tokens, decides when a request is finished, then calls :meth:`update` and
    frees the pages. A request whose grammar is compiling waits in core's grammar station and
    is added here only once it is compiled.

    Implements ``SchedulerView`` for the policy: :attr:`params`, :attr:`running`,
    :attr:`num_steps`, :meth:`now`, :meth:`cached_prefix_len`.
    """

    def __init__(
        self,
        params: SchedulerParams,
        kv: KVManager,
        policy: PolicyFactory,
        *,
        swap: SwapSpace | None = None,
        share_prefills_from: int = 0,
    ) -> None:
        self.params = params
        self.kv = kv
        self.swap = swap
        self.share_prefills_from = share_prefills_from
        """0: off. Else a waiting request that shares at least this many more prompt tokens
        with a prefill running in this step than the prefix cache holds for it waits one step,
        then finds them cached (in-batch prefix sharing, as SGLang does): concurrent requests
        with one system prompt compute it once, not once each. Core turns it on with the
        prefix cache."""
        self.num_deferred = 0
        """Admissions put off by :attr:`share_prefills_from` so far."""
        """Host pages for swap preemption; None: preempted requests recompute."""
        self._running: list[Request] = []
        self._waiting: dict[str, Request] = {}
        """Requests queued in the policy, by id (for abort and stats)."""
        self.num_preemptions = 0
        self.num_steps = 0
        self._admitted_now: set[int] = set()
        self.refused: list[tuple[Request, Exception]] = []
        """See :meth:`take_refused`."""
        self.policy = policy(self)

    # -- the policy's view ----------------------------------------------------------------

    @property
    def running(self) -> Sequence[Request]:
        """Running requests in serving order (a read-only view)."""
        return tuple(self._running)

    def now(self) -> float:
        return self.params.clock()

    def cached_prefix_len(self, request: Request) -> int:
        return self.kv.cached_prefix_len(request)

    # -- what core calls -----------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a new request (status WAITING) in the policy."""
        request.status = RequestStatus.WAITING
        self._enqueue(request, preempted=False)

    def abort(self, request_id: str) -> Request | None:
        """Remove a request wherever it is and free its pages; return it (None if unknown)."""
        request = self._waiting.pop(request_id, None)
        if request is not None:
            self.policy.remove(request)
        else:
            request = _take(self._running, request_id)
            if request is None:
                return None
            self.kv.free(request)
            self.policy.release(request)
        if self.swap is not None:
            self.swap.drop(request_id)
        request.status = RequestStatus.FINISHED_ABORTED
        return request

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self._running or self._waiting)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self._running), len(self._waiting), self.num_preemptions)

    def schedule(self) -> SchedulerOutput:
        """Plan the next step under the token budget (rows in serving order; the persistent
        batch lays decodes out first)."""
        if self.swap is not None:
            self.swap.begin_step()
        self._admitted_now = set()
        self.policy.order_running(self._running)
        budget = self.params.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        unscheduled = list(self._running)  # victims come from requests not yet given tokens
        while unscheduled and budget > 0:
            request = unscheduled.pop(0)
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                continue
            num_drafts = self._num_drafts(request, num_new, budget)
            num_new += num_drafts
            while self.kv.allocate(request, num_new) is None:
                if num_drafts:  # no room to verify drafts: decode one token, preempt nobody
                    num_new -= num_drafts
                    num_drafts = 0
                    continue
                candidates = [request, *unscheduled]  # serving order
                victim = self.policy.choose_victim(candidates)
                _check_victim(self.policy, "choose_victim", victim, candidates)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                unscheduled.remove(victim)
            else:
                scheduled.append(ScheduledRequest(request, num_new, num_drafts))
                budget -= num_new
        if not preempted:
            budget = self._admit(budget, scheduled, preempted)
        self.num_steps += 1
        swap = self.swap
        return SchedulerOutput(
            tuple(scheduled),
            tuple(preempted),
            tuple(swap.planned_out) if swap is not None else (),
            tuple(swap.planned_in) if swap is not None else (),
        )

    def update(self, output: SchedulerOutput, finished: Iterable[Request]) -> None:
        """Account for a completed step: advance computed counts, drop finished requests.

        Core calls it after appending the step's sampled tokens and marking ``finished``
        requests FINISHED_*; core frees their pages afterwards.
        """
        for item in output.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
        done = set(map(id, finished))
        if done:
            left = [r for r in self._running if id(r) in done]
            self._running = [r for r in self._running if id(r) not in done]
            for request in left:
                self.policy.release(request)

    # -- mechanics ----------------------------------------------------------------------

    def _enqueue(self, request: Request, *, preempted: bool) -> None:
        self.policy.enqueue(request, preempted=preempted)  # may refuse it: then it is not ours
        self._waiting[request.request_id] = request

    def _admit(
        self, budget: int, scheduled: list[ScheduledRequest], preempted: list[Request]
    ) -> int:
        while budget > 0:
            request = self._peek()
            if request is None or request in preempted:
                break
            if self._waiting.get(request.request_id) is not request:
                raise RuntimeError(
                    f"scheduling policy {type(self.policy).__qualname__}.peek() returned "
                    f"{request.request_id!r}, which is not waiting"
                )
            if len(self._running) >= self.params.max_num_seqs:
                budget, made_room = self._preempt_for(request, budget, scheduled, preempted)
                if made_room:
                    continue
                break
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                break  # a whole prompt must fit when chunked prefill is off
            if self.share_prefills_from and self._shares_a_prefill(request, scheduled):
                self.num_deferred += 1
                break  # next step its prefix is cached; later arrivals do not overtake it
            allocation = self.kv.allocate(request, num_new)
            if allocation is None:
                budget, made_room = self._preempt_for(request, budget, scheduled, preempted)
                if made_room:
                    continue
                break  # head of line waits for pages; later arrivals do not overtake it
            del self._waiting[request.request_id]
            self.policy.admit(request)
            self._admitted_now.add(id(request))
            if self.swap is not None:
                self.swap.swap_in(request.request_id, self.kv.block_table(request))
            request.num_computed_tokens += allocation.num_cached_tokens
            num_new = min(num_new, request.num_tokens - request.num_computed_tokens)
            request.status = RequestStatus.RUNNING
            self._running.append(request)
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return budget

    def _peek(self) -> Request | None:
        """The policy's next waiting request. When ``peek`` raises, the request that makes it
        raise leaves the queue (:meth:`take_refused`) and the others are served."""
        while True:
            try:
                return self.policy.peek()
            except Exception as exc:
                culprit = self._isolate(exc)
            self.refused.append((culprit[0], culprit[1]))

    def _isolate(self, error: Exception) -> tuple[Request, Exception]:
        """Find the waiting request without which ``peek`` works: take requests out, newest
        first, until it does; put back the ones taken before it (oldest first, so their order
        stands). Re-raises ``error`` when ``peek`` fails with no request at all (the policy
        itself is broken)."""
        newest_first = sorted(self._waiting.values(), key=lambda r: r.arrival_time, reverse=True)
        taken: list[Request] = []
        for request in newest_first:
            try:
                self.policy.remove(request)
            except Exception:
                break
            taken.append(request)
            try:
                self.policy.peek()
            except Exception as exc:
                error = exc
                continue
            for innocent in reversed(taken[:-1]):
                self.policy.enqueue(innocent, preempted=innocent.status is RequestStatus.PREEMPTED)
            del self._waiting[request.request_id]
            return request, error
        for innocent in reversed(taken):
            self.policy.enqueue(innocent, preempted=innocent.status is RequestStatus.PREEMPTED)
        raise error

    def take_refused(self) -> list[tuple[Request, Exception]]:
        """Waiting requests the policy failed for since the last call (``peek`` raised because
        of them), with its exception: they left the queue; core fails them alone."""
        refused, self.refused = self.refused, []
        return refused

    def _shares_a_prefill(self, request: Request, scheduled: Sequence[ScheduledRequest]) -> bool:
        """True when a prefill planned in this step computes at least
        :attr:`share_prefills_from` tokens of ``request``'s prompt that the cache lacks."""
        if not request.uses_prefix_cache or request.num_computed_tokens:
            return False  # computes every token anyway, or resumes from swapped pages
        prefills = [item for item in scheduled if not item.is_decode]
        if not prefills:
            return False
        tokens = request.all_token_ids
        missing_from = self.kv.cached_prefix_len(request)
        for item in prefills:
            other = item.request
            end = min(other.num_computed_tokens + item.num_new_tokens, len(tokens) - 1)
            if end - missing_from < self.share_prefills_from:
                continue
            shared = _common_prefix_len(tokens, other.all_token_ids, end)
            if shared - max(missing_from, other.num_computed_tokens) >= self.share_prefills_from:
                return True
        return False

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
        candidates = tuple(r for r in self._running if id(r) not in self._admitted_now)
        victim = self.policy.victim_for(waiting, candidates)
        if victim is None:
            return budget, False
        _check_victim(self.policy, "victim_for", victim, candidates)
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

    @staticmethod
    def _num_drafts(request: Request, num_new: int, budget: int) -> int:
        """Draft tokens a running request verifies after its decode token, within the budget
        (none for a prefill chunk: drafts follow a request's last token only)."""
        drafts = len(request.draft_token_ids)
        if not drafts or num_new != 1 or request.num_computed_tokens != request.num_tokens - 1:
            return 0
        return min(drafts, budget - 1)

    def _preempt(self, request: Request) -> None:
        """Take the request's pages; it goes back to the policy's queue with its tokens.

        With a swap space that has room its KV is copied to host pages first (it resumes
        where it stopped); otherwise it recomputes from scratch.
        """
        self._running.remove(request)
        self.policy.release(request)
        swapped = (
            self.swap is not None
            and request.num_computed_tokens > 0
            and self.swap.swap_out(request.request_id, self.kv.block_table(request))
        )
        if not swapped:
            request.num_computed_tokens = 0
        self.kv.free(request)
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self._enqueue(request, preempted=True)


def _common_prefix_len(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, at most ``limit``."""
    limit = min(limit, len(a), len(b))
    start = 0
    while start < limit:  # compare slices (C speed), then find the mismatch within one
        stop = min(start + 64, limit)
        if a[start:stop] != b[start:stop]:
            while a[start] == b[start]:
                start += 1
            return start
        start = stop
    return limit


def _take(requests: list[Request], request_id: str) -> Request | None:
    for index, request in enumerate(requests):
        if request.request_id == request_id:
            return requests.pop(index)
    return None


def _check_victim(
    policy: SchedulingPolicy, hook: str, victim: Request, candidates: Sequence[Request]
) -> None:
    if not any(victim is candidate for candidate in candidates):
        raise RuntimeError(
            f"scheduling policy {type(policy).__qualname__}.{hook}() chose "
            f"{getattr(victim, 'request_id', victim)!r}, which is not one of its candidates"
        )
