"""Scheduling policy: which waiting request is admitted next, and who is preempted.

The batching mechanics are core's (``brigade.scheduling``): continuous batching, chunked
prefill under one token budget, admission through the KV manager, preemption by recompute or
swap, the executor's row layout. A policy decides only the *order*: it owns the waiting queue
and chooses victims. It reads the engine through a read-only :class:`SchedulerView`.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from brigade.interfaces.request import Request

__all__ = ["SchedulerParams", "SchedulerView", "SchedulingPolicy"]


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerParams:
    """Limits core schedules under, and the engine clock."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    clock: Callable[[], float] = time.monotonic
    """The engine clock: ``clock()`` is now, in seconds, on the clock that stamped every
    request's ``arrival_time`` and ``first_scheduled_time``. ``time.monotonic`` when serving,
    the virtual clock under the simulator (read it as ``view.now()``)."""


class SchedulerView(Protocol):
    """What a policy may read of the engine; core implements it, nothing here mutates."""

    @property
    def params(self) -> SchedulerParams:
        """The limits (``max_num_seqs``, the token budget, ...)."""

    @property
    def running(self) -> Sequence[Request]:
        """Running requests in serving order (admission order unless the policy reorders)."""

    @property
    def num_steps(self) -> int:
        """Steps planned so far (``schedule`` calls that returned): a step-based clock."""

    def now(self) -> float:
        """The engine clock, in seconds: ``now() - request.arrival_time`` is its wait so far.

        Virtual under the simulator, so a policy that reads the time here (never from
        ``time`` directly) behaves the same simulated and live.
        """

    def cached_prefix_len(self, request: Request) -> int:
        """Tokens of ``request`` the prefix cache would give it if admitted now (a peek: no
        pages are locked and no statistics change; 0 when prefix caching is off)."""


class SchedulingPolicy(abc.ABC):
    """Orders the waiting queue and picks preemption victims.

    Constructed as ``factory(view, options)``. The policy owns the queue of waiting requests
    (status WAITING or PREEMPTED): core puts requests in with :meth:`enqueue`, asks for the
    next one to admit with :meth:`peek` and takes it out with :meth:`admit` once the KV
    manager gave it pages, or with :meth:`remove` when it is aborted. A request that
    :meth:`peek` names but that cannot be admitted (no pages, no free slot, no budget) stays
    at the head: nothing behind it is admitted in that step, unless :meth:`victim_for` makes
    room for it.

    Core never calls a policy for a request that is not queued (grammar still compiling).
    Every method runs on the engine's step loop: keep them O(log n) per call where possible;
    one that is O(n) in the queue runs once per admission, not per token. Requests are
    read-only here: status, counts and pages are core's to change.

    Time and per-request data: ``view.now()`` is the engine clock; ``request.priority``,
    ``request.arrival_time`` and ``request.extra`` (e.g. a deadline) are what clients said.
    """

    def __init__(self, view: SchedulerView, options: Any) -> None:
        self.view = view
        self.options = options

    # -- the waiting queue --------------------------------------------------------------

    @abc.abstractmethod
    def enqueue(self, request: Request, *, preempted: bool) -> None:
        """Queue ``request``: new (``preempted=False``) or just preempted (it has lost its
        pages, or had them swapped out, and keeps its output tokens)."""

    @abc.abstractmethod
    def peek(self) -> Request | None:
        """The waiting request to admit next, left in the queue; None when it is empty."""

    @abc.abstractmethod
    def remove(self, request: Request) -> None:
        """Take a queued request out (it was aborted); ``ValueError`` if it is not queued."""

    def admit(self, request: Request) -> None:
        """``request`` (what :meth:`peek` just returned) got its pages and starts running:
        take it out of the queue. Default: :meth:`remove`."""
        self.remove(request)

    @abc.abstractmethod
    def __len__(self) -> int:
        """How many requests are queued."""

    # -- the running requests ------------------------------------------------------------

    def release(self, request: Request) -> None:  # noqa: B027 - optional hook
        """A running request left the running set: finished, aborted or preempted (a
        preempted one comes back through :meth:`enqueue` right after). Default: nothing."""

    def order_running(self, running: list[Request]) -> None:  # noqa: B027 - optional hook
        """Reorder ``running`` in place at the start of a step: requests are served (given
        budget) in this order. Default: keep the admission order."""

    def choose_victim(self, candidates: Sequence[Request]) -> Request:
        """Which running request loses its pages when one of them cannot grow.

        ``candidates`` (never empty) are the growing request and those served after it, in
        serving order; the answer must be one of them. Default: the last one (FCFS: the
        latest admitted).
        """
        return candidates[-1]

    def victim_for(self, waiting: Request, running: Sequence[Request]) -> Request | None:
        """A running request to preempt so that ``waiting`` (the head) is admitted now.

        Called when the head cannot be admitted because ``max_num_seqs`` requests run or the
        KV pool cannot hold it. ``running`` lists the candidates in serving order (requests
        admitted in this step are not among them). The request returned (one of ``running``)
        is preempted and admission is retried; None leaves the head waiting. Default: None
        (FCFS never preempts for a waiting request).
        """
        return None
