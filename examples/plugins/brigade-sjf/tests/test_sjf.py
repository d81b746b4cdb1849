"""The sjf scheduler: Brigade's scheduler conformance suite plus its own ordering rules."""

from __future__ import annotations

from brigade.interfaces import KVPoolParams, SchedulerParams
from brigade.plugins.kv.paged import PagedKVManager, PagedKVOptions
from brigade.testing.conformance import build_scheduler, check_scheduler, simulate
from brigade.testing.requests import make_request

from brigade_sjf import SjfOptions, SjfPolicy


def test_sjf_conforms_and_never_preempts_for_a_waiting_request() -> None:
    report = check_scheduler(SjfPolicy, SjfOptions(), PagedKVManager, PagedKVOptions())
    assert report.num_preempted_for_waiting == 0


def test_pure_sjf_conforms() -> None:
    options = SjfOptions(aging_tokens_per_second=0.0)
    check_scheduler(SjfPolicy, options, PagedKVManager, PagedKVOptions())


def first_scheduled_order(options: SjfOptions, jobs: dict[str, tuple[int, float]]) -> list[str]:
    """Run ``name -> (max_tokens, arrival_time)`` one at a time; the order they started in."""
    kv = PagedKVManager(KVPoolParams(num_pages=64, page_size=4), PagedKVOptions())
    params = SchedulerParams(max_num_seqs=1, max_num_batched_tokens=32, max_model_len=128)
    scheduler = build_scheduler(SjfPolicy, options, params, kv)
    requests = [
        make_request(name, [1, 2, 3], max_tokens=max_tokens, arrival_time=arrival)
        for name, (max_tokens, arrival) in jobs.items()
    ]
    started: list[str] = []
    for plan in simulate(scheduler, kv, requests, page_size=4):
        for item in plan.scheduled:
            if item.request.request_id not in started:
                started.append(item.request.request_id)
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in requests)
    return started


def test_shortest_expected_output_runs_first_fcfs_among_equals() -> None:
    jobs = {"long": (40, 0.0), "short": (2, 1.0), "mid": (10, 2.0), "short-later": (2, 3.0)}
    order = first_scheduled_order(SjfOptions(aging_tokens_per_second=0.0), jobs)
    assert order == ["short", "short-later", "mid", "long"]


def test_aging_lets_a_long_job_ahead_of_much_later_short_ones() -> None:
    # 40 tokens at 1 token/s of credit: ahead of 2-token jobs arriving more than 38 s later.
    jobs = {"long": (40, 0.0), "short-soon": (2, 10.0), "short-much-later": (2, 50.0)}
    order = first_scheduled_order(SjfOptions(aging_tokens_per_second=1.0), jobs)
    assert order == ["short-soon", "long", "short-much-later"]
