"""The priority scheduler: ordering, preemption for better work, aging, and end to end the same
greedy tokens for every preempted request."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from brigade import LLM, SamplingParams
from brigade.interfaces import (
    KVPoolParams,
    Request,
    RequestStatus,
    SchedulerOutput,
    SchedulerParams,
    hookimpl,
)
from brigade.models.create import create_model
from brigade.plugins.kv.paged import PagedKVManager, PagedKVOptions
from brigade.plugins.schedulers.priority import PriorityOptions, PriorityPolicy
from brigade.registry import load_registry
from brigade.scheduling import BatchScheduler
from brigade.testing.conformance import build_scheduler, check_scheduler, finish_step, simulate
from brigade.testing.parity import assert_same_greedy_outputs
from brigade.testing.requests import make_request

PAGE = 4


def make(
    num_pages: int = 100, *, max_seqs: int = 8, budget: int = 64, aging_steps: int = 0
) -> tuple[BatchScheduler, PagedKVManager]:
    kv = PagedKVManager(
        KVPoolParams(num_pages, PAGE, enable_prefix_caching=False), PagedKVOptions()
    )
    params = SchedulerParams(max_seqs, budget, max_model_len=256)
    options = PriorityOptions(aging_steps=aging_steps)
    return build_scheduler(PriorityPolicy, options, params, kv), kv


def step(scheduler: BatchScheduler, kv: PagedKVManager) -> SchedulerOutput:
    """One engine step without a model, as core runs it (see ``conformance.simulate``)."""
    plan = scheduler.schedule()
    finish_step(scheduler, kv, plan, 5)
    return plan


def ids(requests: Sequence[Request]) -> list[str]:
    return [r.request_id for r in requests]


@pytest.mark.parametrize("aging_steps", [0, 3])
def test_priority_conforms_and_preempts_runners_for_urgent_arrivals(aging_steps: int) -> None:
    options = PriorityOptions(aging_steps=aging_steps)
    report = check_scheduler(PriorityPolicy, options, PagedKVManager, PagedKVOptions())
    assert report.num_preempted_for_waiting > 0


def test_runs_by_priority_then_arrival() -> None:
    scheduler, kv = make(max_seqs=1)
    levels = {"a": 2, "b": 0, "c": 1, "d": 0, "e": 2}
    requests = [
        make_request(name, [1, 2, 3], max_tokens=2, priority=level, arrival_time=float(index))
        for index, (name, level) in enumerate(levels.items())
    ]
    plans = simulate(scheduler, kv, requests, page_size=PAGE)
    started: list[str] = []
    for plan in plans:
        started += [
            s.request.request_id for s in plan.scheduled if s.request.request_id not in started
        ]
    assert started == ["b", "d", "c", "a", "e"]
    assert not any(plan.preempted for plan in plans), "nobody better ever waited"


def test_a_better_arrival_preempts_the_worst_runner_latest_arrival_first() -> None:
    scheduler, kv = make(max_seqs=4)
    runners = [
        make_request(
            f"p{level}-t{index}",
            [index] * 6,
            max_tokens=50,
            priority=level,
            arrival_time=float(index),
        )
        for index, level in enumerate([3, 5, 5, 1])
    ]
    for request in runners:
        scheduler.add(request)
    step(scheduler, kv)
    urgent = make_request("urgent", [9] * 6, max_tokens=3, priority=0, arrival_time=10.0)
    scheduler.add(urgent)
    plan = step(scheduler, kv)
    assert ids(plan.preempted) == ["p5-t2"], "largest priority value, latest arrival"
    assert urgent.num_output_tokens == 1, "the whole prompt ran in the step it arrived"
    # The victim re-queues with its own priority, ahead of an equal-priority later arrival.
    later = make_request("p5-later", [8] * 6, max_tokens=3, priority=5, arrival_time=11.0)
    scheduler.add(later)
    assert scheduler.policy.peek() is runners[2]
    assert runners[2].status is RequestStatus.PREEMPTED


def test_no_preemption_for_an_equal_or_worse_waiter() -> None:
    scheduler, kv = make(max_seqs=2)
    for index in range(2):
        scheduler.add(
            make_request(f"r{index}", [1] * 4, max_tokens=20, priority=3, arrival_time=float(index))
        )
    step(scheduler, kv)
    scheduler.add(make_request("same", [2] * 4, priority=3, arrival_time=5.0))
    scheduler.add(make_request("worse", [3] * 4, priority=4, arrival_time=6.0))
    for _ in range(5):
        assert not step(scheduler, kv).preempted
    assert scheduler.stats().num_waiting == 2


def test_a_better_arrival_preempts_when_the_kv_pool_is_exhausted() -> None:
    # 12 pages: two 20-token prompts (5 pages each + growth) leave no room for a third.
    scheduler, kv = make(num_pages=12, max_seqs=8)
    low = [
        make_request(f"low{i}", [i + 1] * 20, max_tokens=16, priority=2, arrival_time=float(i))
        for i in range(2)
    ]
    for request in low:
        scheduler.add(request)
    step(scheduler, kv)
    step(scheduler, kv)
    urgent = make_request("urgent", [7] * 10, max_tokens=4, priority=0, arrival_time=5.0)
    scheduler.add(urgent)
    first_token_step = None
    for index in range(1, 6):
        step(scheduler, kv)
        if urgent.num_output_tokens:
            first_token_step = index
            break
    assert first_token_step == 1, "pages were taken from the low-priority runner at once"
    assert low[1].num_preemptions == 1
    assert low[0].num_preemptions == 0
    while scheduler.has_unfinished():
        step(scheduler, kv)
    assert all(r.num_output_tokens == 16 for r in low)
    assert kv.num_free_pages() == 12


def test_growth_preemption_takes_the_worst_priority_not_the_latest_admitted() -> None:
    scheduler, kv = make(num_pages=5, max_seqs=8)
    low = make_request("low", [1] * 8, max_tokens=10, priority=4, arrival_time=0.0)
    high = make_request("high", [2] * 8, max_tokens=10, priority=1, arrival_time=1.0)
    scheduler.add(low)
    step(scheduler, kv)
    scheduler.add(high)  # fits now; admitted after low, so FCFS would preempt it when both grow
    plans = [step(scheduler, kv) for _ in range(3)]
    victims = [r.request_id for plan in plans for r in plan.preempted]
    assert victims
    assert set(victims) == {"low"}


def run_stream(aging_steps: int, num_steps: int) -> int | None:
    """One slot, a steady stream of priority-0 work; the step the priority-5 request started."""
    scheduler, kv = make(max_seqs=1, aging_steps=aging_steps)
    starved = make_request("starved", [1, 2], max_tokens=2, priority=5, arrival_time=0.0)
    scheduler.add(starved)
    for index in range(num_steps):
        scheduler.add(
            make_request(f"hot{index}", [3, 4], max_tokens=2, priority=0, arrival_time=1.0 + index)
        )
        plan = step(scheduler, kv)
        if any(s.request is starved for s in plan.scheduled):
            return index
    return None


def test_aging_lets_a_low_priority_request_through_sustained_load() -> None:
    assert run_stream(aging_steps=0, num_steps=80) is None, "without aging it should starve"
    started = run_stream(aging_steps=2, num_steps=80)
    # Five levels at one per two steps: it goes ahead of work that arrived 10+ steps after it,
    # so it waits for the ten earlier two-step jobs at most.
    assert started is not None
    assert started <= 10 * 2 + 2, started


def test_an_aged_runner_is_not_preempted_by_the_work_it_overtook() -> None:
    scheduler, kv = make(max_seqs=1, aging_steps=1)
    starved = make_request("starved", [1, 2], max_tokens=6, priority=3, arrival_time=0.0)
    scheduler.add(starved)
    for index in range(30):
        scheduler.add(make_request(f"hot{index}", [3], max_tokens=1, arrival_time=1.0 + index))
        step(scheduler, kv)
    assert starved.is_finished
    assert starved.num_preemptions == 0


# -- end to end through brigade.LLM ---------------------------------------------------------

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
LOGPROB_ATOL = 1e-4
"""Two brigade runs of one model: log probabilities of a near-tie."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("priority-model")
    return create_model(root / "llama", "llama", overrides={"num_hidden_layers": 2})


