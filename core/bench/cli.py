"""``brigade bench``: run a workload against configs in-process, or against OpenAI-compatible
endpoints over HTTP, over several seeds and optionally a sweep.

A config whose executor is ``simulated`` runs on the executor's virtual clock
(:func:`~brigade.bench.simulate.run_simulation`); any other runs on the wall clock, with
requests joining the engine at their arrival times. An endpoint gets the same seeded
workload over streaming ``/v1/completions`` (:mod:`brigade.bench.endpoint`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from brigade.bench.compare import (
    Difference,
    compare_runs,
    differences_json,
    render_differences_markdown,
)
from brigade.bench.endpoint import Endpoint
from brigade.bench.report import (
    BenchError,
    RequestTiming,
    Summary,
    parse_slo,
    render_markdown,
    render_sweep_markdown,
    summaries_json,
    summarize,
    summarize_run,
    sweep_json,
)
from brigade.bench.runners import run_on_endpoint, run_real, run_simulated, warm_up
from brigade.bench.spec import (
    SYNTHETIC_GRAMMAR,
    SweepSpec,
    WorkloadSpec,
    parse_sweep,
    parse_workload,
)
from brigade.errors import BrigadeError

if TYPE_CHECKING:
    from brigade.config import EngineConfig

__all__ = ["SYNTHETIC_GRAMMAR", "WorkloadSpec", "parse_workload", "run_bench"]


@dataclasses.dataclass(frozen=True, slots=True)
class _Target:
    """One column of the report: a config file run in-process, or an endpoint."""

    name: str
    config_path: str | None = None
    endpoint: Endpoint | None = None


@dataclasses.dataclass
class _Collected:
    """One target at one sweep point: per-seed metrics and, for plots, pooled latencies."""

    runs: list[dict[str, float]] = dataclasses.field(default_factory=list)
    latencies_ms: dict[str, list[float]] = dataclasses.field(
        default_factory=lambda: {"ttft": [], "tpot": [], "itl": [], "e2e": []}
    )

    def add(self, timings: Sequence[RequestTiming], keep_latencies: bool) -> None:
        if not keep_latencies:
            return
        for t in timings:
            self.latencies_ms["ttft"].append(t.ttft_s * 1e3)
            self.latencies_ms["e2e"].append(t.e2e_s * 1e3)
            if t.output_tokens > 1:
                self.latencies_ms["tpot"].append(t.tpot_s * 1e3)
            self.latencies_ms["itl"].extend(gap * 1e3 for gap in t.itl_s)


def _vocab_size(config: Any) -> int:
    """The model's vocabulary size, from its config (no weights are read)."""
    from brigade.assemble import open_model

    try:
        checkpoint = open_model(config)
    except BrigadeError as exc:
        raise BenchError(f"{config.source}: {exc}") from exc
    vocab = checkpoint.config.get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise BenchError(f"{checkpoint.path}: 'vocab_size' must be a positive integer")
    return vocab


def run_bench(
    config_paths: Sequence[str],
    workload_spec: str,
    *,
    seeds: int = 1,
    slo: str | None = None,
    json_path: str | None = None,
    overrides: Sequence[str] = (),
    endpoints: Sequence[str] = (),
    model: str | None = None,
    prompt_format: Literal["token_ids", "text"] = "token_ids",
    vocab_size: int | None = None,
    max_concurrency: int = 64,
    request_timeout_s: float = 600.0,
    api_key: str | None = None,
    sweep: str | None = None,
    plot_dir: str | None = None,
    quiet: bool = False,
    by: str | None = None,
) -> int:
    """Run ``workload_spec`` against every config and endpoint for ``seeds`` seeds (at every
    ``sweep`` value); print Markdown (mean ± 95% CI half-width), write JSON and plots.

    ``by`` names an ``extra`` field of the workload's requests: the report breaks latency,
    goodput and deadline misses down by its values. With two or more targets and seeds, a
    second table gives each target's difference from the first, paired by seed, and the seeds
    such a difference needs (:mod:`brigade.bench.compare`)."""
    _check_targets(config_paths, endpoints, seeds, model)
    limits = parse_slo(slo) if slo else None
    spec = parse_workload(workload_spec)
    sweep_spec = _parse_sweep(sweep, spec, endpoints)
    plots = _plot_directory(plot_dir)
    configs = _load_configs(config_paths, overrides)
    vocab = _shared_vocab_size(configs, (vocab_size or 32000) if endpoints else None)
    targets = [
        _Target(name, config_path=path)
        for name, path in zip(_column_names(config_paths), config_paths, strict=True)
    ]
    for url in endpoints:
        endpoint = Endpoint(
            url, model or "", prompt_format, max_concurrency, request_timeout_s, api_key
        )
        targets.append(_Target(_endpoint_name(url, endpoints), endpoint=endpoint))
    values: list[str | None] = list(sweep_spec.values) if sweep_spec else [None]
    num_requests = spec.num_requests or len(spec.build(0, vocab))  # a trace: count its lines
    if by is not None:
        _check_by(by, spec.build(0, vocab))
    plan = _Plan(spec, vocab, seeds, tuple(overrides), limits, sweep_spec, plots is not None, by)
    total = num_requests * len(targets) * len(values) * seeds
    collected = _run_all(plan, targets, values, total, show=not quiet and sys.stderr.isatty())
    summaries = {name: [summarize(p.runs) for p in points] for name, points in collected.items()}
    differences = None
    if sweep_spec is None and len(targets) > 1:
        differences = _differences_from_first(collected)
    _report(workload_spec, seeds, limits, sweep_spec, targets, summaries, json_path, differences)
    if plots is not None:
        _plot(plots, sweep_spec, collected, summaries)
    return 0


