"""Prometheus metrics: names, labels, histograms and counters fed from engine totals; several
front-end processes adding up their series in one directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from brigade.server.metrics import FINISH_REASONS, MULTIPROCESS_ENV, ServerMetrics, forget_process
from brigade.speculative import SpeculativeStats

MODEL = "tiny-llama"
LABEL = {"model_name": MODEL}

HISTOGRAMS = [
    "brigade:time_to_first_token_seconds",
    "brigade:inter_token_latency_seconds",
    "brigade:e2e_request_latency_seconds",
    "brigade:request_queue_time_seconds",
    "brigade:grammar_wait_seconds",
]
GAUGES = [
    "brigade:num_requests_running",
    "brigade:num_requests_waiting",
    "brigade:kv_cache_usage_perc",
]
COUNTERS = [
    "brigade:prompt_tokens_total",
    "brigade:generation_tokens_total",
    "brigade:prefix_cache_queries_total",
    "brigade:prefix_cache_hits_total",
    "brigade:num_preemptions_total",
    "brigade:grammar_errors_total",
    "brigade:request_success_total",
]


def value(metrics: ServerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {**LABEL, **labels})


def engine(
    metrics: ServerMetrics, *, queries: int = 0, hits: int = 0, preemptions: int = 0
) -> None:
    metrics.observe_engine(
        num_running=1,
        num_waiting=0,
        kv_usage=0.5,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        num_preemptions=preemptions,
    )


def test_render_lists_every_metric_with_the_model_label() -> None:
    metrics = ServerMetrics(MODEL)
    body, content_type = metrics.render()
    text = body.decode()
    assert content_type.startswith("text/plain")
    for name in HISTOGRAMS:
        assert f'{name}_count{{model_name="{MODEL}"}} 0.0' in text
    for name in GAUGES:
        assert f'{name}{{model_name="{MODEL}"}} 0.0' in text
    for name in COUNTERS[:-1]:
        assert f'{name}{{model_name="{MODEL}"}} 0.0' in text
    for reason in FINISH_REASONS:
        assert (
            f'brigade:request_success_total{{finished_reason="{reason}",model_name="{MODEL}"}} 0.0'
        ) in text
    # The exposition parses back, and every family is ours.
    families = {family.name for family in text_string_to_metric_families(text)}
    assert all(name.startswith("brigade:") for name in families)


def test_servers_in_one_process_keep_separate_registries() -> None:
    first, second = ServerMetrics("a"), ServerMetrics("a")
    first.observe_finished(3, 4, 1.0, "stop")
    assert first.registry.get_sample_value("brigade:prompt_tokens_total", {"model_name": "a"}) == 3
    assert second.registry.get_sample_value("brigade:prompt_tokens_total", {"model_name": "a"}) == 0


def test_histograms_count_observations_in_the_right_buckets() -> None:
    metrics = ServerMetrics(MODEL)
    metrics.observe_first_token(ttft_s=0.05, queue_time_s=0.002)
    metrics.observe_first_token(ttft_s=3.0, queue_time_s=1.5)
    for _ in range(5):
        metrics.observe_inter_token(0.012)
    metrics.observe_finished(10, 5, 4.2, "length")

    ttft = "brigade:time_to_first_token_seconds"
    assert value(metrics, f"{ttft}_count") == 2
    assert value(metrics, f"{ttft}_sum") == pytest.approx(3.05)
    assert value(metrics, f"{ttft}_bucket", le="0.1") == 1
    assert value(metrics, f"{ttft}_bucket", le="5.0") == 2
    assert value(metrics, "brigade:request_queue_time_seconds_count") == 2
    assert value(metrics, "brigade:inter_token_latency_seconds_count") == 5
    assert value(metrics, "brigade:inter_token_latency_seconds_bucket", le="0.01") == 0
    assert value(metrics, "brigade:inter_token_latency_seconds_bucket", le="0.015") == 5
    assert value(metrics, "brigade:e2e_request_latency_seconds_count") == 1


def test_finished_requests_count_tokens_and_reasons() -> None:
    metrics = ServerMetrics(MODEL)
    metrics.observe_finished(prompt_tokens=7, generation_tokens=3, e2e_s=0.4, finish_reason="stop")
    metrics.observe_finished(
        prompt_tokens=5, generation_tokens=16, e2e_s=2.0, finish_reason="length"
    )
    metrics.observe_finished(prompt_tokens=2, generation_tokens=0, e2e_s=0.1, finish_reason="abort")
    metrics.observe_finished(prompt_tokens=1, generation_tokens=2, e2e_s=0.1, finish_reason="error")
    assert value(metrics, "brigade:prompt_tokens_total") == 15
    assert value(metrics, "brigade:generation_tokens_total") == 21
    for reason in FINISH_REASONS:
        assert value(metrics, "brigade:request_success_total", finished_reason=reason) == 1


def test_grammars_are_counted_by_kind_with_their_wait_and_errors() -> None:
    metrics = ServerMetrics(MODEL)
    metrics.observe_grammar("json_schema", 0.2, valid=True)
    metrics.observe_grammar("json_schema", 0.0, valid=True)
    metrics.observe_grammar("regex", 0.01, valid=False)
    assert value(metrics, "brigade:structured_output_requests_total", kind="json_schema") == 2
    assert value(metrics, "brigade:structured_output_requests_total", kind="regex") == 1
    assert value(metrics, "brigade:structured_output_requests_total", kind="ebnf") == 0
    assert value(metrics, "brigade:grammar_wait_seconds_count") == 3
    assert value(metrics, "brigade:grammar_wait_seconds_bucket", le="0.001") == 1
    assert value(metrics, "brigade:grammar_errors_total") == 1
    with pytest.raises(ValueError, match="unknown grammar kind 'yaml'"):
        metrics.observe_grammar("yaml", 0.0, valid=True)


def test_unknown_finish_reason_is_refused() -> None:
    metrics = ServerMetrics(MODEL)
    with pytest.raises(ValueError, match="unknown finish_reason 'eos'"):
        metrics.observe_finished(1, 1, 0.1, "eos")
    assert value(metrics, "brigade:prompt_tokens_total") == 0


def test_engine_gauges_follow_the_latest_snapshot() -> None:
    metrics = ServerMetrics(MODEL)
    metrics.observe_engine(4, 2, 0.25, 0, 0, 0)
    metrics.observe_engine(3, 7, 1.7, 0, 0, 0)
    assert value(metrics, "brigade:num_requests_running") == 3
    assert value(metrics, "brigade:num_requests_waiting") == 7
    assert value(metrics, "brigade:kv_cache_usage_perc") == 1.0  # clamped to 0..1


def test_engine_counters_advance_by_the_delta_of_cumulative_totals() -> None:
    metrics = ServerMetrics(MODEL)
    engine(metrics, queries=100, hits=40, preemptions=1)
    engine(metrics, queries=160, hits=40, preemptions=3)
    engine(metrics, queries=160, hits=40, preemptions=3)  # no change, no double count
    assert value(metrics, "brigade:prefix_cache_queries_total") == 160
    assert value(metrics, "brigade:prefix_cache_hits_total") == 40
    assert value(metrics, "brigade:num_preemptions_total") == 3


def test_lower_totals_are_a_reset_that_adds_nothing_and_rebases() -> None:
    metrics = ServerMetrics(MODEL)
    engine(metrics, queries=500, hits=200, preemptions=5)
    engine(metrics, queries=30, hits=10, preemptions=0)  # a new engine: totals restarted
    assert value(metrics, "brigade:prefix_cache_queries_total") == 500
    assert value(metrics, "brigade:prefix_cache_hits_total") == 200
    assert value(metrics, "brigade:num_preemptions_total") == 5
    engine(metrics, queries=50, hits=25, preemptions=2)  # counted from the new baseline
    assert value(metrics, "brigade:prefix_cache_queries_total") == 520
    assert value(metrics, "brigade:prefix_cache_hits_total") == 215
    assert value(metrics, "brigade:num_preemptions_total") == 7


# -- speculative decoding ---------------------------------------------------------------------

SPEC = "spec_decode_num_"


def speculating(metrics: ServerMetrics, speculative: SpeculativeStats) -> None:
    metrics.observe_engine(1, 0, 0.5, 0, 0, 0, speculative=speculative)


def test_speculation_off_has_no_spec_decode_series() -> None:
    metrics = ServerMetrics(MODEL, names="both")
    speculating(metrics, SpeculativeStats(4, 2, 2, (2,), (4,)))
    assert "spec_decode" not in metrics.render()[0].decode()


def test_speculation_counters_use_vllm_names_and_start_at_zero() -> None:
    metrics = ServerMetrics(MODEL, names="vllm", speculative_positions=3)
    text = metrics.render()[0].decode()
    labels = f'engine="0",model_name="{MODEL}"'
    for name in ("drafts", "draft_tokens", "accepted_tokens"):
        assert f"vllm:{SPEC}{name}_total{{{labels}}} 0.0" in text
    for position in range(3):
        assert (
            f'vllm:{SPEC}accepted_tokens_per_pos_total{{{labels},position="{position}"}} 0.0'
        ) in text
    assert 'position="3"' not in text
    assert "brigade:" not in text


def test_speculation_counters_follow_the_engine_totals_by_position() -> None:
    metrics = ServerMetrics(MODEL, names="both", speculative_positions=2)
    latest = SpeculativeStats(10, 5, 6, accepted_by_position=(4, 1), drafts_by_position=(6, 4))
    speculating(metrics, SpeculativeStats(6, 3, 4, (3, 0), (4, 2)))
    speculating(metrics, latest)
    metrics.observe_engine(1, 0, 0.5, 0, 0, 0)  # no speculative figures: counters stay
    speculating(metrics, latest)  # and are not counted twice after
    for prefix, engine_label in (("brigade:", {}), ("vllm:", {"engine": "0"})):
        spec = f"{prefix}{SPEC}"
        assert value(metrics, f"{spec}drafts_total", **engine_label) == 6
        assert value(metrics, f"{spec}draft_tokens_total", **engine_label) == 10
        assert value(metrics, f"{spec}accepted_tokens_total", **engine_label) == 5
        accepted = [
            value(metrics, f"{spec}accepted_tokens_per_pos_total", position=p, **engine_label)
            for p in ("0", "1")
        ]
        drafted = [
            value(metrics, f"{spec}draft_tokens_per_pos_total", position=p, **engine_label)
            for p in ("0", "1")
        ]
        assert (accepted, drafted) == ([4, 1], [6, 4])


# -- several front-end processes sharing one directory (prometheus_client multiprocess mode) --

FRONT_END = """
import json, os, sys
from brigade.server.metrics import ServerMetrics
from brigade.speculative import SpeculativeStats
metrics = ServerMetrics(
    "tiny-llama", names="both", speculative_positions=2, multiprocess_dir=sys.argv[1]
)
metrics.set_components({"scheduler": "fcfs"})
for method, args, *speculative in json.loads(sys.argv[2]):
    kwargs = {}
    if speculative:
        *totals, accepted, drafted = speculative[0]
        kwargs["speculative"] = SpeculativeStats(*totals, tuple(accepted), tuple(drafted))
    getattr(metrics, method)(*args, **kwargs)
