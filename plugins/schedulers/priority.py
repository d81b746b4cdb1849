"""Priority scheduling: lower ``request.priority`` runs first, first come first served within a
level, with preemption of lower-priority work and an optional starvation guard (aging).

Aging runs on a clock of ``aging_steps`` scheduler steps: at every tick each waiting request's
*effective* priority improves by 1, so a request that has waited ``k * aging_steps`` steps
stands ``k`` levels better than its own (``k + 1`` when its wait straddles one more tick). The
heap key of a waiting request is therefore fixed when it is queued (its priority plus the tick
it was queued at) and the heap never needs re-sorting.

Aging orders the queue; it gives no power to preempt. A waiting request preempts a runner only
if its own ``priority`` is strictly smaller than the runner's *rank*: the effective priority
the runner was admitted with. So an aged request is not preempted by the work it overtook,
equal priorities never preempt each other, and every preemption hands the slot to a strictly
smaller ``priority`` value (no ping-pong). With ``aging_steps = 0`` the rank is simply
``request.priority``.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Iterator, Sequence

from brigade.interfaces import Request, SchedulerView, SchedulingPolicy, option

__all__ = ["PriorityOptions", "PriorityPolicy", "WaitingHeap"]


@dataclasses.dataclass(frozen=True)
class PriorityOptions:
    """Options of the ``priority`` scheduler (limits live in the ``[scheduler]`` table)."""

    aging_steps: int = option(
        0,
        help="starvation guard: a waiting request's priority improves by 1 every this many "
        "steps it waits (0 turns aging off)",
        ge=0,
    )


class WaitingHeap:
    """The waiting queue as a binary heap of ``(key, arrival_time, seq, request)``."""

    def __init__(self) -> None:
        self._entries: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()  # FCFS among equal keys and arrivals; never compares requests

    def push(self, key: int, request: Request) -> None:
        """Queue ``request`` under ``key`` (lower first, then earlier ``arrival_time``)."""
        heapq.heappush(self._entries, (key, request.arrival_time, next(self._seq), request))

    def peek(self) -> Request | None:
        """The request that would be admitted next, left in the heap."""
        return self._entries[0][3] if self._entries else None

    def remove(self, request: Request) -> None:
        """Take ``request`` out: O(log n) for the head (admission), O(n) otherwise (abort)."""
        if self._entries and self._entries[0][3] is request:
            heapq.heappop(self._entries)
            return
        for index, entry in enumerate(self._entries):
            if entry[3] is request:
                self._entries[index] = self._entries[-1]
                self._entries.pop()
                heapq.heapify(self._entries)
                return
        raise ValueError(f"request {request.request_id!r} is not waiting")

    def __iter__(self) -> Iterator[Request]:
        return iter([entry[3] for entry in self._entries])

    def __len__(self) -> int:
        return len(self._entries)


class PriorityPolicy(SchedulingPolicy):
    """Admits and serves by priority; preempts the lowest-priority runner for a better waiter.

    When the next waiting request cannot be admitted (``max_num_seqs`` running or the KV pool
    exhausted), the running request with the largest rank (latest arrival on ties) is
    preempted, but only if its rank is strictly larger than the waiting request's priority.
    The same order picks the victim when a running request cannot grow. Preempted requests
    re-queue with their own priority, ahead of equal-priority later arrivals.
    """

    def __init__(self, view: SchedulerView, options: PriorityOptions) -> None:
        super().__init__(view, options)
        self.options: PriorityOptions = options
        self.queue = WaitingHeap()
        self._keys: dict[Request, int] = {}  # waiting request -> heap key
        self._ranks: dict[Request, int] = {}  # running request -> effective priority at admission
        self._resort = False  # admissions since the running list was last put in rank order

    # -- the waiting queue --------------------------------------------------------------

    def enqueue(self, request: Request, *, preempted: bool) -> None:
        """Queue by (priority + aging tick, arrival time), preempted or not.

        A preempted request thus goes back with its own priority, ahead of equal-priority
        requests that arrived after it.
        """
        key = request.priority + self._tick()
        self._keys[request] = key
        self.queue.push(key, request)

    def peek(self) -> Request | None:
        """The waiting request with the best effective priority, earliest arrival on ties."""
        return self.queue.peek()

    def admit(self, request: Request) -> None:
        """Freeze the request's rank: the effective priority it is admitted with."""
        self._ranks[request] = self._keys[request] - self._tick()
        self.remove(request)
        self._resort = True

    def remove(self, request: Request) -> None:
        self.queue.remove(request)
        del self._keys[request]

    def __len__(self) -> int:
        return len(self.queue)

    # -- the running requests ------------------------------------------------------------

    def release(self, request: Request) -> None:
        self._ranks.pop(request, None)

    def order_running(self, running: list[Request]) -> None:
        """Serve (and spend the token budget on) better-ranked requests first; the list is
        nearly sorted after a few admissions, so this is linear."""
        if self._resort:
            running.sort(key=self._victim_order)
            self._resort = False

    def choose_victim(self, candidates: Sequence[Request]) -> Request:
        """The candidate with the largest rank, the latest arrival (then admission) on ties."""
        return max(reversed(candidates), key=self._victim_order)

    def victim_for(self, waiting: Request, running: Sequence[Request]) -> Request | None:
        """The worst-ranked runner, if its rank is strictly larger than ``waiting.priority``."""
        if not running:
            return None
        victim = max(reversed(running), key=self._victim_order)
        return victim if self._ranks[victim] > waiting.priority else None

    # -- ordering -----------------------------------------------------------------------

    def _tick(self) -> int:
        """Aging ticks so far: the clock every waiting request's priority improves by."""
        aging = self.options.aging_steps
        return self.view.num_steps // aging if aging else 0

    def _victim_order(self, request: Request) -> tuple[int, float]:
        return self._ranks[request], request.arrival_time
