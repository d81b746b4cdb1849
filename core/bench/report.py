"""Benchmark statistics: per-run latency percentiles, throughput and goodput under SLOs,
deadline misses, a breakdown by one ``extra`` field, and their mean with a 95% confidence
interval over seeds, rendered as Markdown or JSON."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Mapping, Sequence

from brigade.bench.workloads import DEADLINE_FIELD, extra_json
from brigade.errors import BrigadeError
from brigade.interfaces import EMPTY_EXTRA, ExtraValue

__all__ = [
    "BenchError",
    "RequestTiming",
    "RunMetrics",
    "Summary",
    "TokenTimes",
    "confidence_interval",
    "group_label",
    "parse_slo",
    "percentile",
    "render_markdown",
    "render_sweep_markdown",
    "summarize",
    "summarize_run",
    "summaries_json",
    "sweep_json",
    "t_quantile_975",
]

_SLO_METRICS = ("ttft", "tpot", "e2e")
_UNITS = {"ms": 1e-3, "s": 1.0}
# Two-sided 95% Student t quantiles (0.975) for df 1..30; beyond, the normal 1.96 is within 1%.
_T_975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


class BenchError(BrigadeError, ValueError):
    """A ``brigade bench`` argument (SLO, workload spec, config) is not valid."""


class TokenTimes:
    """When each request's tokens came: its first token and the gaps between the next ones."""

    def __init__(self) -> None:
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._gaps: dict[int, list[float]] = {}

    def token(self, index: int, now: float) -> None:
        """Request ``index`` got a token at ``now``."""
        if index in self._last:
            self._gaps[index].append(now - self._last[index])
        else:
            self._first[index], self._gaps[index] = now, []
        self._last[index] = now

    def finish(self, index: int) -> tuple[float, tuple[float, ...]]:
        """Request ``index`` is done: its first token's time and its gaps (then forgotten)."""
        del self._last[index]
        return self._first.pop(index), tuple(self._gaps.pop(index))


