"""Seeded workload generators and JSONL trace replay."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest

from brigade.bench.workloads import (
    Arrivals,
    Lengths,
    WorkloadError,
    load_trace,
    multi_turn,
    save_trace,
    shared_prefix,
    synthetic,
)


def lengths(distribution: Lengths, count: int = 4000) -> list[int]:
    workload = synthetic(count, Lengths("fixed", 1), distribution, seed=1)
    return [request.output_len for request in workload]


def test_the_same_seed_gives_the_same_workload() -> None:
    args = (50, Lengths("uniform", 100, 50), Lengths("normal", 20, 5), Arrivals("poisson", 5.0))
    assert synthetic(*args, seed=7) == synthetic(*args, seed=7)
    assert synthetic(*args, seed=7) != synthetic(*args, seed=8)


@pytest.mark.parametrize(
    ("distribution", "low", "high"),
    [
        (Lengths("fixed", 64), 64, 64),
        (Lengths("uniform", 100, 20), 80, 120),
        (Lengths("normal", 200, 30), 1, None),
        (Lengths("lognormal", 300, 0.8, maximum=5000), 1, 5000),
    ],
)
def test_length_distributions_have_their_mean_and_bounds(
    distribution: Lengths, low: int, high: int | None
) -> None:
    values = lengths(distribution)
    assert statistics.fmean(values) == pytest.approx(distribution.mean, rel=0.05)
    assert min(values) >= low
    if high is not None:
        assert max(values) <= high
    if distribution.kind != "fixed":
        assert len(set(values)) > 10


def test_lengths_are_clipped_to_their_bounds() -> None:
    values = lengths(Lengths("normal", 100, 100, minimum=50, maximum=120))
    assert min(values) == 50
    assert max(values) == 120


@pytest.mark.parametrize(
    "bad",
    [
        lambda: Lengths("zipf", 10),  # type: ignore[arg-type]
        lambda: Lengths("fixed", 0),
        lambda: Lengths("normal", 10, minimum=5, maximum=4),
        lambda: Arrivals("poisson"),
        lambda: Arrivals("gamma", 1.0, burstiness=0),
    ],
)
def test_bad_distributions_are_rejected(bad: object) -> None:
    with pytest.raises(WorkloadError):
        bad()  # type: ignore[operator]


def test_poisson_arrivals_come_at_the_rate() -> None:
    workload = synthetic(4000, Lengths("fixed", 4), Lengths("fixed", 1), Arrivals("poisson", 10.0))
    times = [request.arrival_time for request in workload]
    assert times == sorted(times)
    assert times[0] == 0.0
    assert times[-1] == pytest.approx(400, rel=0.05)


def test_gamma_burstiness_below_one_clusters_arrivals() -> None:
    def gap_spread(burstiness: float) -> float:
        arrivals = Arrivals("gamma", 10.0, burstiness)
        workload = synthetic(4000, Lengths("fixed", 4), Lengths("fixed", 1), arrivals)
        times = [request.arrival_time for request in workload]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        return statistics.stdev(gaps) / statistics.fmean(gaps)

    assert gap_spread(0.25) > 1.5 > gap_spread(1.0) > 0.8 > gap_spread(4.0)


def test_all_at_once_arrivals_are_at_zero() -> None:
    workload = synthetic(10, Lengths("fixed", 4), Lengths("fixed", 1))
    assert {request.arrival_time for request in workload} == {0.0}


def test_priorities_follow_their_weights() -> None:
    workload = synthetic(
        2000, Lengths("fixed", 4), Lengths("fixed", 1), priorities=((0, 0.25), (3, 0.75))
    )
    high = sum(1 for request in workload if request.priority == 0)
    assert {request.priority for request in workload} == {0, 3}
    assert high / len(workload) == pytest.approx(0.25, abs=0.04)


def test_shared_prefix_groups_share_their_prefix() -> None:
    workload = shared_prefix(3, 10, 100, Lengths("fixed", 20), Lengths("fixed", 8), seed=2)
    prefixes = {request.prompt_token_ids[:100] for request in workload}
    assert len(workload) == 30
    assert len(prefixes) == 3
    assert len({request.prompt_token_ids for request in workload}) == 30
    # Interleaved, not group after group.
    order = [request.prompt_token_ids[:100] for request in workload[:10]]
    assert len(set(order)) > 1


def test_multi_turn_prompts_extend_the_previous_turn() -> None:
    workload = multi_turn(
        2, 3, Lengths("fixed", 10), Lengths("fixed", 5), Arrivals("poisson", 0.1), think_time_s=2
    )
    assert len(workload) == 6
    by_length = sorted(workload, key=lambda request: len(request.prompt_token_ids))
    turns = [r for r in by_length if r.prompt_token_ids[:10] == by_length[0].prompt_token_ids[:10]]
    assert [len(r.prompt_token_ids) for r in turns] == [10, 25, 40]
    for earlier, later in itertools.pairwise(turns):
        assert later.prompt_token_ids[: len(earlier.prompt_token_ids)] == earlier.prompt_token_ids
        assert later.arrival_time == pytest.approx(earlier.arrival_time + 2)


def write_trace(path: Path, *records: object) -> Path:
    path.write_text("\n".join(json.dumps(record) for record in records) + "\n")
    return path


def test_a_trace_replays_every_prompt_form(tmp_path: Path) -> None:
    trace = write_trace(
        tmp_path / "trace.jsonl",
        {"arrival_time": 1.5, "prompt_token_ids": [11, 12, 13], "output_len": 4, "priority": 2},
        {"arrival_time": 0.5, "prompt_len": 6, "output_len": 3},
        {"arrival_time": 1.0, "prompt": "a b", "output_len": 1},
    )
    workload = load_trace(trace, tokenize=lambda text: [len(word) + 20 for word in text.split()])
    assert [request.arrival_time for request in workload] == [0.5, 1.0, 1.5]
    assert len(workload[0].prompt_token_ids) == 6
    assert workload[1].prompt_token_ids == (21, 21)
    assert workload[2].prompt_token_ids == (11, 12, 13)
    assert workload[2].priority == 2
    assert workload[0].priority == 0


def test_save_trace_round_trips(tmp_path: Path) -> None:
    workload = synthetic(
        20, Lengths("uniform", 30, 10), Lengths("fixed", 5), Arrivals("gamma", 3.0, 0.5)
    )
    save_trace(workload, tmp_path / "out.jsonl")
    assert load_trace(tmp_path / "out.jsonl") == workload


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"prompt_len": 4, "output_len": 2}, "line 2: field 'arrival_time'"),
        ({"arrival_time": -1, "prompt_len": 4, "output_len": 2}, "line 2: field 'arrival_time'"),
        ({"arrival_time": 0, "output_len": 2}, "line 2: give exactly one"),
        ({"arrival_time": 0, "prompt_len": 4, "prompt": "x", "output_len": 2}, "exactly one"),
        ({"arrival_time": 0, "prompt_len": 0, "output_len": 2}, "line 2: field 'prompt_len'"),
        ({"arrival_time": 0, "prompt_len": 4}, "line 2: field 'output_len'"),
        ({"arrival_time": 0, "prompt_token_ids": [1, "a"], "output_len": 1}, "'prompt_token_ids'"),
        ({"arrival_time": 0, "prompt_token_ids": [], "output_len": 1}, "empty prompt"),
        ({"arrival_time": 0, "prompt": "hi", "output_len": 1}, "needs a tokenizer"),
        ({"arrival_time": 0, "prompt_len": 3, "output_len": 1, "priority": 1.5}, "'priority'"),
        ([1, 2], "line 2: expected a JSON object"),
    ],
)
def test_bad_trace_lines_name_the_line_and_field(
    tmp_path: Path, record: object, message: str
) -> None:
    good = {"arrival_time": 0, "prompt_len": 3, "output_len": 1}
    trace = write_trace(tmp_path / "bad.jsonl", good, record)
    with pytest.raises(WorkloadError, match=message):
        load_trace(trace)


def test_a_trace_that_is_not_json_names_the_line(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"arrival_time": 0, "prompt_len": 3, "output_len": 1}\n\n{oops\n')
    with pytest.raises(WorkloadError, match="line 3: not valid JSON"):
        load_trace(trace)
