"""Drive an ``EngineCore`` with the ``simulated`` executor through a workload in virtual time.

The engine runs on a :class:`VirtualClock` instead of ``time.monotonic``: each step advances
it by the executor's modelled cost of that step, and when the engine is idle it jumps to the
next arrival. Requests join the engine when the clock reaches their arrival time, so their
``arrival_time``, queue times and whatever a scheduling policy reads from the clock are
virtual seconds too. TTFT and end-to-end latency are read off the same clock, so results do
not depend on how fast this machine runs the scheduler.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import torch

from brigade.bench.report import TokenTimes
from brigade.bench.workloads import WorkloadRequest, submit
from brigade.config import load_config
from brigade.engine import EngineCore
from brigade.errors import ConfigError
from brigade.interfaces import EMPTY_EXTRA, ExtraValue
from brigade.registry import Registry, default_registry

__all__ = ["RequestRecord", "SimulationResult", "VirtualClock", "run_simulation"]


class VirtualClock:
    """Simulated seconds: the engine clock under simulation (call it for now).

    Only the simulation moves it, and only forward: by each step's modelled cost
    (:meth:`advance`) and, when the engine is idle, to the next arrival (:meth:`advance_to`).
    """

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` (>= 0) pass."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go back: advance({seconds})")
        self.now += seconds

    def advance_to(self, time: float) -> None:
        """Jump to ``time`` (no-op when it is already past)."""
        self.now = max(self.now, time)


@dataclasses.dataclass(frozen=True, slots=True)
class RequestRecord:
    """One finished request, times in virtual seconds."""

    arrival_time: float
    ttft_s: float
    """Arrival to the end of the step that produced the first output token."""
    e2e_s: float
    """Arrival to the end of the step that produced the last output token."""
    prompt_len: int
    output_len: int
    priority: int
    itl_s: tuple[float, ...] = ()
    """Gaps between consecutive output tokens (the first gap follows the first token)."""
    extra: Mapping[str, ExtraValue] = dataclasses.field(default_factory=lambda: EMPTY_EXTRA)
    """The workload request's ``extra`` data."""


@dataclasses.dataclass(frozen=True, slots=True)
class SimulationResult:
    """What a simulated run measured."""

    requests: tuple[RequestRecord, ...]
    """In workload order."""
    duration_s: float
    """Virtual seconds from the first arrival to the last token."""
    num_steps: int
    num_preemptions: int
    prefix_hit_rate: float
    wall_s: float
    """Real seconds the simulation took on this machine."""
    errors: tuple[str, ...] = ()
    """One message per request the engine refused (e.g. a prompt longer than the context)."""
    refused: tuple[int, ...] = ()
    """Workload indices of the requests in ``errors``, in the same order."""

    @property
    def output_tokens(self) -> int:
        return sum(record.output_len for record in self.requests)

    @property
    def request_throughput(self) -> float:
        """Finished requests per virtual second."""
        return len(self.requests) / self.duration_s if self.duration_s else 0.0

    @property
    def output_throughput(self) -> float:
        """Generated tokens per virtual second."""
        return self.output_tokens / self.duration_s if self.duration_s else 0.0

    def mean_ttft_s(self, priority: int | None = None) -> float:
        """Mean TTFT over all requests, or over those of one priority level."""
        values = [r.ttft_s for r in self.requests if priority is None or r.priority == priority]
        return statistics.fmean(values) if values else 0.0


def run_simulation(
    config_overrides: Sequence[str],
    workload: Sequence[WorkloadRequest],
    *,
    registry: Registry | None = None,
    config_path: str | None = None,
    on_finished: Callable[[], object] | None = None,
) -> SimulationResult:
    """Run ``workload`` on an engine built from ``config_path`` (a TOML file, or the defaults)
    and ``config_overrides`` (``station.key=value``) with the ``simulated`` executor; every
    request runs to its ``output_len``. ``on_finished`` is called as each request finishes
    (progress bars)."""
    # A simulated step does only small host tensor ops, where torch's intra-op thread pool
    # costs more than it saves (10x on a loaded machine); one thread for the run's duration.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _simulate(
            config_path, config_overrides, workload, registry or default_registry(), on_finished
        )
    finally:
        torch.set_num_threads(threads)


def _simulate(
    config_path: str | None,
    config_overrides: Sequence[str],
    workload: Sequence[WorkloadRequest],
    registry: Registry,
    on_finished: Callable[[], object] | None,
) -> SimulationResult:
    started = time.perf_counter()
    config = load_config(
        config_path, registry, overrides=["executor.plugin=simulated", *config_overrides]
    )
    order = sorted(range(len(workload)), key=lambda index: workload[index].arrival_time)
    pending = deque(order)
    start = workload[order[0]].arrival_time if order else 0.0
    clock = VirtualClock(start)
    engine = EngineCore(config, registry, clock=clock)
    executor = engine.executor
    if not type(executor).models_time:
        engine.executor.shutdown()
        raise ConfigError(
            f"executor {config.plugin('executor')!r} does not model time (models_time); "
            'a simulation needs one that does, e.g. [executor] plugin = "simulated"'
        )
    times = TokenTimes()
    records: dict[int, RequestRecord] = {}
    errors: list[str] = []
    refused: list[int] = []
    while pending or engine.has_unfinished():
        while pending and workload[pending[0]].arrival_time <= clock():
            index = pending.popleft()
            if not submit(engine, str(index), workload[index], errors):
                refused.append(index)
        if not engine.has_unfinished():
            if pending:
                clock.advance_to(workload[pending[0]].arrival_time)
            continue
        steps_before, busy_before = engine.num_steps, executor.modelled_time_s()
        updates = engine.step()
        clock.advance(executor.modelled_time_s() - busy_before)
        if not updates and engine.num_steps == steps_before:
            if not pending:
                raise RuntimeError("the engine made no progress with no arrivals left")
            clock.advance_to(workload[pending[0]].arrival_time)
        for update in updates:
            index = int(update.request.request_id)
            times.token(index, clock())
            if update.finished:
                request = workload[index]
                first, gaps = times.finish(index)
                records[index] = RequestRecord(
                    arrival_time=request.arrival_time,
                    ttft_s=first - request.arrival_time,
                    e2e_s=clock() - request.arrival_time,
                    prompt_len=len(request.prompt_token_ids),
                    output_len=update.request.num_output_tokens,
                    priority=request.priority,
                    itl_s=gaps,
                    extra=request.extra,
                )
                if on_finished is not None:
                    on_finished()
    stats = engine.stats()
    engine.executor.shutdown()
    return SimulationResult(
        requests=tuple(records[index] for index in sorted(records)),
        duration_s=clock() - start,
        num_steps=stats.num_steps,
        num_preemptions=stats.num_preemptions,
        prefix_hit_rate=stats.prefix_hit_rate,
        wall_s=time.perf_counter() - started,
        errors=tuple(errors),
        refused=tuple(refused),
    )