def make_llm(model_dir: Path, *settings: str) -> LLM:
    base = [f"model.path={model_dir}", "kv.page_size=4", "model.dtype=float32"]
    return LLM(overrides=[*base, *settings])


def prompt(length: int, seed: int) -> list[int]:
    return [(seed * 131 + 17 * i) % 3000 + 5 for i in range(length)]


@pytest.mark.parametrize(
    "room",
    [
        ["scheduler.max_num_seqs=3", "kv.num_pages=256"],
        # 13 pages of 4 tokens: the three low-priority requests hold 12 when the urgent arrives.
        ["scheduler.max_num_seqs=8", "kv.num_pages=13", "kv.enable_prefix_caching=false"],
    ],
    ids=["batch full", "kv exhausted"],
)
def test_urgent_request_gets_a_token_fast_and_preempted_ones_keep_their_tokens(
    model_dir: Path, room: list[str]
) -> None:
    llm = make_llm(model_dir, 'scheduler.plugin="priority"', *room)
    engine = llm.engine
    prompts = {f"low{i}": prompt(12, i) for i in range(3)} | {"urgent": prompt(7, 9)}
    outputs: dict[str, tuple[list[int], list]] = {name: ([], []) for name in prompts}

    def advance() -> None:
        for update in engine.step():
            tokens, logprobs = outputs[update.request.request_id]
            tokens += update.new_token_ids
            logprobs += update.logprobs or []

    low = [
        engine.add_request(n, p, GREEDY, priority=5) for n, p in prompts.items() if n != "urgent"
    ]
    for _ in range(4):
        advance()
    assert all(r.status is RequestStatus.RUNNING for r in low)
    urgent = engine.add_request("urgent", prompts["urgent"], GREEDY, priority=0)
    steps_to_first_token = 0
    while not outputs["urgent"][0]:
        advance()
        steps_to_first_token += 1
    assert steps_to_first_token <= 2
    while engine.has_unfinished():
        advance()
    assert urgent.num_preemptions == 0
    assert low[2].num_preemptions > 0, "the latest arrival among equals yields first"
    assert low[0].num_preemptions == 0
    stats = engine.kv.stats()
    assert stats.num_free_pages == stats.num_pages, "pages leaked"
    alone_llm = make_llm(model_dir, "kv.num_pages=256")
    alone = []
    for token_ids in prompts.values():
        [result] = alone_llm.generate([token_ids], GREEDY)
        alone.append((result.outputs[0].token_ids, result.outputs[0].logprobs))
    ours = [outputs[name] for name in prompts]
    assert all(len(tokens) == GREEDY.max_tokens for tokens, _ in ours)
    assert_same_greedy_outputs(ours, alone, atol=LOGPROB_ATOL, label="priority")


class FinishOrder:
    """Records request ids in the order they finish (an observer plugin)."""

    def __init__(self) -> None:
        self.finished: list[str] = []

    @hookimpl
    def brigade_request_finished(self, request: Request) -> None:
        self.finished.append(request.request_id)


def test_generate_passes_priorities_through(model_dir: Path) -> None:
    recorder = FinishOrder()
    base = [f"model.path={model_dir}", "kv.page_size=4", "model.dtype=float32"]
    llm = LLM(
        overrides=[*base, 'scheduler.plugin="priority"', "scheduler.max_num_seqs=1"],
        registry=load_registry(plugins=[recorder]),
    )
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([prompt(5, i) for i in range(3)], params, priority=[2, 0, 1])
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 3, 3]
    assert recorder.finished == ["1-0", "2-0", "0-0"]
