"""First come, first served: admit in arrival order, preempt the latest admitted."""

from __future__ import annotations

import collections
import dataclasses

from brigade.interfaces import Request, SchedulerView, SchedulingPolicy

__all__ = ["FcfsOptions", "FcfsPolicy"]


@dataclasses.dataclass(frozen=True)
class FcfsOptions:
    """FCFS takes no options of its own (limits live in the ``[scheduler]`` table)."""


class FcfsPolicy(SchedulingPolicy):
    """A deque: new requests at the back, preempted ones back at the front.

    Victims are the defaults of :class:`SchedulingPolicy`: the latest admitted loses its pages
    when a runner cannot grow, and nobody is preempted for a waiting request.
    """

    def __init__(self, view: SchedulerView, options: FcfsOptions) -> None:
        super().__init__(view, options)
        self.queue: collections.deque[Request] = collections.deque()

    def enqueue(self, request: Request, *, preempted: bool) -> None:
        if preempted:
            self.queue.appendleft(request)
        else:
            self.queue.append(request)

    def peek(self) -> Request | None:
        return self.queue[0] if self.queue else None

    def admit(self, request: Request) -> None:
        if self.queue and self.queue[0] is request:
            self.queue.popleft()
        else:
            self.queue.remove(request)

    def remove(self, request: Request) -> None:
        self.queue.remove(request)

    def __len__(self) -> int:
        return len(self.queue)
