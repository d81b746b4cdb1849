"""``brigade bench`` on the new seams: workloads and traces carry ``extra`` data, the report
breaks metrics down by an ``extra`` field (``--by``), counts deadline misses, and says how
many seeds a difference of the observed size needs before its 95% interval excludes zero."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
from pathlib import Path
from typing import Any

import httpx
import pytest
from simulated_helpers import LLAMA_3_70B

from brigade.bench.compare import compare_runs, render_differences_markdown, seeds_needed
from brigade.bench.endpoint import Endpoint, _request
from brigade.bench.report import (
    BenchError,
    RequestTiming,
    RunMetrics,
    confidence_interval,
    parse_slo,
    render_sweep_markdown,
    summarize,
    summarize_run,
    t_quantile_975,
)
from brigade.bench.spec import parse_workload
from brigade.bench.workloads import (
    Lengths,
    WorkloadError,
    WorkloadRequest,
    draw_extra,
    load_trace,
    save_trace,
    synthetic,
)
from brigade.cli import main

# -- workloads and traces ---------------------------------------------------------------------


def test_a_trace_carries_extra_and_save_trace_keeps_it(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"arrival_time": 0.0, "prompt_len": 4, "output_len": 2, "extra": {"tier": "gold"}},
        {
            "arrival_time": 0.5,
            "prompt_len": 4,
            "output_len": 2,
            "extra": {"tier": "bronze", "deadline_s": 2.0, "tags": ["a", {"b": None}]},
        },
        {"arrival_time": 1.0, "prompt_len": 4, "output_len": 2},
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    workload = load_trace(trace, vocab_size=100)
    assert [dict(r.extra) for r in workload] == [
        {"tier": "gold"},
        {"tier": "bronze", "deadline_s": 2.0, "tags": ("a", {"b": None})},
        {},
    ]
    copy = tmp_path / "copy.jsonl"
    save_trace(workload, copy)
    assert load_trace(copy) == workload
    assert json.loads(copy.read_text().splitlines()[1])["extra"]["tags"] == ["a", {"b": None}]
    assert "extra" not in json.loads(copy.read_text().splitlines()[2])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('"gold"', "line 1: field 'extra' must be a JSON object"),
        ('{"deadline_s": -1}', r"line 1: field 'extra': extra\['deadline_s'\] is the deadline"),
        ('{"deadline_s": "soon"}', "a number > 0, got 'soon'"),
        ('{"x": NaN}', r"extra\['x'\] is nan"),
    ],
)
def test_bad_extra_in_a_trace_names_the_line_and_field(
    tmp_path: Path, extra: str, message: str
) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(f'{{"arrival_time": 0, "prompt_len": 3, "output_len": 1, "extra": {extra}}}\n')
    with pytest.raises(WorkloadError, match=message):
        load_trace(trace)


def test_synthetic_extra_fields_are_drawn_by_weight_without_changing_the_rest() -> None:
    base = "synthetic:requests=400,prompt=uniform:4:32,output=fixed:4,rate=20"
    plain = parse_workload(base).build(seed=3, vocab_size=1000)
    spec = parse_workload(base + ",extra.priority_class=gold:1/bronze:3,extra.deadline_s=2.5")
    workload = spec.build(seed=3, vocab_size=1000)
    assert spec.build(seed=3, vocab_size=1000) == workload
    # Same prompts, lengths and arrivals: only the extra data was added.
    assert [(r.arrival_time, r.prompt_token_ids, r.output_len) for r in workload] == [
        (r.arrival_time, r.prompt_token_ids, r.output_len) for r in plain
    ]
    classes = [r.extra["priority_class"] for r in workload]
    assert set(classes) == {"gold", "bronze"}
    assert classes.count("gold") / len(classes) == pytest.approx(0.25, abs=0.06)
    assert {r.extra["deadline_s"] for r in workload} == {2.5}
    # Adding a field leaves the other fields' draws alone; another seed draws anew.
    more = parse_workload(base + ",extra.priority_class=gold:1/bronze:3,extra.flag=true")
    assert [r.extra["priority_class"] for r in more.build(3, 1000)] == classes
    assert [r.extra["priority_class"] for r in spec.build(4, 1000)] != classes
    assert more.build(3, 1000)[0].extra["flag"] is True


@pytest.mark.parametrize(
    ("term", "message"),
    [
        ("extra.tier=gold:0", "weights > 0"),
        ("extra.tier=gold:1/silver", "VALUE:WEIGHT pairs"),
        ("extra.deadline_s=soon", "deadline_s is the deadline in seconds"),
        ("extra.deadline_s=0", "numbers > 0"),
        ("extra.=3", "the extra field's name must be"),
        ("extras.tier=gold", "keys: requests"),
    ],
)
def test_bad_synthetic_extra_terms_say_what_is_allowed(term: str, message: str) -> None:
    with pytest.raises(BenchError, match=message):
        parse_workload(f"synthetic:requests=4,{term}")


def test_draw_extra_checks_its_choices() -> None:
    workload = synthetic(3, Lengths("fixed", 2), Lengths("fixed", 1))
    with pytest.raises(WorkloadError, match="weights > 0"):
        draw_extra(workload, {"tier": []})
    assert draw_extra(workload, {}) == workload


def test_the_http_runner_sends_extra_as_extra_args() -> None:
    bodies: list[dict[str, Any]] = []

    def reply(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        events = 'data: {"choices": [{"text": "x"}]}\n\ndata: [DONE]\n\n'
        return httpx.Response(200, text=events, headers={"content-type": "text/event-stream"})

    async def send(request: WorkloadRequest) -> object:
        transport = httpx.MockTransport(reply)
        async with httpx.AsyncClient(transport=transport) as client:
            endpoint = Endpoint("http://bench.test/v1", "m")
            return await _request(client, "http://bench.test/v1/completions", {}, endpoint, request)

    with_extra = WorkloadRequest(0.0, (11, 12), 1, extra={"deadline_s": 2.0, "tags": ["a"]})
    timing = asyncio.run(send(with_extra))
    asyncio.run(send(WorkloadRequest(0.0, (11, 12), 1)))
    assert bodies[0]["extra_args"] == {"deadline_s": 2.0, "tags": ["a"]}
    assert "extra_args" not in bodies[1]
    assert isinstance(timing, RequestTiming)
    assert timing.extra == {"deadline_s": 2.0, "tags": ("a",)}


# -- the report: --by and deadline misses -----------------------------------------------------


def timing(e2e_s: float, **extra: Any) -> RequestTiming:
    return RequestTiming(ttft_s=e2e_s / 2, e2e_s=e2e_s, output_tokens=2, extra=extra)


def test_the_report_breaks_latency_and_goodput_down_by_an_extra_field() -> None:
    timings = [
        timing(0.2, tier="gold"),
        timing(0.4, tier="gold"),
        timing(3.0, tier="bronze"),
        timing(0.1),  # no tier
    ]
    run = RunMetrics(2.0, 0, 0.0, num_failed=1, failed_extra=({"tier": "gold"},))
    metrics = summarize_run(timings, run, parse_slo("e2e=1s"), by="tier")
    assert metrics["requests[tier=gold]"] == 3  # the failed one counts
    assert metrics["e2e_p50_ms[tier=gold]"] == pytest.approx(300.0)
    assert metrics["ttft_p99_ms[tier=bronze]"] == pytest.approx(1500.0)
    assert metrics["goodput_fraction[tier=gold]"] == pytest.approx(2 / 3)
    assert metrics["goodput_fraction[tier=bronze]"] == 0.0
    assert metrics["goodput[tier=gold]"] == pytest.approx(1.0)  # 2 met in 2 s
    assert metrics["requests[tier=(none)]"] == 1
    assert metrics["goodput_fraction"] == pytest.approx(3 / 5)
    # Without --by nothing is broken down.
    assert not any("[tier=" in name for name in summarize_run(timings, run, None))


def test_group_labels_of_non_string_values_are_json() -> None:
    timings = [timing(0.1, level=1), timing(0.2, level=True), timing(0.3, level=[1, "a"])]
    metrics = summarize_run(timings, RunMetrics(1.0, 0, 0.0), by="level")
    assert {"requests[level=1]", "requests[level=true]", 'requests[level=[1, "a"]]'} <= set(metrics)


def test_deadline_misses_count_late_and_failed_requests() -> None:
    timings = [
        timing(0.5, deadline_s=1.0, tier="gold"),  # on time
        timing(1.5, deadline_s=1.0, tier="gold"),  # late
        timing(9.0, deadline_s=10, tier="bronze"),  # on time
        timing(99.0, tier="bronze"),  # no deadline: not counted
    ]
    failed = ({"deadline_s": 5.0, "tier": "bronze"}, {"tier": "bronze"})
    run = RunMetrics(10.0, 0, 0.0, num_failed=2, failed_extra=failed)
    metrics = summarize_run(timings, run, by="tier")
    assert metrics["deadline_misses"] == 2  # the late one and the failed one with a deadline
    assert metrics["deadline_miss_fraction"] == pytest.approx(2 / 4)
    assert metrics["deadline_misses[tier=gold]"] == 1
    assert metrics["deadline_miss_fraction[tier=bronze]"] == pytest.approx(1 / 2)
    plain = summarize_run([timing(1.0)], RunMetrics(1.0, 0, 0.0))
    assert "deadline_misses" not in plain  # no request had a deadline


# -- seeds needed -----------------------------------------------------------------------------


def brute_force_seeds(mean: float, stdev: float, limit: int = 5000) -> int | None:
    """The definition, spelled out: the first n whose 95% t interval excludes zero."""
    for n in range(2, limit):
        if t_quantile_975(n - 1) * stdev / math.sqrt(n) < abs(mean):
            return n
    return None


@pytest.mark.parametrize(
    ("mean", "stdev"), [(1.0, 1.0), (-3.0, 1.0), (0.5, 2.0), (0.1, 1.0), (10.0, 0.5), (1.0, 4.0)]
)
def test_seeds_needed_is_where_the_interval_would_exclude_zero(mean: float, stdev: float) -> None:
    assert seeds_needed(mean, stdev) == brute_force_seeds(mean, stdev)


def test_seeds_needed_in_known_cases() -> None:
    assert seeds_needed(1.0, 1.0) == 7  # t(5) / sqrt(6) = 1.05 > 1; t(6) / sqrt(7) = 0.92
    assert seeds_needed(2.0, 0.0) == 2  # no spread: two seeds show it
    assert seeds_needed(0.0, 1.0) is None  # no difference, however many seeds
    assert seeds_needed(0.01, 1.0) == math.floor((1.959964 / 0.01) ** 2) + 1


def test_differences_are_paired_by_seed() -> None:
    # The workload moves both configs together; the paired difference is steady.
    baseline = [{"ttft_p99_ms": 100.0}, {"ttft_p99_ms": 300.0}, {"ttft_p99_ms": 200.0}]
    other = [{"ttft_p99_ms": 90.0}, {"ttft_p99_ms": 288.0}, {"ttft_p99_ms": 191.0, "new": 1.0}]
    (difference,) = compare_runs(baseline, other).values()
    assert difference.samples == (-10.0, -12.0, -9.0)
    mean, low, high = confidence_interval(difference.samples)
    assert (difference.mean, difference.ci_low, difference.ci_high) == (mean, low, high)
    assert difference.excludes_zero
    assert difference.seeds_needed == seeds_needed(mean, statistics.stdev(difference.samples))
    assert difference.seeds_needed is not None
    assert difference.seeds_needed <= 3  # three seeds already show it
    table = render_differences_markdown("fcfs", {"priority": compare_runs(baseline, other)}, 3)
    assert "| metric | priority - fcfs | seeds |" in table
    assert f"| ttft_p99_ms | {difference.mean:+.4g} ± " in table


# -- end to end -------------------------------------------------------------------------------


def test_bench_reports_groups_deadlines_and_seeds_needed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = tmp_path / "llama-3-70b"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(LLAMA_3_70B), encoding="utf-8")
    configs = []
    for scheduler in ("fcfs", "priority"):
        config = tmp_path / f"{scheduler}.toml"
        config.write_text(
            f'[model]\npath = "{model_dir}"\nmax_model_len = 4096\n'
            '[executor]\nplugin = "simulated"\ngpu = "H100"\nnum_gpus = 4\n'
            f'[kv]\nmax_memory_gib = 100\n[scheduler]\nplugin = "{scheduler}"\n'
            "max_num_seqs = 4\n"
        )
        configs += ["--config", str(config)]
    out = tmp_path / "bench.json"
    workload = (
        "synthetic:requests=60,prompt=uniform:64:512,output=fixed:32,rate=20,"
        "priorities=0:1/1:4,extra.priority_class=gold:1/bronze:4,extra.deadline_s=3"
    )
    argv = ["bench", *configs, "--workload", workload, "--seeds", "3", "--json", str(out)]
    assert main([*argv, "--by", "priority_class", "--slo", "ttft=500ms", "--quiet"]) == 0
    report = capsys.readouterr().out
    assert report.splitlines()[0] == "| metric | fcfs | priority |"
    for row in (
        "| deadline_misses |",
        "| deadline_miss_fraction |",
        "| e2e_p99_ms[priority_class=gold] |",
        "| goodput_fraction[priority_class=bronze] |",
        "| deadline_misses[priority_class=gold] |",
        "| requests[priority_class=gold] |",
    ):
        assert row in report, row
    assert "| metric | priority - fcfs | seeds |" in report
    result = json.loads(out.read_text())
    fcfs = result["configs"]["fcfs"]["metrics"]
    assert fcfs["requests[priority_class=gold]"]["mean"] + (
        fcfs["requests[priority_class=bronze]"]["mean"]
    ) == pytest.approx(60)
    assert 0 < fcfs["deadline_misses"]["mean"] <= 60  # a queue builds: some come too late
    differences = result["differences"]
    assert differences["baseline"] == "fcfs"
    ttft = differences["configs"]["priority"]["ttft_p50_ms"]
    assert len(ttft["samples"]) == 3
    assert ttft["ci95"][0] <= ttft["mean"] <= ttft["ci95"][1]
    expected = seeds_needed(ttft["mean"], statistics.stdev(ttft["samples"]))
    assert ttft["seeds_needed"] == expected


def test_bench_by_a_field_no_request_has_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--endpoint", "http://127.0.0.1:1/v1", "--model", "m", "--by", "tier"]
    workload = "synthetic:requests=2,extra.priority_class=gold"
    assert main([*argv, "--workload", workload]) == 2
    err = capsys.readouterr().err
    assert "--by 'tier': no request of the workload has extra field 'tier'" in err
    assert "fields present: priority_class" in err


def test_a_sweep_table_shows_deadline_and_group_columns() -> None:
    runs = [
        summarize_run(
            [timing(0.5, deadline_s=1.0, tier="gold"), timing(2.0, deadline_s=1.0, tier="x")],
            RunMetrics(1.0, 0, 0.0),
            parse_slo("e2e=1s"),
            by="tier",
        )
    ]
    table = render_sweep_markdown("rate", ["1"], {"fcfs": [summarize(runs)]})
    header = table.splitlines()[2]
    for column in (
        "deadline_miss_fraction",
        "goodput_fraction[tier=gold]",
        "deadline_miss_fraction[tier=x]",
    ):
        assert f" {column} |" in header, column
