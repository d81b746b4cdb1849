"""The ``lpm`` policy (longest cached prefix first) and core's checks of a policy's answers."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from brigade.interfaces import KVManager, KVPoolParams, Request, SchedulerParams, SchedulerView
from brigade.plugins.kv.paged import PagedKVManager, PagedKVOptions
from brigade.plugins.kv.radix import RadixKVManager, RadixKVOptions
from brigade.plugins.schedulers.cache_aware import LongestPrefixOptions, LongestPrefixPolicy
from brigade.plugins.schedulers.fcfs import FcfsOptions, FcfsPolicy
from brigade.scheduling import BatchScheduler
from brigade.testing.conformance import build_scheduler, check_scheduler, finish_step
from brigade.testing.requests import make_request

PAGE = 4
SYSTEM = list(range(100, 124))  # six pages of a shared "system prompt"


@pytest.mark.parametrize("max_waiting", [128, 0])
def test_lpm_conforms(max_waiting: int) -> None:
    options = LongestPrefixOptions(max_waiting_to_match=max_waiting)
    report = check_scheduler(LongestPrefixPolicy, options, PagedKVManager, PagedKVOptions())
    assert report.num_preempted_for_waiting == 0


def warm(options: LongestPrefixOptions, radix: bool = False) -> tuple[BatchScheduler, KVManager]:
    """One slot; a finished request has left SYSTEM in the prefix cache."""
    kv: KVManager = (
        RadixKVManager(KVPoolParams(256, 1), RadixKVOptions())
        if radix
        else PagedKVManager(KVPoolParams(64, PAGE), PagedKVOptions())
    )
    scheduler = build_scheduler(LongestPrefixPolicy, options, SchedulerParams(1, 64, 256), kv)
    first = make_request("first", [*SYSTEM, 1], max_tokens=1)
    scheduler.add(first)
    plan = scheduler.schedule()
    first.output_token_ids.append(9)
    scheduler.update(plan, [first])
    kv.commit(first)
    kv.free(first)
    return scheduler, kv


def admission_order(scheduler: BatchScheduler, kv: KVManager) -> list[str]:
    started: list[str] = []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        for item in plan.scheduled:
            if item.request.request_id not in started:
                started.append(item.request.request_id)
        finish_step(scheduler, kv, plan, 9)  # every request here wants one token
    return started


def queue_behind_the_cache(scheduler: BatchScheduler) -> None:
    scheduler.add(make_request("cold-early", list(range(1, 30)), max_tokens=1, arrival_time=1))
    scheduler.add(make_request("half", [*SYSTEM[:12], 7, 7, 7], max_tokens=1, arrival_time=2))
    scheduler.add(make_request("hot", [*SYSTEM, 5, 5], max_tokens=1, arrival_time=3))
    scheduler.add(make_request("cold-late", list(range(40, 60)), max_tokens=1, arrival_time=4))


@pytest.mark.parametrize("radix", [False, True], ids=["paged", "radix"])
def test_the_longest_cached_prefix_goes_first(radix: bool) -> None:
    scheduler, kv = warm(LongestPrefixOptions(), radix)
    assert scheduler.cached_prefix_len(make_request("x", [*SYSTEM, 5, 5])) == len(SYSTEM)
    queue_behind_the_cache(scheduler)
    assert admission_order(scheduler, kv) == ["hot", "half", "cold-early", "cold-late"]


def test_a_long_queue_degrades_to_first_come_first_served() -> None:
    scheduler, kv = warm(LongestPrefixOptions(max_waiting_to_match=2))
    queue_behind_the_cache(scheduler)  # four, then three waiting: more than 2, arrival order
    order = admission_order(scheduler, kv)
    assert order == ["cold-early", "half", "hot", "cold-late"]  # two left: matching again


class _Liar(FcfsPolicy):
    """Answers with requests that are not what core asked about."""

    def __init__(self, view: SchedulerView, options: FcfsOptions) -> None:
        super().__init__(view, options)
        self.stranger = make_request("stranger", [1, 2, 3])
        self.lie_in: str = "peek"

    def peek(self) -> Request | None:
        return self.stranger if self.lie_in == "peek" else super().peek()

    def choose_victim(self, candidates: Sequence[Request]) -> Request:
        return self.stranger


def test_core_refuses_a_policy_that_names_a_request_not_waiting() -> None:
    kv = PagedKVManager(KVPoolParams(64, PAGE), PagedKVOptions())
    scheduler = build_scheduler(_Liar, FcfsOptions(), SchedulerParams(4, 64, 256), kv)
    scheduler.add(make_request("a", [1, 2, 3]))
    with pytest.raises(RuntimeError, match=r"_Liar.peek\(\) returned 'stranger', which is not"):
        scheduler.schedule()


def test_core_refuses_a_victim_that_is_not_a_candidate() -> None:
    kv = PagedKVManager(KVPoolParams(2, PAGE), PagedKVOptions())
    scheduler = build_scheduler(_Liar, FcfsOptions(), SchedulerParams(4, 64, 256), kv)
    scheduler.policy.lie_in = "victims"  # type: ignore[attr-defined]
    request = make_request("a", list(range(8)))
    scheduler.add(request)
    plan = scheduler.schedule()
    request.output_token_ids.append(5)
    scheduler.update(plan, [])
    with pytest.raises(RuntimeError, match=r"choose_victim\(\) chose 'stranger', which is not"):
        scheduler.schedule()  # the ninth token needs a third page: a victim is chosen
