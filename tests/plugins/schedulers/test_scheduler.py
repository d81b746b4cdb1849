"""Core's scheduler with the FCFS policy, driven without a model."""

from __future__ import annotations

from brigade.interfaces import KVPoolParams, RequestStatus, SchedulerParams
from brigade.plugins.kv.paged import PagedKVManager, PagedKVOptions
from brigade.plugins.schedulers.fcfs import FcfsOptions, FcfsPolicy
from brigade.scheduling import BatchScheduler
from brigade.testing.conformance import build_scheduler, check_scheduler, simulate
from brigade.testing.requests import make_request, make_requests

PAGE = 4


def make(
    num_pages: int = 100,
    *,
    max_seqs: int = 8,
    budget: int = 32,
    chunked: bool = True,
    share: int = 0,
):
    kv = PagedKVManager(KVPoolParams(num_pages, PAGE), PagedKVOptions())
    params = SchedulerParams(max_seqs, budget, max_model_len=256, enable_chunked_prefill=chunked)
    scheduler = build_scheduler(FcfsPolicy, FcfsOptions(), params, kv, share_prefills_from=share)
    return scheduler, kv


def test_fcfs_conforms_and_never_preempts_for_a_waiting_request() -> None:
    report = check_scheduler(FcfsPolicy, FcfsOptions(), PagedKVManager, PagedKVOptions())
    assert report.num_preempted_for_waiting == 0
    assert report.num_preempted_to_grow > 0


def test_admits_in_arrival_order_within_the_budget() -> None:
    scheduler, _ = make(budget=20)
    for request in make_requests(4, 8):
        scheduler.add(request)
    plan = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in plan.scheduled] == [
        ("req-0", 8),
        ("req-1", 8),
        ("req-2", 4),  # the rest of the budget: a chunk
    ]
    assert scheduler.stats().num_waiting == 1


def test_decodes_run_first_and_share_the_budget_with_a_long_prefill() -> None:
    scheduler, kv = make(budget=16)
    short = make_request("short", [1, 2, 3])
    scheduler.add(short)
    simulate_step(scheduler, kv)
    long = make_request("long", list(range(10, 60)))
    scheduler.add(long)
    plan = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in plan.scheduled] == [
        ("short", 1),
        ("long", 15),
    ]


def test_no_chunking_means_whole_prompts_only() -> None:
    scheduler, _ = make(budget=16, chunked=False)
    scheduler.add(make_request("a", list(range(12))))
    scheduler.add(make_request("b", list(range(12))))
    plan = scheduler.schedule()
    assert [s.request.request_id for s in plan.scheduled] == ["a"]


def test_max_num_seqs_caps_the_running_set() -> None:
    scheduler, _ = make(max_seqs=2)
    for request in make_requests(5, 2):
        scheduler.add(request)
    assert len(scheduler.schedule().scheduled) == 2


def test_the_latest_admitted_is_preempted_and_requeued_first() -> None:
    scheduler, kv = make(num_pages=4, budget=64)
    first, second = make_request("first", [1] * 8), make_request("second", [2] * 8)
    third = make_request("third", [3] * 3)
    for request in (first, second, third):
        scheduler.add(request)
    plan = scheduler.schedule()
    assert [s.request.request_id for s in plan.scheduled] == ["first", "second"]
    simulate_finish_step(scheduler, kv, plan)
    # Both now need a third page; only "first" gets it, "second" (latest admitted) yields.
    plan = scheduler.schedule()
    assert [s.request.request_id for s in plan.scheduled] == ["first"]
    assert [r.request_id for r in plan.preempted] == ["second"]
    assert second.status is RequestStatus.PREEMPTED
    assert second.num_computed_tokens == 0
    assert list(scheduler.policy.queue) == [second, third]  # type: ignore[attr-defined]


def test_every_request_finishes_under_pressure_with_the_same_token_counts() -> None:
    scheduler, kv = make(num_pages=10, budget=12)
    requests = make_requests(8, [5, 13, 2, 9, 7, 3, 11, 6], max_tokens=9)
    plans = simulate(scheduler, kv, requests, page_size=PAGE)
    assert all(r.num_output_tokens == 9 for r in requests)
    assert sum(len(p.preempted) for p in plans) > 0
    assert kv.num_free_pages() == 10


def test_requests_sharing_a_prefill_in_flight_wait_a_step_and_hit_the_cache() -> None:
    prefix = list(range(100, 140))  # 40 tokens: 10 pages
    prompts = [[*prefix, 1, 2], [*prefix, 3, 4], [*prefix, 5, 6], list(range(200, 210))]
    unshared, _ = make(budget=160)
    for index, tokens in enumerate(prompts):
        unshared.add(make_request(f"r{index}", tokens))
    plan = unshared.schedule()
    assert len(plan.scheduled) == 4  # off: every copy of the prefix is computed this step
    assert sum(s.num_new_tokens for s in plan.scheduled) == 3 * 42 + 10
    scheduler, kv = make(budget=128, share=8)
    requests = [make_request(f"r{index}", tokens) for index, tokens in enumerate(prompts)]
    for request in requests:
        scheduler.add(request)
    first = scheduler.schedule()
    # r1 would recompute r0's 40 uncached tokens: it waits, and r3 behind it keeps its place.
    assert [(s.request.request_id, s.num_new_tokens) for s in first.scheduled] == [("r0", 42)]
    assert scheduler.num_deferred == 1
    simulate_finish_step(scheduler, kv, first)
    second = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in second.scheduled] == [
        ("r0", 1),  # its decode
        ("r1", 2),  # the prefix came from the cache
        ("r2", 2),
        ("r3", 10),
    ]
    assert requests[1].num_cached_tokens == requests[2].num_cached_tokens == 40
    assert kv.stats().prefix_cache_hits == 80


def test_prefill_sharing_ignores_short_overlaps_and_lone_requests() -> None:
    scheduler, _ = make(budget=128, share=8)
    scheduler.add(make_request("a", [*range(100, 106), 1, 2, 3]))  # 6 shared tokens < 8
    scheduler.add(make_request("b", [*range(100, 106), 4, 5, 6]))
    assert [s.request.request_id for s in scheduler.schedule().scheduled] == ["a", "b"]
    assert scheduler.num_deferred == 0


def test_a_chunked_prefill_shares_each_chunk_as_it_is_cached() -> None:
    scheduler, kv = make(budget=24, share=8)
    prefix = list(range(100, 148))  # 48 tokens: two chunks of 24
    owner, follower = make_request("owner", [*prefix, 1]), make_request("follower", [*prefix, 2])
    scheduler.add(owner)
    scheduler.add(follower)
    computed = []
    while follower.status.name != "RUNNING":
        plan = scheduler.schedule()
        computed.append([(s.request.request_id, s.num_new_tokens) for s in plan.scheduled])
        simulate_finish_step(scheduler, kv, plan)
    # The follower waits while the owner's chunks compute the prefix, then takes it cached.
    assert computed == [[("owner", 24)], [("owner", 24)], [("owner", 1), ("follower", 1)]]
    assert follower.num_cached_tokens == 48


def simulate_step(scheduler: BatchScheduler, kv: PagedKVManager) -> None:
    simulate_finish_step(scheduler, kv, scheduler.schedule())


def simulate_finish_step(scheduler: BatchScheduler, kv: PagedKVManager, plan) -> None:  # type: ignore[no-untyped-def]
    for item in plan.scheduled:
        request = item.request
        if request.num_computed_tokens + item.num_new_tokens == request.num_tokens:
            request.output_token_ids.append(5)
    scheduler.update(plan, [])
    for item in plan.scheduled:
        kv.commit(item.request)