def _check_targets(
    config_paths: Sequence[str], endpoints: Sequence[str], seeds: int, model: str | None
) -> None:
    """Something to run, seeds to run it with, and the model name an endpoint needs."""
    if not config_paths and not endpoints:
        raise BenchError("give at least one --config or --endpoint")
    if seeds < 1:
        raise BenchError(f"--seeds {seeds} is not allowed; need >= 1")
    if endpoints and not model:
        raise BenchError("--endpoint needs --model, the model name the server serves")


def _parse_sweep(
    sweep: str | None, spec: WorkloadSpec, endpoints: Sequence[str]
) -> SweepSpec | None:
    """``--sweep``, checked against what it applies to: a config key applies to no endpoint,
    a rate to no trace."""
    sweep_spec = parse_sweep(sweep) if sweep else None
    if sweep_spec is not None and not sweep_spec.is_rate and endpoints:
        raise BenchError(
            f"--sweep {sweep_spec.key} changes brigade configs and cannot apply to --endpoint; "
            "sweep rate=... instead"
        )
    if sweep_spec is not None and sweep_spec.is_rate:
        spec.with_rate(1.0)  # a trace cannot be re-rated: fail before running anything
    return sweep_spec


def _plot_directory(plot_dir: str | None) -> Path | None:
    """``--plot-dir``, made, once it is sure the plots can be drawn (None: no plots)."""
    if not plot_dir:
        return None
    from brigade.bench.plots import require_matplotlib

    require_matplotlib()
    plots = Path(plot_dir)
    plots.mkdir(parents=True, exist_ok=True)
    return plots


def _load_configs(config_paths: Sequence[str], overrides: Sequence[str]) -> list[EngineConfig]:
    """Every ``--config``, with the ``--set`` overrides."""
    from brigade.config import load_config
    from brigade.registry import default_registry

    registry = default_registry()
    return [load_config(path, registry, overrides=overrides) for path in config_paths]


def _shared_vocab_size(configs: Sequence[EngineConfig], endpoint_vocab_size: int | None) -> int:
    """One vocabulary for every target so each seed's workload is identical across them:
    the smallest of the configs' models' and the endpoints' (None: no endpoint)."""
    vocabs = [_vocab_size(config) for config in configs]
    if endpoint_vocab_size is not None:
        vocabs.append(endpoint_vocab_size)
    return min(vocabs)


def _run_all(
    plan: _Plan, targets: Sequence[_Target], values: Sequence[str | None], total: int, show: bool
) -> dict[str, list[_Collected]]:
    """Every target at every sweep value, ``total`` requests in all behind a progress bar
    (``show``)."""
    from tqdm import tqdm

    collected: dict[str, list[_Collected]] = {}
    with tqdm(total=total, desc="bench", unit="req", disable=not show) as bar:
        for target in targets:
            collected[target.name] = [_run_point(plan, target, value, bar) for value in values]
    return collected


def _differences_from_first(
    collected: dict[str, list[_Collected]],
) -> dict[str, dict[str, Difference]]:
    """Each target's difference from the first, paired by seed (no sweep: one point each)."""
    baseline, *others = collected
    return {
        name: compare_runs(collected[baseline][0].runs, collected[name][0].runs) for name in others
    }


@dataclasses.dataclass(frozen=True, slots=True)
class _Plan:
    """What every run of one invocation shares."""

    spec: WorkloadSpec
    vocab_size: int
    seeds: int
    overrides: tuple[str, ...]
    slo: dict[str, float] | None
    sweep: SweepSpec | None
    keep_latencies: bool
    by: str | None = None


def _check_by(field: str, workload: Sequence[Any]) -> None:
    """``--by`` must name an ``extra`` field some request of the workload carries."""
    present = sorted({key for request in workload for key in request.extra})
    if field not in present:
        fields = ", ".join(present) if present else "none (the workload carries no extra data)"
        raise BenchError(
            f"--by {field!r}: no request of the workload has extra field {field!r}; "
            f"fields present: {fields}"
        )


