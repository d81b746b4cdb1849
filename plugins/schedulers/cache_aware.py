"""Longest prefix match first: admit the waiting request with the most tokens already in the
prefix cache (SGLang's ``lpm``), so shared prefixes are reused before eviction takes them.

Each step the queue is ranked once by ``view.cached_prefix_len`` (a read-only peek into the
KV manager), ties in queue order (preempted requests first, then arrival). Matching costs a
walk of each waiting prompt, so past ``max_waiting_to_match`` waiting requests the policy
degrades to first come, first served for that step: under a long queue, fairness and a cheap
step matter more than reuse. Victims are the defaults: the latest admitted loses its pages, and
nobody is preempted for a waiting request.
"""

from __future__ import annotations

import dataclasses

from brigade.interfaces import Request, SchedulerView, SchedulingPolicy, option

__all__ = ["LongestPrefixOptions", "LongestPrefixPolicy"]


@dataclasses.dataclass(frozen=True)
class LongestPrefixOptions:
    """Options of the ``lpm`` scheduler (limits live in the ``[scheduler]`` table)."""

    max_waiting_to_match: int = option(
        128,
        help="rank by cached prefix only while at most this many requests wait; above it, "
        "admit first come, first served (matching every waiting prompt costs a step time)",
        ge=0,
    )


class LongestPrefixPolicy(SchedulingPolicy):
    """A FCFS queue, read in cached-prefix order while it is short."""

    def __init__(self, view: SchedulerView, options: LongestPrefixOptions) -> None:
        super().__init__(view, options)
        self.options: LongestPrefixOptions = options
        self.queue: list[Request] = []
        """Queue order: preempted requests at the front, new ones at the back."""
        self._ranked: list[Request] | None = None
        """This step's admission order (None: rank again)."""
        self._ranked_at = -1

    def enqueue(self, request: Request, *, preempted: bool) -> None:
        if preempted:
            self.queue.insert(0, request)
        else:
            self.queue.append(request)
        self._ranked = None

    def peek(self) -> Request | None:
        if len(self.queue) > self.options.max_waiting_to_match:
            return self.queue[0]
        if self._ranked is None or self._ranked_at != self.view.num_steps:
            matched = {id(r): self.view.cached_prefix_len(r) for r in self.queue}
            # sorted() is stable: equal matches keep their queue order.
            self._ranked = sorted(self.queue, key=lambda r: -matched[id(r)])
            self._ranked_at = self.view.num_steps
        return self._ranked[0] if self._ranked else None

    def remove(self, request: Request) -> None:
        self.queue.remove(request)
        if self._ranked is not None:
            self._ranked.remove(request)

    def __len__(self) -> int:
        return len(self.queue)
