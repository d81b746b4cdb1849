"""Benchmark statistics: per-run latency percentiles, throughput and goodput under SLOs, and
their mean with a 95% confidence interval over seeds, rendered as Markdown or JSON."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence

from brigade.errors import BrigadeError

__all__ = [
    "BenchError",
    "RequestTiming",
    "RunMetrics",
    "Summary",
    "confidence_interval",
    "parse_slo",
    "percentile",
    "render_markdown",
    "summarize",
    "summarize_run",
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


@dataclasses.dataclass(frozen=True, slots=True)
class RequestTiming:
    """One finished request's latencies in seconds."""

    ttft_s: float
    e2e_s: float
    output_tokens: int

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
    num_preemptions: int
    prefix_hit_rate: float


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
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
    timings: Sequence[RequestTiming], run: RunMetrics, slo: Mapping[str, float] | None = None
) -> dict[str, float]:
    """One run's metrics: latency percentiles (ms), throughputs (/s), goodput and counters."""
    metrics: dict[str, float] = {}
    for name, values in (
        ("ttft", [t.ttft_s for t in timings]),
        ("tpot", [t.tpot_s for t in timings if t.output_tokens > 1]),
        ("e2e", [t.e2e_s for t in timings]),
    ):
        for q in (50, 90, 99):
            metrics[f"{name}_p{q}_ms"] = percentile(values, q) * 1e3
    output_tokens = sum(t.output_tokens for t in timings)
    duration = run.duration_s
    metrics["request_throughput"] = len(timings) / duration if duration > 0 else 0.0
    metrics["output_throughput"] = output_tokens / duration if duration > 0 else 0.0
    if slo:
        met = sum(_meets(t, slo) for t in timings)
        metrics["goodput_fraction"] = met / len(timings) if timings else 0.0
    metrics["preemptions"] = float(run.num_preemptions)
    metrics["prefix_hit_rate"] = run.prefix_hit_rate
    return metrics


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
    if not runs:
        return {}
    result = {}
    for name in runs[0]:
        samples = tuple(run[name] for run in runs)
        mean, low, high = confidence_interval(samples)
        result[name] = Summary(mean, low, high, samples)
    return result


def render_markdown(results: Mapping[str, Mapping[str, Summary]]) -> str:
    """A Markdown table: one row per metric, one column per config, ``mean ± half-width``."""
    names = list(results)
    metrics = list(next(iter(results.values()), {}))
    lines = [
        "| metric | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for metric in metrics:
        cells = []
        for name in names:
            summary = results[name].get(metric)
            if summary is None:
                cells.append("-")
                continue
            half = (summary.ci_high - summary.ci_low) / 2
            cells.append(f"{summary.mean:.4g} ± {half:.2g}" if half else f"{summary.mean:.4g}")
        lines.append(f"| {metric} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
