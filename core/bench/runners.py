"""How ``brigade bench`` runs one workload on one target: in-process on the simulated
executor's virtual clock, in-process on the wall clock, or over HTTP. Each returns the finished
requests' timings and the run's counters; progress is reported per finished request."""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from brigade.bench.endpoint import Endpoint, run_endpoint
from brigade.bench.report import BenchError, RequestTiming, RunMetrics, TokenTimes
from brigade.bench.workloads import FIRST_TOKEN_ID, WorkloadRequest, submit

if TYPE_CHECKING:
    from brigade.engine import EngineStats
    from brigade.interfaces import ExtraValue

__all__ = ["Progress", "run_on_endpoint", "run_real", "run_simulated", "warm_up"]

Progress = Callable[[], object]
"""Called once per finished request."""


def run_simulated(
    path: str | None,
    overrides: Sequence[str],
    workload: Sequence[WorkloadRequest],
    progress: Progress,
) -> tuple[list[RequestTiming], RunMetrics]:
    """Run ``workload`` on the config at ``path`` through its simulated executor."""
    from brigade.bench.simulate import run_simulation

    result = run_simulation(overrides, workload, config_path=path, on_finished=progress)
    timings = [
        RequestTiming(r.ttft_s, r.e2e_s, r.output_len, r.itl_s, r.priority, r.extra)
        for r in result.requests
    ]
    _report_refused(path or "default", result.errors, len(workload))
    spec = result.speculative
    metrics = RunMetrics(
        result.duration_s,
        result.num_preemptions,
        result.prefix_hit_rate,
        num_failed=len(result.errors),
        failed_extra=tuple(workload[index].extra for index in result.refused),
        draft_acceptance_rate=None if spec is None else spec.acceptance_rate,
        mean_accepted_length=None if spec is None else spec.mean_accepted_length,
    )
    return timings, metrics


def _report_refused(name: str, errors: Sequence[str], total: int) -> None:
    if errors:
        print(
            f"brigade bench: {name}: the engine refused {len(errors)} of {total} requests "
            f"(counted as failed); first: {errors[0]}",
            file=sys.stderr,
        )


def run_real(
    engine: Any, workload: Sequence[WorkloadRequest], prefix: str, progress: Progress
) -> tuple[list[RequestTiming], RunMetrics]:
    """Feed ``workload`` to ``engine`` at its arrival times on the wall clock."""

    before = engine.stats()
    pending = deque(sorted(range(len(workload)), key=lambda i: workload[i].arrival_time))
    start = time.perf_counter()
    offset = workload[pending[0]].arrival_time if pending else 0.0
    times = TokenTimes()
    timings: dict[int, RequestTiming] = {}
    errors: list[str] = []
    refused: list[int] = []
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and workload[pending[0]].arrival_time - offset <= now:
            index = pending.popleft()
            if not submit(engine, f"{prefix}{index}", workload[index], errors):
                refused.append(index)
        if not engine.has_unfinished():
            if not pending:
                break
            # Idle: wait for the next arrival, never longer than its gap.
            time.sleep(max(0.0, workload[pending[0]].arrival_time - offset - now))
            continue
        steps_before = engine.num_steps
        updates = engine.step()
        if not updates and engine.num_steps == steps_before and not pending:
            raise BenchError("the engine made no progress with no arrivals left")
        now = time.perf_counter() - start
        for update in updates:
            index = int(update.request.request_id.removeprefix(prefix))
            times.token(index, now)
            if update.finished:
                arrival = workload[index].arrival_time - offset
                first, gaps = times.finish(index)
                timings[index] = RequestTiming(
                    first - arrival,
                    now - arrival,
                    update.request.num_output_tokens,
                    gaps,
                    workload[index].priority,
                    workload[index].extra,
                )
                progress()
    run = _run_metrics(
        before,
        engine.stats(),
        start,
        num_failed=len(errors),
        failed_extra=tuple(workload[index].extra for index in refused),
    )
    _report_refused(prefix.rstrip("-") or "engine", errors, len(workload))
    return [timings[i] for i in sorted(timings)], run


def _run_metrics(
    before: EngineStats,
    after: EngineStats,
    start: float,
    *,
    num_failed: int,
    failed_extra: tuple[Mapping[str, ExtraValue], ...],
) -> RunMetrics:
    """The run's counters: the engine's increase from ``before`` to ``after``, and the wall
    time since ``start`` (``time.perf_counter``)."""
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    from brigade.speculative import SpeculativeStats  # the engine is loaded by now

    speculative = (
        None
        if after.speculative is None
        else SpeculativeStats.combine([after.speculative, before.speculative], sign=-1)
    )
    return RunMetrics(
        duration_s=time.perf_counter() - start,
        num_preemptions=after.num_preemptions - before.num_preemptions,
        prefix_hit_rate=hits / queries if queries else 0.0,
        num_failed=num_failed,
        failed_extra=failed_extra,
        draft_acceptance_rate=None if speculative is None else speculative.acceptance_rate,
        mean_accepted_length=None if speculative is None else speculative.mean_accepted_length,
    )


def run_on_endpoint(
    name: str, endpoint: Endpoint, workload: Sequence[WorkloadRequest], progress: Progress
) -> tuple[list[RequestTiming], RunMetrics]:
    """Send ``workload`` over HTTP; failures and short outputs are reported on stderr."""
    result = run_endpoint(endpoint, workload, progress)
    if result.errors:
        print(
            f"brigade bench: {name}: {len(result.errors)} of {len(workload)} requests "
            f"failed; first: {result.errors[0]}",
            file=sys.stderr,
        )
    if result.short_outputs:
        print(
            f"brigade bench: {name}: {result.short_outputs} requests returned fewer "
            "tokens than max_tokens (does the server honour ignore_eos?)",
            file=sys.stderr,
        )
    return result.timings, result.metrics


def warm_up(engine: Any = None, endpoint: Endpoint | None = None) -> None:
    """One short unmeasured request through a real engine or an endpoint before the first
    seed: first calls pay for lazy initialisation (allocator growth, kernel selection, a
    server's first connection) that would otherwise land on seed 0. Its prompt (one repeated
    id) shares no prefix with the workload's random prompts, and an endpoint's error is left
    for the measured run to report."""
    request = WorkloadRequest(0.0, (FIRST_TOKEN_ID,) * 32, output_len=4)
    if engine is not None:
        run_real(engine, [request], "warm-up-", lambda: None)
    if endpoint is not None:
        run_endpoint(endpoint, [request])