print(json.dumps({"pid": os.getpid(), "text": metrics.render()[0].decode()}))
"""


def front_end(directory: Path, *calls: tuple[object, ...]) -> tuple[int, str]:
    """Run ``calls`` on the ``ServerMetrics`` of a new process sharing ``directory``, as a front
    end of a server with several does; its pid and its ``render()``. A call is (method, args)
    or, for ``observe_engine``, (method, args, ``SpeculativeStats`` fields as a list)."""
    result = subprocess.run(
        [sys.executable, "-c", FRONT_END, str(directory), json.dumps(calls)],
        env={**os.environ, MULTIPROCESS_ENV: str(directory)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    answer = json.loads(result.stdout)
    return answer["pid"], answer["text"]


def parsed(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def only(found: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    rows = [value for got, value in found[name] if got == {**LABEL, **labels}]
    assert len(rows) == 1, (name, found[name])
    return rows[0]


@pytest.fixture(scope="module")
def two_front_ends(tmp_path_factory: pytest.TempPathFactory) -> str:
    """What the second of two front ends serves: each finished one request and saw the engine."""
    directory = tmp_path_factory.mktemp("shared")
    front_end(
        directory,
        ("observe_first_token", [0.05, 0.01]),
        ("observe_finished", [3, 4, 1.0, "stop"]),
        ("observe_engine", [3, 1, 0.5, 100, 40, 1], [8, 4, 5, [3, 1], [5, 3]]),
    )
    _, text = front_end(
        directory,
        ("observe_first_token", [0.2, 0.02]),
        ("observe_finished", [5, 2, 2.0, "length"]),
        ("observe_engine", [2, 0, 0.25, 120, 50, 2], [12, 6, 7, [5, 1], [7, 5]]),
    )
    return text


def test_front_ends_sharing_a_directory_serve_the_servers_totals(two_front_ends: str) -> None:
    found = parsed(two_front_ends)
    for prefix, engine_label in (("brigade:", {}), ("vllm:", {"engine": "0"})):
        assert (
            only(found, f"{prefix}request_success_total", finished_reason="stop", **engine_label)
            == 1
        )
        assert (
            only(found, f"{prefix}request_success_total", finished_reason="length", **engine_label)
            == 1
        )
        assert only(found, f"{prefix}time_to_first_token_seconds_count", **engine_label) == 2
        assert (
            only(found, f"{prefix}time_to_first_token_seconds_bucket", le="0.1", **engine_label)
            == 1
        )
        assert only(found, f"{prefix}prompt_tokens_total", **engine_label) == 8
        assert only(found, f"{prefix}generation_tokens_total", **engine_label) == 6
        # The engine's state and totals reach every front end alike: never added up.
        assert only(found, f"{prefix}num_requests_running", **engine_label) == 2  # the latest
        assert only(found, f"{prefix}kv_cache_usage_perc", **engine_label) == 0.25
        assert only(found, f"{prefix}prefix_cache_queries_total", **engine_label) == 120
        assert only(found, f"{prefix}prefix_cache_hits_total", **engine_label) == 50
        assert only(found, f"{prefix}num_preemptions_total", **engine_label) == 2
        assert only(found, f"{prefix}spec_decode_num_drafts_total", **engine_label) == 7
        assert only(found, f"{prefix}spec_decode_num_draft_tokens_total", **engine_label) == 12
        assert only(found, f"{prefix}spec_decode_num_accepted_tokens_total", **engine_label) == 6
        for position, accepted, drafted in (("0", 5, 7), ("1", 1, 5)):
            per_position = {"position": position, **engine_label}
            spec = f"{prefix}spec_decode_num_"
            assert only(found, f"{spec}accepted_tokens_per_pos_total", **per_position) == accepted
            assert only(found, f"{spec}draft_tokens_per_pos_total", **per_position) == drafted
        assert only(found, f"{prefix}engine_info", scheduler="fcfs", **engine_label) == 1


def test_shared_series_keep_the_names_labels_and_help_of_one_process(two_front_ends: str) -> None:
    alone = ServerMetrics(MODEL, names="both", speculative_positions=2)
    alone.set_components({"scheduler": "fcfs"})

    def shape(text: str) -> tuple[set[tuple[str, str, str]], set[tuple[str, tuple[str, ...]]]]:
        families = [
            family
            for family in text_string_to_metric_families(text)
            if not family.name.endswith("_created")  # a single process's creation times
        ]
        described = {(f.name, f.type, f.documentation) for f in families}
        samples = {(s.name, tuple(sorted(s.labels))) for f in families for s in f.samples}
        return described, samples

    assert shape(two_front_ends) == shape(alone.render()[0].decode())


def test_a_front_end_that_exited_takes_its_gauges_but_not_its_counts(tmp_path: Path) -> None:
    front_end(tmp_path, ("observe_engine", [3, 1, 0.5, 0, 0, 0]))
    exited, _ = front_end(
        tmp_path,
        ("observe_finished", [5, 2, 2.0, "length"]),
        ("observe_engine", [2, 0, 0.25, 0, 0, 0]),
    )
    forget_process(str(tmp_path), exited)
    found = parsed(front_end(tmp_path)[1])
    assert only(found, "brigade:num_requests_running") == 3  # the live front end's
    assert only(found, "brigade:request_success_total", finished_reason="length") == 1


def test_the_engines_newest_snapshot_wins_whichever_front_end_wrote_last(
    tmp_path: Path,
) -> None:
    """Front ends receive the engine's snapshots a moment apart: one a step behind, writing
    after another that is up to date, must not bring back the engine's older state."""
    front_end(tmp_path, ("observe_engine_gauges", [1, 0, 0.5, 2000.0]))
    _, text = front_end(tmp_path, ("observe_engine_gauges", [0, 3, 0.125, 1000.0]))
    found = parsed(text)
    for prefix in ("brigade:", "vllm:"):
        labels = {} if prefix == "brigade:" else {"engine": "0"}
        assert only(found, f"{prefix}num_requests_running", **labels) == 1
        assert only(found, f"{prefix}num_requests_waiting", **labels) == 0
        assert only(found, f"{prefix}kv_cache_usage_perc", **labels) == 0.5
    # Once the behind one catches up, its newer snapshot is the server's state.
    _, text = front_end(tmp_path, ("observe_engine_gauges", [0, 3, 0.125, 3000.0]))
    assert only(parsed(text), "brigade:num_requests_running") == 0


def test_a_shared_directory_needs_the_environment_set_before_import(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=f"start this process with {MULTIPROCESS_ENV}="):
        ServerMetrics(MODEL, multiprocess_dir=str(tmp_path))