def _run_point(plan: _Plan, target: _Target, value: str | None, bar: Any) -> _Collected:
    """Every seed of one target at one sweep value (``None``: no sweep)."""
    from brigade.config import load_config
    from brigade.engine import EngineCore
    from brigade.registry import default_registry

    spec, overrides = plan.spec, list(plan.overrides)
    label = target.name
    if plan.sweep is not None and value is not None:
        label = f"{target.name} {plan.sweep.key}={value}"
        if plan.sweep.is_rate:
            spec = spec.with_rate(float(value))
        else:
            overrides.append(f"{plan.sweep.key}={value}")
    engine = None
    if target.config_path is not None:
        registry = default_registry()
        config = load_config(target.config_path, registry, overrides=overrides)
        if config.plugin("executor") != "simulated":
            engine = EngineCore(config, registry)
    point = _Collected()
    try:
        if engine is not None or target.endpoint is not None:
            warm_up(engine, target.endpoint)
        for seed in range(plan.seeds):
            bar.set_description(f"{label} seed {seed}")
            workload = spec.build(seed, plan.vocab_size)
            if target.endpoint is not None:
                timings, run = run_on_endpoint(target.name, target.endpoint, workload, bar.update)
            elif engine is not None:
                timings, run = run_real(engine, workload, f"s{seed}-", bar.update)
            else:
                timings, run = run_simulated(target.config_path, overrides, workload, bar.update)
            point.runs.append(summarize_run(timings, run, plan.slo, by=plan.by))
            point.add(timings, plan.keep_latencies)
    finally:
        if engine is not None:
            for executor in (engine.executor, *engine.draft_executors):
                executor.shutdown()
    return point


def _report(
    workload_spec: str,
    seeds: int,
    limits: dict[str, float] | None,
    sweep: SweepSpec | None,
    targets: Sequence[_Target],
    summaries: dict[str, list[dict[str, Summary]]],
    json_path: str | None,
    differences: dict[str, dict[str, Difference]] | None = None,
) -> None:
    if sweep is None:
        print(render_markdown({name: points[0] for name, points in summaries.items()}), end="")
    else:
        print(render_sweep_markdown(sweep.key, sweep.values, summaries), end="")
    baseline = targets[0].name
    if differences and seeds > 1:
        print()
        print(render_differences_markdown(baseline, differences, seeds), end="")
    if not json_path:
        return
    entries: dict[str, dict[str, object]] = {}
    for target in targets:
        entry: dict[str, object] = (
            {"endpoint": target.endpoint.base_url, "model": target.endpoint.model}
            if target.endpoint is not None
            else {"config": target.config_path}
        )
        points = summaries[target.name]
        if sweep is None:
            entry["metrics"] = summaries_json(points[0])
        else:
            entry["sweep"] = sweep_json(sweep.key, sweep.values, points)
        entries[target.name] = entry
    document: dict[str, object] = {
        "workload": workload_spec,
        "seeds": seeds,
        "slo": limits,
        "sweep": None if sweep is None else {"key": sweep.key, "values": list(sweep.values)},
        "configs": entries,
    }
    if differences:
        document["differences"] = {
            "baseline": baseline,
            "configs": {name: differences_json(diffs) for name, diffs in differences.items()},
        }
    try:
        Path(json_path).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        raise BenchError(f"cannot write --json {json_path}: {exc}") from exc


def _plot(
    directory: Path,
    sweep: SweepSpec | None,
    collected: dict[str, list[_Collected]],
    summaries: dict[str, list[dict[str, Summary]]],
) -> None:
    from brigade.bench.plots import write_latency_cdfs, write_sweep_curves

    series = {}
    for name, points in collected.items():
        for index, point in enumerate(points):
            label = name if sweep is None else f"{name} {sweep.key}={sweep.values[index]}"
            series[label] = point.latencies_ms
    written = [write_latency_cdfs(directory, series)]
    if sweep is not None:
        curves = {
            name: {
                metric: [p[metric].mean if metric in p else float("nan") for p in points]
                for metric in dict.fromkeys(m for p in points for m in p)
            }
            for name, points in summaries.items()
        }
        written += write_sweep_curves(directory, sweep.key, sweep.values, curves)
    print(f"brigade bench: wrote {', '.join(str(path) for path in written)}", file=sys.stderr)


def _column_names(paths: Sequence[str]) -> list[str]:
    """File stems, or full paths where two stems collide."""
    stems = [Path(p).stem for p in paths]
    return [s if stems.count(s) == 1 else p for s, p in zip(stems, paths, strict=True)]


def _endpoint_name(url: str, urls: Sequence[str]) -> str:
    """``host:port``, or the whole URL where two endpoints share a host and port."""
    host = url.split("://", 1)[-1].split("/", 1)[0]
    return host if sum(u.split("://", 1)[-1].split("/", 1)[0] == host for u in urls) == 1 else url
