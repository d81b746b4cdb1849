"""A/B differences over seeds: each config's metric minus the baseline's, paired by seed, and
how many seeds a difference of the observed size needs before its 95% interval excludes zero.

Every target runs the same workload for a given seed, so the per-seed differences
``d_s = other_s - baseline_s`` cancel the workload-to-workload variation that the two columns
share. Their mean ``d`` has the 95% Student-t interval ``d ± t(0.975, n-1) * sd / sqrt(n)``
over ``n`` seeds (``sd`` the standard deviation of the ``d_s``), which excludes zero once
``t(0.975, n-1) * sd / sqrt(n) < |d|``. :func:`seeds_needed` is the smallest such ``n`` were the
mean and spread to stay as observed: about ``(1.96 * sd / d)²`` when that is large.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence

from brigade.bench.report import confidence_interval, t_quantile_975

__all__ = [
    "Difference",
    "compare_runs",
    "differences_json",
    "render_differences_markdown",
    "seeds_needed",
]

_Z_975 = 1.959964
"""The normal 0.975 quantile, which ``t_quantile_975`` returns past 30 degrees of freedom."""
_LARGEST_T_DF = 30


@dataclasses.dataclass(frozen=True, slots=True)
class Difference:
    """One metric of one config minus the baseline's, over the seeds both have it for."""

    mean: float
    ci_low: float
    ci_high: float
    samples: tuple[float, ...]
    """Per-seed differences, in seed order."""
    seeds_needed: int | None
    """Seeds a difference of this mean and spread needs before its 95% interval excludes
    zero; None when it cannot be told (one seed) or there is no difference (mean 0)."""

    @property
    def excludes_zero(self) -> bool:
        """The 95% interval lies on one side of zero: the difference is established."""
        return self.ci_low > 0 or self.ci_high < 0


def seeds_needed(mean: float, stdev: float) -> int | None:
    """The fewest seeds ``n >= 2`` with ``t(0.975, n-1) * stdev / sqrt(n) < |mean|``: where the
    95% interval of a mean difference ``mean`` with per-seed spread ``stdev`` excludes zero.
    None when ``mean`` is 0 (no seed count makes it so)."""
    if mean == 0:
        return None
    size = abs(mean)
    for n in range(2, _LARGEST_T_DF + 2):
        if t_quantile_975(n - 1) * stdev / math.sqrt(n) < size:
            return n
    # Past the t table the quantile is the normal one: n > (z * sd / |mean|)².
    return max(_LARGEST_T_DF + 2, math.floor((_Z_975 * stdev / size) ** 2) + 1)


def compare_runs(
    baseline: Sequence[Mapping[str, float]], other: Sequence[Mapping[str, float]]
) -> dict[str, Difference]:
    """Per metric, ``other`` minus ``baseline`` paired by seed (both lists hold one run's
    metrics per seed, in seed order); metrics only one side has are left out."""
    differences = {}
    for metric in dict.fromkeys(name for run in other for name in run):
        samples = tuple(
            mine[metric] - theirs[metric]
            for theirs, mine in zip(baseline, other, strict=False)
            if metric in mine and metric in theirs
        )
        if not samples:
            continue
        mean, low, high = confidence_interval(samples)
        needed = seeds_needed(mean, statistics.stdev(samples)) if len(samples) > 1 else None
        differences[metric] = Difference(mean, low, high, samples, needed)
    return differences


def render_differences_markdown(
    baseline: str, differences: Mapping[str, Mapping[str, Difference]], num_seeds: int
) -> str:
    """A Markdown table: a row per metric, per other config its difference from ``baseline``
    (mean ± 95% half-width) and the seeds a difference of that size needs."""
    names = list(differences)
    metrics = list(dict.fromkeys(m for metric_diffs in differences.values() for m in metric_diffs))
    lines = [
        f"Against {baseline}, paired by seed: the difference (mean ± 95% CI half-width) and the "
        "seeds a difference of that size and spread needs before its 95% interval excludes "
        f"zero; {num_seeds} or fewer (the seeds run): it already does; -: no difference.",
        "",
        "| metric | " + " | ".join(f"{name} - {baseline} | seeds" for name in names) + " |",
        "|---|" + "---:|---:|" * len(names),
    ]
    for metric in metrics:
        cells = []
        for name in names:
            difference = differences[name].get(metric)
            cells += _cells(difference)
        lines.append(f"| {metric} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cells(difference: Difference | None) -> list[str]:
    if difference is None:
        return ["-", "-"]
    half = (difference.ci_high - difference.ci_low) / 2
    value = f"{difference.mean:+.4g} ± {half:.2g}" if half else f"{difference.mean:+.4g}"
    needed = difference.seeds_needed
    return [value, "-" if needed is None else str(needed)]


def differences_json(differences: Mapping[str, Difference]) -> dict[str, dict[str, object]]:
    """``{metric: {"mean", "ci95": [low, high], "samples", "seeds_needed"}}``."""
    return {
        metric: {
            "mean": d.mean,
            "ci95": [d.ci_low, d.ci_high],
            "samples": list(d.samples),
            "seeds_needed": d.seeds_needed,
        }
        for metric, d in differences.items()
    }
