"""The request as it travels through the engine, and the scheduler's step plan."""

from __future__ import annotations

import dataclasses
import enum

from brigade.interfaces.sampling import SamplingParams

__all__ = ["Request", "RequestStatus", "ScheduledRequest", "SchedulerOutput"]


class RequestStatus(enum.Enum):
    """Where a request is in its life; the ``FINISHED_*`` values double as finish reasons."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        """True for the three terminal states."""
        return self.name.startswith("FINISHED")


@dataclasses.dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated.

    Ownership: core creates the request, is the only writer of ``output_token_ids`` and
    writes the final ``FINISHED_*`` status; while the request waits or runs the scheduler is
    the only writer of ``status``, ``num_computed_tokens`` and ``num_preemptions``; the KV
    manager writes ``num_cached_tokens`` from ``allocate``. Every other component reads only.
    Requests compare by identity.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = 0.0
    priority: int = 0
    """Lower runs first under a priority scheduler; ignored by FCFS."""
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    """Only appended to while the request is in the engine (KV managers key cached pages by
    token content)."""
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    """Tokens whose KV is in the cache (prefix hits included)."""
    num_cached_tokens: int = 0
    """Tokens served from the prefix cache at the latest admission."""
    num_preemptions: int = 0
    ready: bool = True
    """False while something the request needs before it may run is being prepared off the
    step loop (its grammar compiling). Schedulers must not schedule a request that is not
    ready; it holds no KV pages meanwhile. Core is the only writer."""
    first_scheduled_time: float | None = None
    """``time.monotonic()`` when the request first got a batch row (queue time ends)."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step: ``num_new_tokens`` tokens starting at its computed count."""

    request: Request
    num_new_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """The plan for one engine step.

    ``scheduled`` lists decodes (one new token each) before prefill chunks, so the executor's
    batch has its decode rows first. ``preempted`` lists requests that lost their pages in this
    plan; core releases their rows in the persistent batch.
    """

    scheduled: tuple[ScheduledRequest, ...]
    preempted: tuple[Request, ...] = ()
    swap_out: tuple[tuple[int, int], ...] = ()
    """(device page, host page) copies core makes before this step runs (preempted by swap)."""
    swap_in: tuple[tuple[int, int], ...] = ()
    """(host page, device page) copies core makes after ``swap_out``, before the step runs."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
