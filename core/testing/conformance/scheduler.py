"""Conformance of scheduling policies: core's scheduler drives one with a real KV manager and
no model.

A simulated step appends a fake token to every request whose last known token was computed,
finishes requests at ``max_tokens`` and checks the plan's invariants on every step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from brigade.interfaces import (
    KVManager,
    KVPoolParams,
    Request,
    RequestStatus,
    SamplingParams,
    SchedulerOutput,
    SchedulerParams,
    SchedulerView,
    SchedulingPolicy,
)
from brigade.scheduling import BatchScheduler
from brigade.swap import SwapSpace

__all__ = ["PolicyReport", "build_scheduler", "check_scheduler", "finish_step", "simulate"]

PolicyFactory = Callable[[SchedulerView, Any], SchedulingPolicy]
KVFactory = Callable[[KVPoolParams, Any], KVManager]


def build_scheduler(
    factory: PolicyFactory,
    options: Any,
    params: SchedulerParams,
    kv: KVManager,
    *,
    swap: SwapSpace | None = None,
    share_prefills_from: int = 0,
) -> BatchScheduler:
    """Core's scheduler driving the policy ``factory(view, options)``, as the engine builds it
    (``share_prefills_from``: see ``BatchScheduler``; the engine sets it with prefix caching)."""
    return BatchScheduler(
        params,
        kv,
        lambda view: factory(view, options),
        swap=swap,
        share_prefills_from=share_prefills_from,
    )


@dataclasses.dataclass
class PolicyReport:
    """What :func:`check_scheduler` saw the policy do (for tests of a policy's intent)."""

    num_preempted_for_waiting: int = 0
    """Running requests the policy preempted so a waiting one could start (``victim_for``)."""
    num_preempted_to_grow: int = 0
    """Victims it chose when a running request could not grow (``choose_victim``)."""


def simulate(
    scheduler: BatchScheduler,
    kv: KVManager,
    requests: Sequence[Request],
    *,
    page_size: int,
    max_steps: int = 10_000,
    arrivals: Sequence[int] = (),
    clock: list[float] | None = None,
) -> list[SchedulerOutput]:
    """Run ``requests`` to completion without a model; returns every step's plan.

    ``arrivals[i]`` is the step before which request ``i`` is added (default: all before the
    first); with ``clock`` (the one-element list the scheduler's ``params.clock`` reads), each
    step advances it by one second and a request's ``arrival_time`` is the clock when added.
    Each step: check the plan, "sample" token ``7 + step`` for requests whose last known token
    was computed, finish those that reached ``max_tokens``, then ``update`` and ``commit``
    exactly as core does.
    """
    pending = sorted(
        ((arrivals[i] if i < len(arrivals) else 0, i) for i in range(len(requests))),
        reverse=True,
    )
    plans: list[SchedulerOutput] = []
    while pending or scheduler.has_unfinished():
        assert len(plans) < max_steps, f"not finished after {max_steps} steps (livelock?)"
        while pending and pending[-1][0] <= len(plans):
            request = requests[pending.pop()[1]]
            if clock is not None:
                request.arrival_time = clock[0]
            scheduler.add(request)
        plan = scheduler.schedule()
        _check_plan(scheduler, kv, plan, page_size)
        finish_step(scheduler, kv, plan, 7 + len(plans) % 50)
        plans.append(plan)
        if clock is not None:
            clock[0] += 1.0
    return plans


def finish_step(
    scheduler: BatchScheduler, kv: KVManager, plan: SchedulerOutput, token_id: int
) -> list[Request]:
    """Finish a planned step without a model, as core does: append ``token_id`` to every
    request whose last known token was computed, finish those at ``max_tokens``, then
    ``update``, ``commit`` and free the finished; returns them."""
    finished: list[Request] = []
    for item in plan.scheduled:
        request = item.request
        if request.num_computed_tokens + item.num_new_tokens == request.num_tokens:
            request.output_token_ids.append(token_id)
            if request.num_output_tokens >= request.sampling_params.max_tokens:
                request.status = RequestStatus.FINISHED_LENGTH
                finished.append(request)
    scheduler.update(plan, finished)
    for item in plan.scheduled:
        kv.commit(item.request)
    for request in finished:
        kv.free(request)
    return finished


def check_scheduler(
    factory: PolicyFactory,
    options: Any,
    kv_factory: KVFactory,
    kv_options: Any,
    *,
    page_size: int = 4,
) -> PolicyReport:
    """The behaviour every scheduling policy must show, driven by core's scheduler: under
    plenty and under scarcity of pages, with staggered arrivals, with waiting requests that
    outrank running ones, and with aborts. Returns what the policy chose to do."""
    report = PolicyReport()
    params = SchedulerParams(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    # Plenty: everything finishes with exactly max_tokens tokens, nobody is preempted.
    kv = kv_factory(KVPoolParams(num_pages=200, page_size=page_size), kv_options)
    scheduler = _watched(build_scheduler(factory, options, params, kv), report)
    requests = _requests(10, prompt_lens=(3, 30, 9, 17, 1), max_tokens=(5, 1, 12))
    plans = simulate(scheduler, kv, requests, page_size=page_size)
    _check_all_finished(requests)
    assert not any(p.preempted for p in plans), "preempted although pages were plentiful"
    assert kv.num_free_pages() == 200, "pages leaked after every request finished"
    long_prompt = next(r for r in requests if r.num_prompt_tokens == 30)
    chunks = [s.num_new_tokens for p in plans for s in p.scheduled if s.request is long_prompt]
    assert chunks[0] < 30, "a 30-token prompt was not chunked under a 16-token budget"
    # Scarcity: the pool holds about two sequences; every request still finishes.
    pool = KVPoolParams(num_pages=12, page_size=page_size, enable_prefix_caching=False)
    kv = kv_factory(pool, kv_options)
    scheduler = _watched(build_scheduler(factory, options, params, kv), report)
    requests = _requests(6, prompt_lens=(10, 14, 6), max_tokens=(20, 12))
    plans = simulate(scheduler, kv, requests, page_size=page_size)
    _check_all_finished(requests)
    assert any(p.preempted for p in plans), "a pool this small should force preemption"
    assert kv.num_free_pages() == 12, "pages leaked after preemptions"
    _check_staggered_arrivals(factory, options, kv_factory, kv_options, page_size, report)
    _check_waiting_outranks_running(factory, options, kv_factory, kv_options, page_size, report)
    # Abort: a waiting and a running request leave, their pages come back.
    kv = kv_factory(KVPoolParams(num_pages=40, page_size=page_size), kv_options)
    scheduler = build_scheduler(factory, options, params, kv)
    running, waiting = _requests(2, prompt_lens=(8,), max_tokens=(30,))
    scheduler.add(running)
    scheduler.schedule()
    scheduler.add(waiting)
    assert scheduler.abort(running.request_id) is running
    assert scheduler.abort(waiting.request_id) is waiting
    assert scheduler.abort("unknown") is None
    assert len(scheduler.policy) == 0, "an aborted request is still in the policy's queue"
    assert kv.num_free_pages() == 40, "abort did not free the running request's pages"
    assert not scheduler.has_unfinished()
    return report


def _check_staggered_arrivals(
    factory: PolicyFactory,
    options: Any,
    kv_factory: KVFactory,
    kv_options: Any,
    page_size: int,
    report: PolicyReport,
) -> None:
    """Requests arriving while others run join the batch at once when there is room, and
    arrival times come from the engine clock."""
    clock = [100.0]
    params = SchedulerParams(8, 16, max_model_len=64, clock=lambda: clock[0])
    kv = kv_factory(KVPoolParams(num_pages=200, page_size=page_size), kv_options)
    scheduler = _watched(build_scheduler(factory, options, params, kv), report)
    requests = _requests(6, prompt_lens=(4, 6, 3), max_tokens=(12, 8))
    arrivals = [0, 0, 3, 5, 6, 9]
    plans = simulate(scheduler, kv, requests, page_size=page_size, arrivals=arrivals, clock=clock)
    _check_all_finished(requests)
    for request, step in zip(requests, arrivals, strict=True):
        assert request.arrival_time == 100.0 + step, (
            f"{request.request_id}: arrival_time {request.arrival_time}, but the engine clock "
            f"read {100.0 + step} when it was added"
        )
        first = next(
            i for i, p in enumerate(plans) if any(s.request is request for s in p.scheduled)
        )
        assert first == step, (
            f"{request.request_id} arrived before step {step} with room in the batch but was "
            f"first scheduled in step {first}: a late arrival must join the running batch"
        )
    assert kv.num_free_pages() == 200, "pages leaked after staggered arrivals"


def _check_waiting_outranks_running(
    factory: PolicyFactory,
    options: Any,
    kv_factory: KVFactory,
    kv_options: Any,
    page_size: int,
    report: PolicyReport,
) -> None:
    """A full batch of long, low-priority jobs, then short urgent arrivals: whatever the
    policy decides, every preemption of a runner for a waiter must leave that runner whole
    (its tokens kept, its pages freed, queued again) and everything must finish."""
    clock = [0.0]
    params = SchedulerParams(2, 16, max_model_len=64, clock=lambda: clock[0])
    kv = kv_factory(KVPoolParams(num_pages=200, page_size=page_size), kv_options)
    scheduler = _watched(build_scheduler(factory, options, params, kv), report)
    before = report.num_preempted_for_waiting
    requests = _requests(5, prompt_lens=(5, 7, 3), max_tokens=(30, 30, 2, 2, 3))
    for request in requests[:2]:
        request.priority = 9
    for request in requests[2:]:
        request.priority = 0
    outputs: dict[str, list[int]] = {}
    original = scheduler.policy.victim_for

    def victim_for(waiting: Request, running: Sequence[Request]) -> Request | None:
        victim = original(waiting, running)
        if victim is not None:
            assert victim.status == RequestStatus.RUNNING, f"victim {victim.request_id} not running"
            outputs[victim.request_id] = list(victim.output_token_ids)
        return victim

    scheduler.policy.victim_for = victim_for  # type: ignore[method-assign]
    plans = simulate(
        scheduler, kv, requests, page_size=page_size, arrivals=[0, 0, 4, 4, 6], clock=clock
    )
    _check_all_finished(requests)
    for request in requests:
        kept = outputs.get(request.request_id)
        if kept is not None:
            assert request.output_token_ids[: len(kept)] == kept, (
                f"{request.request_id} lost tokens when it was preempted for a waiting request"
            )
            assert request.num_preemptions >= 1
    if report.num_preempted_for_waiting > before:
        assert any(p.preempted for p in plans), "victim_for chose a victim the plan omits"
    assert kv.num_free_pages() == 200, "pages leaked after preemption for waiting requests"


def _watched(scheduler: BatchScheduler, report: PolicyReport) -> BatchScheduler:
    """Count the policy's victims into ``report`` and check its queue size every step."""
    policy = scheduler.policy
    choose_victim, victim_for = policy.choose_victim, policy.victim_for

    def counted_choose(candidates: Sequence[Request]) -> Request:
        report.num_preempted_to_grow += 1
        return choose_victim(candidates)

    def counted_victim_for(waiting: Request, running: Sequence[Request]) -> Request | None:
        victim = victim_for(waiting, running)
        report.num_preempted_for_waiting += victim is not None
        return victim

    policy.choose_victim = counted_choose  # type: ignore[method-assign]
    policy.victim_for = counted_victim_for  # type: ignore[method-assign]
    return scheduler


def _requests(
    count: int, *, prompt_lens: Sequence[int], max_tokens: Sequence[int]
) -> list[Request]:
    return [
        Request(
            request_id=f"r{i}",
            prompt_token_ids=[(i * 31 + j) % 97 for j in range(prompt_lens[i % len(prompt_lens)])],
            sampling_params=SamplingParams(max_tokens=max_tokens[i % len(max_tokens)]),
            arrival_time=float(i),
        )
        for i in range(count)
    ]


def _check_all_finished(requests: Sequence[Request]) -> None:
    for request in requests:
        expected = request.sampling_params.max_tokens
        assert request.num_output_tokens == expected, (
            f"{request.request_id}: {request.num_output_tokens} tokens, expected {expected}"
        )


def _check_plan(
    scheduler: BatchScheduler, kv: KVManager, plan: SchedulerOutput, page_size: int
) -> None:
    params = scheduler.params
    ids = [s.request.request_id for s in plan.scheduled]
    assert len(ids) == len(set(ids)), f"a request was scheduled twice: {ids}"
    assert len(ids) <= params.max_num_seqs, f"{len(ids)} requests > max_num_seqs"
    assert plan.num_batched_tokens <= params.max_num_batched_tokens, "token budget exceeded"
    preempted = {r.request_id for r in plan.preempted}
    assert not preempted & set(ids), "a preempted request was also scheduled"
    num_waiting = scheduler.stats().num_waiting
    assert len(scheduler.policy) == num_waiting, (
        f"the policy queues {len(scheduler.policy)} requests, but {num_waiting} are waiting"
    )
    pages_held: dict[int, str] = {}
    for item in plan.scheduled:
        request = item.request
        assert item.num_new_tokens > 0, f"{request.request_id}: scheduled with 0 tokens"
        end = request.num_computed_tokens + item.num_new_tokens
        assert end <= request.num_tokens, f"{request.request_id}: scheduled past its tokens"
        table = kv.block_table(request)
        assert len(table) * page_size >= end, (
            f"{request.request_id}: {len(table)} pages cannot hold {end} tokens"
        )
        for page in table[request.num_cached_tokens // page_size :]:
            owner = pages_held.setdefault(page, request.request_id)
            assert owner == request.request_id, f"page {page} held by {owner} and {request}"
