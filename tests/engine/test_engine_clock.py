"""One engine clock: arrival, queue and policy times all come from it, and the simulator
replaces it with its virtual clock (so time-based policies are simulated in simulated time)."""

from __future__ import annotations

import itertools
import re
import time
from pathlib import Path
from typing import Any

import pytest
from simulated_helpers import settings

from brigade.bench.simulate import VirtualClock, run_simulation
from brigade.bench.workloads import Lengths, WorkloadRequest, synthetic
from brigade.config import load_config
from brigade.engine import EngineCore
from brigade.errors import ConfigError
from brigade.interfaces import (
    KVPoolParams,
    NoOptions,
    Request,
    SamplingParams,
    SchedulerParams,
    SchedulerView,
)
from brigade.models.create import create_model
from brigade.plugins.kv.paged import PagedKVManager, PagedKVOptions
from brigade.plugins.schedulers.fcfs import FcfsOptions, FcfsPolicy
from brigade.registry import Registry, load_registry
from brigade.testing.conformance import build_scheduler, check_scheduler
from brigade.testing.requests import make_request

ROOT = Path(__file__).resolve().parents[2]


class RecordingPolicy(FcfsPolicy):
    """FCFS that keeps every request it was given and, when it admits one, how long the
    request had waited by the engine clock (``view.now()``)."""

    def __init__(self, view: SchedulerView, options: FcfsOptions) -> None:
        super().__init__(view, options)
        self.added: list[Request] = []
        self.waits: dict[str, float] = {}

    def enqueue(self, request: Request, *, preempted: bool) -> None:
        if not preempted:
            self.added.append(request)
        super().enqueue(request, preempted=preempted)

    def admit(self, request: Request) -> None:
        self.waits.setdefault(request.request_id, self.view.now() - request.arrival_time)
        super().admit(request)


def registry_with(name: str, factory: Any, options: Any = None) -> Registry:
    registry = load_registry()
    if options is None:
        registry.add("scheduler", name, factory)
    else:
        registry.add("scheduler", name, factory, options=options)
    return registry


