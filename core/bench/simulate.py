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
import math
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
from brigade.interfaces import EMPTY_EXTRA, ExtraValue, ReplicaLoad, Router, RouterParams
from brigade.registry import Registry, default_registry
from brigade.speculative import SpeculativeStats

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
    speculative: SpeculativeStats | None = None
    """Speculative decoding's counters over the run, every replica's added up (None: off)."""

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


@dataclasses.dataclass
class _Replica:
    """One data-parallel engine on its own virtual clock."""

    engine: EngineCore
    clock: VirtualClock

    def load(self, index: int) -> ReplicaLoad:
        stats = self.engine.stats()
        used = 1.0 - stats.num_free_pages / stats.num_pages if stats.num_pages else 0.0
        return ReplicaLoad(index, stats.num_running, stats.num_waiting, used)


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
    num_replicas = config["router"].settings.data_parallel_size
    order = sorted(range(len(workload)), key=lambda index: workload[index].arrival_time)
    pending = deque(order)
    start = workload[order[0]].arrival_time if order else 0.0
    replica_config = load_config(
        config_path,
        registry,
        overrides=["executor.plugin=simulated", *config_overrides, "router.data_parallel_size=1"],
    )
    replicas: list[_Replica] = []
    try:
        for _ in range(num_replicas):
            clock = VirtualClock(start)
            replicas.append(_Replica(EngineCore(replica_config, registry, clock=clock), clock))
            if not type(replicas[-1].engine.executor).models_time:
                raise ConfigError(
                    f"executor {config.plugin('executor')!r} does not model time (models_time); "
                    'a simulation needs one that does, e.g. [executor] plugin = "simulated"'
                )
        first = replicas[0].engine
        router_component = registry.get("router", config.plugin("router") or "round-robin")
        router: Router = router_component.factory(
            RouterParams(num_replicas, first.batch.page_size, first.kv.stats().num_pages),
            config["router"].options,
        )
        return _run(workload, pending, start, replicas, router, on_finished, started)
    finally:
        for replica in replicas:
            for executor in (replica.engine.executor, *replica.engine.draft_executors):
                executor.shutdown()


def _run(
    workload: Sequence[WorkloadRequest],
    pending: deque[int],
    start: float,
    replicas: list[_Replica],
    router: Router,
    on_finished: Callable[[], object] | None,
    started: float,
) -> SimulationResult:
    """The event loop: the next arrival joins (through the router) when no busy replica's
    clock is before it; otherwise the replica whose clock is earliest steps."""
    times = TokenTimes()
    records: dict[int, RequestRecord] = {}
    errors: list[str] = []
    refused: list[int] = []
    placed: dict[int, int] = {}
    while pending or any(r.engine.has_unfinished() for r in replicas):
        busy = [r for r in replicas if r.engine.has_unfinished()]
        earliest = min(busy, key=lambda r: r.clock()) if busy else None
        arrival = workload[pending[0]].arrival_time if pending else math.inf
        if earliest is None or arrival <= earliest.clock():
            index = pending.popleft()
            target = _route_arrival(index, workload[index], replicas, router, errors)
            if target is None:
                refused.append(index)
            else:
                placed[index] = target
            continue
        engine, clock = earliest.engine, earliest.clock
        steps_before, busy_before = engine.num_steps, engine.modelled_time_s()
        updates = engine.step()
        clock.advance(engine.modelled_time_s() - busy_before)
        if not updates and engine.num_steps == steps_before:
            if not pending:
                raise RuntimeError("the engine made no progress with no arrivals left")
            clock.advance_to(workload[pending[0]].arrival_time)
        for update in updates:
            index = int(update.request.request_id)
            times.token(index, clock())
            if update.finished:
                first, gaps = times.finish(index)
                records[index] = _record(
                    workload[index], first, clock(), update.request.num_output_tokens, gaps
                )
                router.finished(str(index), placed.pop(index))
                if on_finished is not None:
                    on_finished()
    return _result(replicas, records, start, started, errors, refused)


def _route_arrival(
    index: int,
    request: WorkloadRequest,
    replicas: list[_Replica],
    router: Router,
    errors: list[str],
) -> int | None:
    """Submit arrival ``index`` to the replica the router picks (an idle one's clock first
    moved up to the arrival): that replica, or None when its engine refused the request
    (its message appended to ``errors``, the router told it finished)."""
    loads = [replica.load(i) for i, replica in enumerate(replicas)]
    target = router.route(str(index), request.prompt_token_ids, loads)
    if not 0 <= target < len(replicas):
        raise RuntimeError(f"router returned replica {target} of {len(replicas)}")
    replica = replicas[target]
    if not replica.engine.has_unfinished():
        replica.clock.advance_to(request.arrival_time)
    if submit(replica.engine, str(index), request, errors):
        return target
    router.finished(str(index), target)
    return None


def _record(
    request: WorkloadRequest,
    first_token_at: float,
    finished_at: float,
    output_len: int,
    itl_s: tuple[float, ...],
) -> RequestRecord:
    """A finished request's timings, on the virtual clock."""
    return RequestRecord(
        arrival_time=request.arrival_time,
        ttft_s=first_token_at - request.arrival_time,
        e2e_s=finished_at - request.arrival_time,
        prompt_len=len(request.prompt_token_ids),
        output_len=output_len,
        priority=request.priority,
        itl_s=itl_s,
        extra=request.extra,
    )


def _result(
    replicas: Sequence[_Replica],
    records: dict[int, RequestRecord],
    start: float,
    started: float,
    errors: Sequence[str],
    refused: Sequence[int],
) -> SimulationResult:
    """The simulation's outcome: every replica's counters together, the virtual time from
    the first arrival (``start``) and the wall time since ``started``."""
    stats = [replica.engine.stats() for replica in replicas]
    queries = sum(s.prefix_cache_queries for s in stats)
    return SimulationResult(
        requests=tuple(records[index] for index in sorted(records)),
        duration_s=max(replica.clock() for replica in replicas) - start,
        num_steps=sum(s.num_steps for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        prefix_hit_rate=sum(s.prefix_cache_hits for s in stats) / queries if queries else 0.0,
        wall_s=time.perf_counter() - started,
        errors=tuple(errors),
        refused=tuple(refused),
        speculative=SpeculativeStats.combine([s.speculative for s in stats]),
    )
