"""``brigade bench --plot DIR``: latency CDFs and, with ``--sweep``, throughput-latency curves.

matplotlib is optional (the ``bench`` extra); it is imported only here, with the Agg backend,
so a headless machine needs no display.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from brigade.bench.report import BenchError

__all__ = ["LATENCIES", "require_matplotlib", "write_latency_cdfs", "write_sweep_curves"]

LATENCIES = ("ttft", "tpot", "itl", "e2e")
_MAX_POINTS = 2000
_TITLES = {
    "ttft": "time to first token",
    "tpot": "time per output token",
    "itl": "inter-token latency",
    "e2e": "end-to-end latency",
}


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or a BenchError naming the extra."""
    try:
        import matplotlib
    except ImportError as exc:
        raise BenchError(
            "--plot needs matplotlib; install it with pip install 'brigade-llm[bench]'"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_latency_cdfs(
    directory: Path, series: Mapping[str, Mapping[str, Sequence[float]]]
) -> Path:
    """One panel per latency (ms), one CDF line per series (a config, or a config at a sweep
    point); every seed's requests are pooled. Returns the file written."""
    plt = require_matplotlib()
    figure, axes = plt.subplots(2, 2, figsize=(11, 8), constrained_layout=True)
    for axis, metric in zip(axes.flat, LATENCIES, strict=True):
        for label, samples in series.items():
            values = sorted(samples.get(metric, ()))
            if not values:
                continue
            if len(values) > _MAX_POINTS:  # a million ITL gaps: plot quantiles, not every one
                step = (len(values) - 1) / (_MAX_POINTS - 1)
                values = [values[round(i * step)] for i in range(_MAX_POINTS)]
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            axis.step(values, fractions, where="post", label=label)
        low, high = axis.dataLim.intervalx
        if low > 0 and high / low > 100:  # heavy tails (queueing): spread the decades out
            axis.set_xscale("log")
        axis.set_title(_TITLES[metric])
        axis.set_xlabel(f"{metric} (ms)")
        axis.set_ylabel("fraction of requests" if metric != "itl" else "fraction of gaps")
        axis.set_ylim(0, 1.02)
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize="small")
    path = directory / "latency_cdf.png"
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def write_sweep_curves(
    directory: Path,
    key: str,
    values: Sequence[str],
    curves: Mapping[str, Mapping[str, Sequence[float]]],
) -> list[Path]:
    """Throughput against the swept ``key``, and latency against throughput (one line per
    config, each point labelled with its swept value). ``curves[config][metric]`` holds one
    mean per sweep value."""
    plt = require_matplotlib()
    numeric = _as_numbers(values)
    positions: Sequence[float] = numeric if numeric is not None else range(len(values))
    figure, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for name, metrics in curves.items():
        axes[0].plot(positions, metrics["output_throughput"], marker="o", label=name)
        axes[1].plot(positions, metrics["request_throughput"], marker="o", label=name)
    for axis, label in zip(axes, ("output tokens/s", "requests/s"), strict=True):
        axis.set_xlabel(key if key != "rate" else "offered request rate (/s)")
        axis.set_ylabel(label)
        if numeric is None:
            axis.set_xticks(list(positions), list(values))
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    throughput_path = directory / "sweep_throughput.png"
    figure.savefig(throughput_path, dpi=120)
    plt.close(figure)

    panels = [("ttft_p50_ms", "p50 TTFT (ms)"), ("tpot_p50_ms", "p50 TPOT (ms)")]
    panels += [("itl_p99_ms", "p99 ITL (ms)"), ("e2e_p99_ms", "p99 e2e (ms)")]
    figure, axes = plt.subplots(2, 2, figsize=(11, 8), constrained_layout=True)
    for axis, (metric, label) in zip(axes.flat, panels, strict=True):
        for name, metrics in curves.items():
            xs, ys = metrics["output_throughput"], metrics[metric]
            axis.plot(xs, ys, marker="o", label=name)
            for x, y, value in zip(xs, ys, values, strict=True):
                axis.annotate(value, (x, y), fontsize="x-small", alpha=0.7)
        axis.set_xlabel("output tokens/s")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    latency_path = directory / "sweep_latency.png"
    figure.suptitle(f"latency vs throughput, sweeping {key}")
    figure.savefig(latency_path, dpi=120)
    plt.close(figure)
    return [throughput_path, latency_path]


def _as_numbers(values: Sequence[str]) -> list[float] | None:
    try:
        return [float(value) for value in values]
    except ValueError:
        return None
