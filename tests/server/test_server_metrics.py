"""Prometheus metrics: names, labels, histograms and counters fed from engine totals."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from brigade.server.metrics import FINISH_REASONS, ServerMetrics

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