def engines_built(monkeypatch: pytest.MonkeyPatch) -> list[EngineCore]:
    """Every EngineCore constructed from now on (the simulator builds its own)."""
    built: list[EngineCore] = []
    original = EngineCore.__init__

    def init(self: EngineCore, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(EngineCore, "__init__", init)
    return built


def test_requests_ten_seconds_apart_arrive_ten_simulated_seconds_apart(
    model_70b: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The defect: arrival_time was stamped with time.monotonic, so 20 requests meant to
    # arrive 10 s apart all "arrived" within 0.1 s of wall time.
    workload = [
        WorkloadRequest(10.0 * index, tuple(range(10, 74)), output_len=8) for index in range(20)
    ]
    registry = registry_with("recording", RecordingPolicy, FcfsOptions)
    built = engines_built(monkeypatch)
    started = time.perf_counter()
    result = run_simulation(
        settings(model_70b, 'scheduler.plugin="recording"'), workload, registry=registry
    )
    assert time.perf_counter() - started < 60  # virtual time: 190 s simulated in far less
    (engine,) = built
    scheduler = engine.scheduler.policy
    assert isinstance(scheduler, RecordingPolicy)
    arrivals = [request.arrival_time for request in scheduler.added]
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    assert gaps == pytest.approx([10.0] * 19, abs=0.05)
    assert arrivals[0] == pytest.approx(0.0, abs=0.05)
    assert arrivals[-1] == pytest.approx(190.0, abs=0.05)
    # Queue times are on the same clock: each request starts as soon as it arrives.
    for request in scheduler.added:
        assert request.first_scheduled_time is not None
        assert 0.0 <= request.first_scheduled_time - request.arrival_time < 0.05
    assert engine.stats().mean_queue_time_s < 0.05
    assert result.duration_s > 190.0


def test_a_policy_reads_waiting_time_in_simulated_seconds(
    model_70b: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One sequence at a time: each request waits for all those before it, ~8 decode steps
    # of ~20 ms each, so the k-th request's wait grows by a fixed virtual amount.
    workload = synthetic(6, Lengths("fixed", 32), Lengths("fixed", 8))  # all at t = 0
    registry = registry_with("recording", RecordingPolicy, FcfsOptions)
    built = engines_built(monkeypatch)
    result = run_simulation(
        settings(model_70b, 'scheduler.plugin="recording"', "scheduler.max_num_seqs=1"),
        workload,
        registry=registry,
    )
    (engine,) = built
    scheduler = engine.scheduler.policy
    assert isinstance(scheduler, RecordingPolicy)
    waits = [scheduler.waits[str(index)] for index in range(6)]
    assert waits[0] == 0.0
    # What the policy saw is what the simulation measured: the wait ends with the request's
    # first step, and TTFT is that wait plus the (prefill) step itself.
    records = result.requests
    for wait, record in zip(waits, records, strict=True):
        assert 0.0 <= record.ttft_s - wait < 0.1
    service = waits[1] - waits[0]
    assert service > 0.1  # 8 steps of a 70B model, in simulated seconds (wall: microseconds)
    assert [later - earlier for earlier, later in itertools.pairwise(waits)] == (
        pytest.approx([service] * 5, rel=0.05)
    )


def deadline_policy_from_the_docs() -> type:
    """The ``DeadlinePolicy`` listing of docs/plugins.md, executed as written."""
    guide = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")
    match = re.search(r"<!-- deadline-policy -->\n```python\n(.*?)\n```\n", guide, re.DOTALL)
    assert match is not None, "docs/plugins.md lost its deadline-policy listing"
    namespace: dict[str, Any] = {}
    exec(compile(match[1], "docs/plugins.md", "exec"), namespace)
    policy: type = namespace["DeadlinePolicy"]
    return policy


def test_the_deadline_policy_in_the_docs_conforms() -> None:
    check_scheduler(deadline_policy_from_the_docs(), NoOptions(), PagedKVManager, PagedKVOptions())


def test_the_deadline_policy_orders_by_extra_and_reads_the_engine_clock() -> None:
    now = [0.0]
    params = SchedulerParams(8, 64, max_model_len=128, clock=lambda: now[0])
    kv = PagedKVManager(KVPoolParams(64, 4, True), PagedKVOptions())
    scheduler = build_scheduler(deadline_policy_from_the_docs(), NoOptions(), params, kv)
    none = make_request("none", [7, 8, 9], arrival_time=0.0)
    relaxed = make_request("relaxed", [4, 5, 6], arrival_time=0.5, extra={"deadline_s": 5.0})
    urgent = make_request("urgent", [1, 2, 3], arrival_time=1.0, extra={"deadline_s": 1.0})
    for request in (none, relaxed, urgent):
        scheduler.add(request)
    assert scheduler.policy.peek() is urgent  # due at 2.0, before relaxed's 5.5
    now[0] = 3.0  # urgent can no longer make it: relaxed goes first
    assert scheduler.policy.peek() is relaxed
    now[0] = 9.0  # both late: earliest due first; no deadline comes last
    assert scheduler.policy.peek() is urgent
    plan = scheduler.schedule()
    assert [item.request.request_id for item in plan.scheduled] == ["urgent", "relaxed", "none"]


def test_a_time_based_policy_behaves_by_simulated_time(model_70b: Path) -> None:
    """The docs' deadline policy, one sequence at a time: A runs ~10 simulated seconds; B
    (due 5 s after it arrives) and C (due after 60 s) wait. When A ends B is already late
    on the virtual clock, so C goes first. Had the policy read the wall clock (or the
    arrivals been stamped with it), B would still have looked on time and gone first."""
    decode_s = 0.0195  # about one decode step of the 70B on 4 x H100 (see test_simulated)
    long_output = round(10.0 / decode_s)
    prompt = tuple(range(10, 42))
    workload = [
        WorkloadRequest(0.0, prompt, output_len=long_output),
        WorkloadRequest(1.0, prompt, output_len=4, extra={"deadline_s": 5.0}),
        WorkloadRequest(2.0, prompt, output_len=4, extra={"deadline_s": 60.0}),
    ]
    registry = registry_with("deadline", deadline_policy_from_the_docs())
    result = run_simulation(
        settings(model_70b, 'scheduler.plugin="deadline"', "scheduler.max_num_seqs=1"),
        workload,
        registry=registry,
    )
    a, b, c = result.requests
    assert a.e2e_s > 6.0  # B's deadline (1 + 5 s) passes while A runs
    c_start, b_start = c.arrival_time + c.ttft_s, b.arrival_time + b.ttft_s
    assert c_start < b_start, "the late request B should have yielded to C"
    assert c.e2e_s < 60.0  # C makes its deadline; B had missed its own already
    assert b.e2e_s > 5.0


def test_engine_clock_stamps_requests_and_is_the_schedulers(model_70b: Path) -> None:
    registry = load_registry()
    config = load_config(
        None, registry, overrides=["executor.plugin=simulated", *settings(model_70b)]
    )
    clock = VirtualClock(100.0)
    engine = EngineCore(config, registry, clock=clock)
    assert engine.clock is clock
    assert engine.scheduler.params.clock is clock
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    request = engine.add_request("r", [11, 12, 13], params)
    assert request.arrival_time == 100.0
    clock.advance(2.5)
    engine.step()
    assert request.first_scheduled_time == 102.5
    assert engine.stats().mean_queue_time_s == pytest.approx(2.5)
    with pytest.raises(ValueError, match="cannot go back"):
        clock.advance(-1.0)
    clock.advance_to(50.0)  # the past: no-op
    assert clock() == 102.5


def test_the_default_engine_clock_is_monotonic(model_70b: Path) -> None:
    registry = load_registry()
    config = load_config(
        None, registry, overrides=["executor.plugin=simulated", *settings(model_70b)]
    )
    engine = EngineCore(config, registry)
    assert engine.clock is time.monotonic
    assert engine.scheduler.params.clock is time.monotonic
    before = time.monotonic()
    request = engine.add_request("r", [11, 12], SamplingParams(max_tokens=1, ignore_eos=True))
    assert before <= request.arrival_time <= time.monotonic()


def test_simulating_needs_an_executor_that_models_time(tmp_path: Path) -> None:
    model_dir = create_model(tmp_path / "tiny", "llama", overrides={"num_hidden_layers": 1})
    workload = synthetic(1, Lengths("fixed", 4), Lengths("fixed", 2), vocab_size=256)
    with pytest.raises(ConfigError, match="does not model time"):
        run_simulation([f"model.path={model_dir}", "executor.plugin=torch"], workload)
