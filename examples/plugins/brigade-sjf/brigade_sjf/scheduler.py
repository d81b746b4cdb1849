"""Shortest job first: admit the request expected to finish soonest.

A request's expected length is what it may still generate, ``max_tokens`` minus the tokens it
already has. Pure SJF starves long jobs under a steady stream of short ones, so waiting earns
credit: every second since arrival counts ``aging_tokens_per_second`` tokens off the expected
length. Since every waiting request earns credit at the same rate, the order only depends on
``remaining + rate * arrival_time``, a key that stays fixed while a request waits: the queue is
kept sorted on insertion and never re-sorted. (Arrival times are on the engine clock, so the
aging is right under the simulator too.)
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

from brigade.interfaces import Request, SchedulerView, SchedulingPolicy, option

__all__ = ["SjfOptions", "SjfPolicy"]


@dataclasses.dataclass(frozen=True)
class SjfOptions:
    """Options of the ``sjf`` scheduler, set in the ``[scheduler]`` table of a config."""

    aging_tokens_per_second: float = option(
        50.0,
        help="starvation guard: expected tokens forgiven per second a request has waited "
        "since arrival (0 = pure shortest job first)",
        ge=0,
    )


class SjfPolicy(SchedulingPolicy):
    """Admits the shortest expected job first; preempts the longest when pages run out.

    Only the order is SJF's: continuous batching, chunked prefill under the token budget,
    admission through the KV manager and preemption are Brigade's.
    """

    def __init__(self, view: SchedulerView, options: SjfOptions) -> None:
        super().__init__(view, options)
        self.options: SjfOptions = options
        self.queue: list[Request] = []
        """Sorted by :meth:`_order`, shortest first."""

    def expected_remaining_tokens(self, request: Request) -> int:
        """Tokens the request may still generate: the job length SJF orders by."""
        return max(0, request.sampling_params.max_tokens - request.num_output_tokens)

    def enqueue(self, request: Request, *, preempted: bool) -> None:
        """Insert in order of (aged expected length, arrival).

        A preempted request re-enters by the same rule: its remaining length is shorter now,
        and its waiting credit counts from its original arrival.
        """
        bisect.insort(self.queue, request, key=self._order)

    def peek(self) -> Request | None:
        return self.queue[0] if self.queue else None

    def remove(self, request: Request) -> None:
        self.queue.remove(request)

    def __len__(self) -> int:
        return len(self.queue)

    def choose_victim(self, candidates: Sequence[Request]) -> Request:
        """The running request with the most left to do (latest arrival on ties)."""
        return max(
            reversed(candidates),
            key=lambda r: (self.expected_remaining_tokens(r), r.arrival_time),
        )

    def _order(self, request: Request) -> tuple[float, float]:
        # remaining - rate * (now - arrival), minus the term every waiting request shares.
        aging = self.options.aging_tokens_per_second * request.arrival_time
        return self.expected_remaining_tokens(request) + aging, request.arrival_time