@dataclasses.dataclass(frozen=True, slots=True)
class RequestTiming:
    """One finished request's latencies in seconds."""

    ttft_s: float
    e2e_s: float
    output_tokens: int
    itl_s: tuple[float, ...] = ()
    """Gaps between consecutive token arrivals (engine steps, or stream chunks over HTTP)."""
    priority: int = 0
    extra: Mapping[str, ExtraValue] = dataclasses.field(default_factory=lambda: EMPTY_EXTRA)
    """The workload request's ``extra`` data (``--by`` groups by it; ``deadline_s``)."""

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (0 for a one-token output)."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclasses.dataclass(frozen=True, slots=True)
class RunMetrics:
    """The inputs of one run (one config, one seed) besides its request timings."""

    duration_s: float
    num_preemptions: int | None
    """None where it cannot be observed (an HTTP endpoint): the metric is left out."""
    prefix_hit_rate: float | None
    num_failed: int = 0
    """Requests that ended in an error (HTTP runs); they have no timings."""
    failed_extra: tuple[Mapping[str, ExtraValue], ...] = ()
    """The ``extra`` data of the failed requests, where known: per-group goodput and deadline
    misses count them too."""
    draft_acceptance_rate: float | None = None
    """Speculative decoding over the run: draft tokens accepted / verified. None where the
    engine does not speculate, or it cannot be observed (an HTTP endpoint): left out."""
    mean_accepted_length: float | None = None
    """Speculative decoding over the run: tokens emitted per request-step that verified drafts
    (accepted drafts plus the sampled token). None as for ``draft_acceptance_rate``."""


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation; 0 for no values."""
    return _sorted_percentile(sorted(values), q)


def _sorted_percentile(ordered: Sequence[float], q: float) -> float:
    if not ordered:
        return 0.0
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def parse_slo(spec: str) -> dict[str, float]:
    """``ttft=500ms,tpot=50ms`` -> ``{"ttft": 0.5, "tpot": 0.05}`` (seconds)."""
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in _SLO_METRICS:
            raise BenchError(
                f"SLO term {part!r} is not allowed; use METRIC=VALUE with METRIC one of "
                f"{', '.join(_SLO_METRICS)} (e.g. ttft=500ms,tpot=50ms)"
            )
        unit = next((u for u in ("ms", "s") if value.strip().endswith(u)), None)
        number = value.strip()[: -len(unit)] if unit else ""
        try:
            seconds = float(number) * _UNITS[unit] if unit else math.nan
        except ValueError:
            seconds = math.nan
        if not seconds > 0 or math.isinf(seconds):
            raise BenchError(
                f"SLO {name}={value.strip()!r} is not allowed; give a positive number with a "
                "unit, ms or s (e.g. 500ms)"
            )
        slo[name] = seconds
    if not slo:
        raise BenchError("the SLO is empty; give e.g. ttft=500ms,tpot=50ms")
    return slo


def _meets(timing: RequestTiming, slo: Mapping[str, float]) -> bool:
    values = {"ttft": timing.ttft_s, "tpot": timing.tpot_s, "e2e": timing.e2e_s}
    return all(values[name] <= limit for name, limit in slo.items())


def summarize_run(
    timings: Sequence[RequestTiming],
    run: RunMetrics,
    slo: Mapping[str, float] | None = None,
    *,
    by: str | None = None,
) -> dict[str, float]:
    """One run's metrics: latency percentiles (ms), throughputs (/s), goodput and counters.

    ITL pools every gap of every request (as vLLM's benchmark does), so its p99 shows stalls
    (preemptions, long prefill chunks) that the per-request mean TPOT averages away. When
    requests carry ``extra.deadline_s``, ``deadline_misses`` counts those whose end-to-end
    latency exceeds it (failed ones included). ``by`` names an ``extra`` field: latency,
    goodput and deadline misses are then also given per value of it, as
    ``metric[by=value]``.
    """
    metrics: dict[str, float] = {}
    for name, values in (
        ("ttft", [t.ttft_s for t in timings]),
        ("tpot", [t.tpot_s for t in timings if t.output_tokens > 1]),
        ("itl", [gap for t in timings for gap in t.itl_s]),
        ("e2e", [t.e2e_s for t in timings]),
    ):
        values.sort()
        for q in (50, 90, 99):
            metrics[f"{name}_p{q}_ms"] = _sorted_percentile(values, q) * 1e3
    levels = sorted({t.priority for t in timings})
    if len(levels) > 1:  # what a priority policy trades: each level's TTFT
        for level in levels:
            values = sorted(t.ttft_s for t in timings if t.priority == level)
            for q in (50, 99):
                metrics[f"ttft_p{q}_ms[priority={level}]"] = _sorted_percentile(values, q) * 1e3
    output_tokens = sum(t.output_tokens for t in timings)
    duration = run.duration_s
    metrics["request_throughput"] = len(timings) / duration if duration > 0 else 0.0
    metrics["output_throughput"] = output_tokens / duration if duration > 0 else 0.0
    metrics["output_tokens"] = float(output_tokens)
    if slo:
        met = sum(_meets(t, slo) for t in timings)
        attempted = len(timings) + run.num_failed
        metrics["goodput_fraction"] = met / attempted if attempted else 0.0
        metrics["goodput"] = met / duration if duration > 0 else 0.0
    metrics.update(_deadline_metrics(timings, run.failed_extra))
    metrics["failed_requests"] = float(run.num_failed)
    if run.num_preemptions is not None:
        metrics["preemptions"] = float(run.num_preemptions)
    if run.prefix_hit_rate is not None:
        metrics["prefix_hit_rate"] = run.prefix_hit_rate
    if run.draft_acceptance_rate is not None:
        metrics["draft_acceptance_rate"] = run.draft_acceptance_rate
    if run.mean_accepted_length is not None:
        metrics["mean_accepted_length"] = run.mean_accepted_length
    if by is not None:
        metrics.update(_group_metrics(timings, run, slo, by))
    return metrics


def group_label(extra: Mapping[str, ExtraValue], field: str) -> str:
    """How a request's ``extra[field]`` names its group: a string as it is, other values as
    JSON, ``(none)`` when the request has no such field."""
    if field not in extra:
        return "(none)"
    value = extra[field]
    return value if isinstance(value, str) else json.dumps(extra_json({field: value})[field])


def _deadline_metrics(
    timings: Sequence[RequestTiming], failed_extra: Sequence[Mapping[str, ExtraValue]]
) -> dict[str, float]:
    """``deadline_misses`` and ``deadline_miss_fraction`` over the requests with a deadline
    (none when no request has one). A failed request with a deadline missed it."""
    with_deadline = [t for t in timings if DEADLINE_FIELD in t.extra]
    failed = sum(DEADLINE_FIELD in extra for extra in failed_extra)
    total = len(with_deadline) + failed
    if not total:
        return {}
    misses = failed + sum(t.e2e_s > _deadline(t.extra) for t in with_deadline)
    return {"deadline_misses": float(misses), "deadline_miss_fraction": misses / total}


def _deadline(extra: Mapping[str, ExtraValue]) -> float:
    value = extra[DEADLINE_FIELD]
    return float(value) if isinstance(value, int | float) else math.inf


def _group_metrics(
    timings: Sequence[RequestTiming],
    run: RunMetrics,
    slo: Mapping[str, float] | None,
    by: str,
) -> dict[str, float]:
    """Latency, goodput and deadline metrics per value of ``extra[by]``, metric by metric."""
    groups: dict[str, list[RequestTiming]] = {}
    failed: dict[str, list[Mapping[str, ExtraValue]]] = {}
    for timing in timings:
        groups.setdefault(group_label(timing.extra, by), []).append(timing)
    for extra in run.failed_extra:
        failed.setdefault(group_label(extra, by), []).append(extra)
    per_group: dict[str, dict[str, float]] = {}
    for label in sorted(groups.keys() | failed.keys()):
        members, lost = groups.get(label, []), failed.get(label, [])
        values: dict[str, float] = {"requests": float(len(members) + len(lost))}
        for name, samples in (
            ("ttft", sorted(t.ttft_s for t in members)),
            ("tpot", sorted(t.tpot_s for t in members if t.output_tokens > 1)),
            ("e2e", sorted(t.e2e_s for t in members)),
        ):
            for q in (50, 99):
                values[f"{name}_p{q}_ms"] = _sorted_percentile(samples, q) * 1e3
        if slo:
            met = sum(_meets(t, slo) for t in members)
            attempted = len(members) + len(lost)
            values["goodput_fraction"] = met / attempted if attempted else 0.0
            values["goodput"] = met / run.duration_s if run.duration_s > 0 else 0.0
        values.update(_deadline_metrics(members, lost))
        per_group[label] = values
    names = dict.fromkeys(name for values in per_group.values() for name in values)
    return {
        f"{name}[{by}={label}]": values[name]
        for name in names
        for label, values in per_group.items()
        if name in values
    }


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (normal past 30)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return _T_975[df - 1] if df <= len(_T_975) else 1.959964


def confidence_interval(samples: Sequence[float]) -> tuple[float, float, float]:
    """Mean and the two ends of its 95% t interval; one sample gives a zero-width interval."""
    if not samples:
        raise ValueError("no samples")
    mean = statistics.fmean(samples)
    if len(samples) == 1:
        return mean, mean, mean
    half = t_quantile_975(len(samples) - 1) * statistics.stdev(samples) / math.sqrt(len(samples))
    return mean, mean - half, mean + half


@dataclasses.dataclass(frozen=True, slots=True)
class Summary:
    """One metric of one config over seeds."""

    mean: float
    ci_low: float
    ci_high: float
    samples: tuple[float, ...]


def summarize(runs: Sequence[Mapping[str, float]]) -> dict[str, Summary]:
    """Per metric, the mean and 95% CI over ``runs`` (one dict per seed)."""
    result = {}
    # A metric missing from some runs (a priority level one seed did not draw) is summarized
    # over the runs that have it.
    for name in dict.fromkeys(name for run in runs for name in run):
        samples = tuple(run[name] for run in runs if name in run)
        mean, low, high = confidence_interval(samples)
        result[name] = Summary(mean, low, high, samples)
    return result


def render_markdown(results: Mapping[str, Mapping[str, Summary]]) -> str:
    """A Markdown table: one row per metric, one column per config, ``mean ± half-width``."""
    names = list(results)
    metrics = list(dict.fromkeys(m for summaries in results.values() for m in summaries))
    lines = [
        "| metric | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for metric in metrics:
        cells = [_cell(results[name].get(metric)) for name in names]
        lines.append(f"| {metric} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


SWEEP_COLUMNS = (
    "request_throughput",
    "output_throughput",
    "goodput",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "e2e_p50_ms",
    "e2e_p99_ms",
    "deadline_miss_fraction",
    "failed_requests",
    "preemptions",
    "draft_acceptance_rate",
    "mean_accepted_length",
)
"""The metrics of a sweep table, where present; every metric is in the JSON."""
_SWEEP_GROUP_COLUMNS = ("ttft_p50_ms[priority=", "goodput_fraction[", "deadline_miss_fraction[")
"""Per-group metrics a sweep table shows too (priority levels, ``--by`` groups)."""


def _cell(summary: Summary | None) -> str:
    if summary is None:
        return "-"
    half = (summary.ci_high - summary.ci_low) / 2
    return f"{summary.mean:.4g} ± {half:.2g}" if half else f"{summary.mean:.4g}"


def render_sweep_markdown(
    key: str, values: Sequence[str], points: Mapping[str, Sequence[Mapping[str, Summary]]]
) -> str:
    """One table per config: a row per swept value, a column per throughput/latency metric."""
    blocks = []
    for name, summaries in points.items():
        present = {metric for point in summaries for metric in point}
        columns = [metric for metric in SWEEP_COLUMNS if metric in present]
        for prefix in _SWEEP_GROUP_COLUMNS:
            columns += sorted(m for m in present if m.startswith(prefix))
        lines = [
            f"### {name}",
            "",
            f"| {key} | " + " | ".join(columns) + " |",
            "|---:|" + "---:|" * len(columns),
        ]
        for value, point in zip(values, summaries, strict=True):
            lines.append(f"| {value} | " + " | ".join(_cell(point.get(m)) for m in columns) + " |")
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks)


def summaries_json(summaries: Mapping[str, Summary]) -> dict[str, dict[str, object]]:
    """``{metric: {"mean", "ci95": [low, high], "samples": [per seed]}}``."""
    return {
        metric: {"mean": s.mean, "ci95": [s.ci_low, s.ci_high], "samples": list(s.samples)}
        for metric, s in summaries.items()
    }


def sweep_json(
    key: str, values: Sequence[str], summaries: Sequence[Mapping[str, Summary]]
) -> dict[str, object]:
    """A config's sweep as arrays, one entry per swept value: ``curves[metric]`` the means,
    ``ci95[metric]`` the [low, high] pairs, ``points`` every metric in full (null where a
    point lacks a metric)."""
    metrics = list(dict.fromkeys(m for point in summaries for m in point))
    return {
        "key": key,
        "values": list(values),
        "curves": {m: [p[m].mean if m in p else None for p in summaries] for m in metrics},
        "ci95": {
            m: [[p[m].ci_low, p[m].ci_high] if m in p else None for p in summaries] for m in metrics
        },
        "points": [summaries_json(point) for point in summaries],
    }
