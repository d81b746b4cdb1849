"""Conformance of schedulers: drive one with a real KV manager and no model.

A simulated step appends a fake token to every request whose last known token was computed,
finishes requests at ``max_tokens`` and checks the plan's invariants on every step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from brigade.interfaces import (
    KVManager,
    KVPoolParams,
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerOutput,
    SchedulerParams,
)

__all__ = ["check_scheduler", "simulate"]

SchedulerFactory = Callable[[SchedulerParams, KVManager, Any], Scheduler]
KVFactory = Callable[[KVPoolParams, Any], KVManager]


def simulate(
    scheduler: Scheduler,
    kv: KVManager,
    requests: Sequence[Request],
    *,
    page_size: int,
    max_steps: int = 10_000,
) -> list[SchedulerOutput]:
    """Run ``requests`` to completion without a model; returns every step's plan.

    Each step: check the plan, "sample" token ``7 + step`` for requests whose last known token
    was computed, finish those that reached ``max_tokens``, then ``update`` and ``commit``
    exactly as core does.
    """
    for request in requests:
        scheduler.add(request)
    plans: list[SchedulerOutput] = []
    while scheduler.has_unfinished():
        assert len(plans) < max_steps, f"not finished after {max_steps} steps (livelock?)"
        plan = scheduler.schedule()
        _check_plan(scheduler, kv, plan, page_size)
        finished: list[Request] = []
        for item in plan.scheduled:
            request = item.request
            if request.num_computed_tokens + item.num_new_tokens == request.num_tokens:
                request.output_token_ids.append(7 + len(plans) % 50)
                if request.num_output_tokens >= request.sampling_params.max_tokens:
                    request.status = RequestStatus.FINISHED_LENGTH
                    finished.append(request)
        scheduler.update(plan, finished)
        for item in plan.scheduled:
            kv.commit(item.request)
        for request in finished:
            kv.free(request)
        plans.append(plan)
    return plans


def check_scheduler(
    factory: SchedulerFactory,
    options: Any,
    kv_factory: KVFactory,
    kv_options: Any,
    *,
    page_size: int = 4,
) -> None:
    """The behaviour every scheduler must show, under plenty and under scarcity of pages."""
    params = SchedulerParams(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    # Plenty: everything finishes with exactly max_tokens tokens, nobody is preempted.
    kv = kv_factory(KVPoolParams(num_pages=200, page_size=page_size), kv_options)
    scheduler = factory(params, kv, options)
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
    scheduler = factory(params, kv, options)
    requests = _requests(6, prompt_lens=(10, 14, 6), max_tokens=(20, 12))
    plans = simulate(scheduler, kv, requests, page_size=page_size)
    _check_all_finished(requests)
    assert any(p.preempted for p in plans), "a pool this small should force preemption"
    assert kv.num_free_pages() == 12, "pages leaked after preemptions"
    # Abort: a waiting and a running request leave, their pages come back.
    kv = kv_factory(KVPoolParams(num_pages=40, page_size=page_size), kv_options)
    scheduler = factory(params, kv, options)
    running, waiting = _requests(2, prompt_lens=(8,), max_tokens=(30,))
    scheduler.add(running)
    scheduler.schedule()
    scheduler.add(waiting)
    assert scheduler.abort(running.request_id) is running
    assert scheduler.abort(waiting.request_id) is waiting
    assert scheduler.abort("unknown") is None
    assert kv.num_free_pages() == 40, "abort did not free the running request's pages"
    assert not scheduler.has_unfinished()
    _check_readiness_gate(factory(params, kv, options), kv, page_size)


def _check_readiness_gate(scheduler: Scheduler, kv: KVManager, page_size: int) -> None:
    """A request that is not ready (grammar compiling) waits without pages; others go on."""
    gated, other = _requests(2, prompt_lens=(6,), max_tokens=(3,))
    gated.ready = False
    free = kv.num_free_pages()
    scheduler.add(gated)
    scheduler.add(other)
    for _ in range(3):
        plan = scheduler.schedule()
        _check_plan(scheduler, kv, plan, page_size)
        assert all(s.request is not gated for s in plan.scheduled), "scheduled a gated request"
        assert not kv.block_table(gated), "a gated request holds KV pages"
        assert any(s.request is other for s in plan.scheduled), "the gate blocked another request"
        scheduler.update(plan, [])
        for item in plan.scheduled:
            kv.commit(item.request)
            item.request.output_token_ids.append(7)
    assert scheduler.has_unfinished()
    assert scheduler.stats().num_waiting >= 1, "a gated request must count as waiting"
    gated.ready = True
    plan = scheduler.schedule()
    assert any(s.request is gated for s in plan.scheduled), "a ready request was not admitted"
    for request in (gated, other):
        scheduler.abort(request.request_id)
    assert kv.num_free_pages() == free, "pages leaked after the gate test"


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


def _check_plan(scheduler: Scheduler, kv: KVManager, plan: SchedulerOutput, page_size: int) -> None:
    params = scheduler.params
    ids = [s.request.request_id for s in plan.scheduled]
    assert len(ids) == len(set(ids)), f"a request was scheduled twice: {ids}"
    assert len(ids) <= params.max_num_seqs, f"{len(ids)} requests > max_num_seqs"
    assert plan.num_batched_tokens <= params.max_num_batched_tokens, "token budget exceeded"
    preempted = {r.request_id for r in plan.preempted}
    assert not preempted & set(ids), "a preempted request was also scheduled"
    seen_prefill = False
    pages_held: dict[int, str] = {}
    for item in plan.scheduled:
        request = item.request
        assert item.num_new_tokens > 0, f"{request.request_id}: scheduled with 0 tokens"
        end = request.num_computed_tokens + item.num_new_tokens
        assert end <= request.num_tokens, f"{request.request_id}: scheduled past its tokens"
        is_decode = item.num_new_tokens == 1 and request.num_computed_tokens > 0
        assert not (is_decode and seen_prefill), "a decode row came after a prefill row"
        seen_prefill |= not is_decode
        table = kv.block_table(request)
        assert len(table) * page_size >= end, (
            f"{request.request_id}: {len(table)} pages cannot hold {end} tokens"
        )
        for page in table[request.num_cached_tokens // page_size :]:
            owner = pages_held.setdefault(page, request.request_id)
            assert owner == request.request_id, f"page {page} held by {owner} and {request}"
