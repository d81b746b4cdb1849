"""Scheduler: decides which requests run in the next step and with how many tokens."""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Callable, Iterable

from brigade.interfaces.kv import KVManager
from brigade.interfaces.request import Request, SchedulerOutput

__all__ = ["Scheduler", "SchedulerParams", "SchedulerStats"]


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerParams:
    """Limits core hands the scheduler at construction, and the engine clock."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    preemption: str = "recompute"
    """'recompute' (drop a victim's pages) or 'swap' (copy them to host pages and back)."""
    host_pages: tuple[int, ...] = ()
    """Host page ids (see ``Executor.initialize_kv_cache``) a 'swap' scheduler may use."""
    clock: Callable[[], float] = time.monotonic
    """The engine clock: ``clock()`` is now, in seconds, on the clock that stamped every
    request's ``arrival_time`` and ``first_scheduled_time`` (so ``clock() -
    request.arrival_time`` is how long it has waited). ``time.monotonic`` when serving, the
    virtual clock under the simulator: a policy that reads the time reads it here, never from
    ``time`` directly, or it is mis-simulated (API 1.3)."""


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int


class Scheduler(abc.ABC):
    """Continuous batching policy.

    Ownership: the scheduler holds the waiting and running queues, is the KV manager's only
    caller during :meth:`schedule` (admission only when ``kv.allocate`` succeeds; preemption
    when a running request cannot grow), and writes ``status``, ``num_computed_tokens`` and
    ``num_preemptions`` of its requests. Core appends sampled tokens and decides when a request
    is finished; it then calls :meth:`update` and frees the pages.

    Time and per-request data: a policy reads the time from ``self.params.clock()`` (the
    engine clock, virtual under the simulator) and what clients attached to a request from
    ``request.extra`` (read-only, e.g. a deadline).

    Readiness gate: a request whose ``ready`` is False (its grammar is still compiling) is
    queued but must not be scheduled, nor hold KV pages, until core sets ``ready``; requests
    behind it may go first.

    Failures: when :meth:`add` raises, that request alone is refused (core then calls
    :meth:`abort` for it, in case it was half added). When :meth:`schedule` raises, core
    retries the step once; a second failure in a row is fatal to the engine (the server
    exits), so raise only when the queues can no longer be trusted.
    """

    def __init__(self, params: SchedulerParams, kv: KVManager) -> None:
        self.params = params
        self.kv = kv

    @abc.abstractmethod
    def add(self, request: Request) -> None:
        """Queue a new request (status WAITING)."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> Request | None:
        """Remove a request wherever it is; return it (or None if unknown)."""

    @abc.abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Plan the next step under the token budget; decodes first, then prefill chunks."""

    @abc.abstractmethod
    def update(self, output: SchedulerOutput, finished: Iterable[Request]) -> None:
        """Account for a completed step: advance computed counts, drop finished requests.

        Core calls it after appending the step's sampled tokens and marking ``finished``
        requests FINISHED_*; core frees their pages afterwards.
        """

    @abc.abstractmethod
    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""

    @abc.abstractmethod
    def stats(self) -> SchedulerStats:
        """Queue sizes and counters for metrics."""
