"""``brigade bench``: run a workload against configs in-process over several seeds.

A config whose executor is ``simulated`` runs on the executor's virtual clock
(:func:`~brigade.bench.simulate.run_simulation`); any other runs on the wall clock, with
requests joining the engine at their arrival times.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from brigade.bench.report import (
    BenchError,
    RequestTiming,
    RunMetrics,
    Summary,
    parse_slo,
    render_markdown,
    summarize,
    summarize_run,
)
from brigade.bench.workloads import (
    Arrivals,
    Lengths,
    WorkloadError,
    WorkloadRequest,
    load_trace,
    synthetic,
)

__all__ = ["WorkloadSpec", "parse_workload", "run_bench"]

SYNTHETIC_PREFIX = "synthetic:"
_SYNTHETIC_KEYS = ("requests", "prompt", "output", "rate", "burstiness", "priorities")
_DEFAULT_PROMPT = Lengths("fixed", 128)
_DEFAULT_OUTPUT = Lengths("fixed", 64)
_AT_ONCE = Arrivals()


@dataclasses.dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A parsed ``--workload``: a JSONL trace or a synthetic generator's arguments."""

    trace: Path | None = None
    num_requests: int = 0
    prompt_lens: Lengths = _DEFAULT_PROMPT
    output_lens: Lengths = _DEFAULT_OUTPUT
    arrivals: Arrivals = _AT_ONCE
    priorities: tuple[tuple[int, float], ...] = ()

    def build(self, seed: int, vocab_size: int) -> list[WorkloadRequest]:
        """The workload for one seed, prompt ids below ``vocab_size``."""
        try:
            if self.trace is not None:
                return load_trace(self.trace, vocab_size=vocab_size, seed=seed)
            return synthetic(
                self.num_requests,
                self.prompt_lens,
                self.output_lens,
                self.arrivals,
                vocab_size=vocab_size,
                priorities=self.priorities,
                seed=seed,
            )
        except WorkloadError as exc:
            raise BenchError(str(exc)) from exc


def _parse_lengths(key: str, text: str) -> Lengths:
    """``fixed:64``, ``uniform:LOW:HIGH``, ``normal:MEAN:STD``, ``lognormal:MEAN:SIGMA``."""
    kind, *numbers = text.split(":")
    try:
        values = [float(n) for n in numbers]
    except ValueError:
        values = []
    expected = 1 if kind == "fixed" else 2
    if kind not in ("fixed", "uniform", "normal", "lognormal") or len(values) != expected:
        raise BenchError(
            f"workload {key}={text!r} is not allowed; use fixed:N, uniform:LOW:HIGH, "
            "normal:MEAN:STD or lognormal:MEAN:SIGMA"
        )
    try:
        if kind == "fixed":
            return Lengths("fixed", values[0], minimum=1)
        if kind == "uniform":
            low, high = values
            if low > high or low < 1:
                raise BenchError(f"workload {key}={text!r}: need 1 <= LOW <= HIGH")
            return Lengths("uniform", (low + high) / 2, (high - low) / 2, round(low), round(high))
        return Lengths(kind, values[0], values[1])  # type: ignore[arg-type]
    except WorkloadError as exc:
        raise BenchError(f"workload {key}={text!r}: {exc}") from exc


def _parse_priorities(text: str) -> tuple[tuple[int, float], ...]:
    """``0:1/1:4`` -> level 0 with weight 1, level 1 with weight 4."""
    pairs = []
    for term in text.split("/"):
        level, sep, weight = term.partition(":")
        try:
            pair = (int(level), float(weight))
        except ValueError:
            pair = (0, -1.0)
        if not sep or not pair[1] > 0:
            raise BenchError(
                f"workload priorities={text!r} is not allowed; use LEVEL:WEIGHT pairs joined "
                "by '/', weights > 0 (e.g. 0:1/1:4)"
            )
        pairs.append(pair)
    return tuple(pairs)


def parse_workload(spec: str) -> WorkloadSpec:
    """A JSONL trace path, or ``synthetic:requests=N,prompt=LEN,output=LEN[,rate=R]``.

    LEN is ``fixed:N``, ``uniform:LOW:HIGH``, ``normal:MEAN:STD`` or ``lognormal:MEAN:SIGMA``;
    without ``rate`` every request arrives at once, with it arrivals are Poisson at ``rate``/s
    (gamma with ``burstiness``); ``priorities=0:1/1:4`` draws priority levels by weight.
    """
    if not spec.startswith(SYNTHETIC_PREFIX):
        path = Path(spec)
        if not path.is_file():
            raise BenchError(
                f"workload {spec!r} is neither a JSONL trace file nor "
                "synthetic:requests=N,prompt=...,output=...[,rate=R]"
            )
        return WorkloadSpec(trace=path)
    fields: dict[str, str] = {}
    for part in filter(None, spec[len(SYNTHETIC_PREFIX) :].split(",")):
        key, sep, value = part.partition("=")
        if not sep or key not in _SYNTHETIC_KEYS:
            raise BenchError(
                f"workload term {part!r} is not allowed; keys: {', '.join(_SYNTHETIC_KEYS)}"
            )
        fields[key] = value
    if "requests" not in fields:
        raise BenchError("a synthetic workload needs requests=N")
    try:
        num_requests = int(fields["requests"])
        rate = float(fields.get("rate", "0"))
        burstiness = float(fields.get("burstiness", "1"))
    except ValueError as exc:
        raise BenchError(f"workload {spec!r}: requests, rate, burstiness must be numbers") from exc
    if num_requests < 1:
        raise BenchError(f"workload requests={num_requests} is not allowed; need >= 1")
    if rate < 0:
        raise BenchError(f"workload rate={rate} is not allowed; need >= 0 (0 = all at once)")
    kind = "at_once" if rate == 0 else ("poisson" if "burstiness" not in fields else "gamma")
    try:
        arrivals = Arrivals(kind, rate, burstiness)  # type: ignore[arg-type]
    except WorkloadError as exc:
        raise BenchError(str(exc)) from exc
    return WorkloadSpec(
        num_requests=num_requests,
        prompt_lens=_parse_lengths("prompt", fields.get("prompt", "fixed:128")),
        output_lens=_parse_lengths("output", fields.get("output", "fixed:64")),
        arrivals=arrivals,
        priorities=_parse_priorities(fields["priorities"]) if "priorities" in fields else (),
    )


def _vocab_size(config: Any) -> int:
    """The model's vocabulary size, from its HF config.json (no weights are read)."""
    from brigade.assemble import resolve_model_path

    path = resolve_model_path(config) / "config.json"  # "default" builds the built-in model
    try:
        vocab = json.loads(path.read_text(encoding="utf-8")).get("vocab_size")
    except (OSError, ValueError) as exc:
        raise BenchError(f"{config.source}: cannot read the model's {path}: {exc}") from exc
    if not isinstance(vocab, int) or vocab < 1:
        raise BenchError(f"{path}: 'vocab_size' must be a positive integer")
    return vocab


def _run_simulated(
    path: str, overrides: Sequence[str], workload: Sequence[WorkloadRequest]
) -> tuple[list[RequestTiming], RunMetrics]:
    from brigade.bench.simulate import run_simulation

    result = run_simulation(overrides, workload, config_path=path)
    timings = [RequestTiming(r.ttft_s, r.e2e_s, r.output_len) for r in result.requests]
    return timings, RunMetrics(result.duration_s, result.num_preemptions, result.prefix_hit_rate)


def _run_real(
    engine: Any, workload: Sequence[WorkloadRequest], prefix: str
) -> tuple[list[RequestTiming], RunMetrics]:
    """Feed ``workload`` to ``engine`` at its arrival times on the wall clock."""
    from brigade.interfaces import SamplingParams

    before = engine.stats()
    pending = deque(sorted(range(len(workload)), key=lambda i: workload[i].arrival_time))
    start = time.perf_counter()
    offset = workload[pending[0]].arrival_time if pending else 0.0
    first_token: dict[int, float] = {}
    timings: dict[int, RequestTiming] = {}
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and workload[pending[0]].arrival_time - offset <= now:
            index = pending.popleft()
            request = workload[index]
            params = SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)
            engine.add_request(
                f"{prefix}{index}", request.prompt_token_ids, params, priority=request.priority
            )
        if not engine.has_unfinished():
            # Idle: wait for the next arrival, never longer than its gap.
            time.sleep(max(0.0, workload[pending[0]].arrival_time - offset - now))
            continue
        steps_before = engine.num_steps
        updates = engine.step()
        if not updates and engine.num_steps == steps_before and not pending:
            raise BenchError("the engine made no progress with no arrivals left")
        now = time.perf_counter() - start
        for update in updates:
            index = int(update.request.request_id.removeprefix(prefix))
            arrival = workload[index].arrival_time - offset
            first_token.setdefault(index, now)
            if update.finished:
                timings[index] = RequestTiming(
                    first_token[index] - arrival, now - arrival, update.request.num_output_tokens
                )
    after = engine.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    run = RunMetrics(
        duration_s=time.perf_counter() - start,
        num_preemptions=after.num_preemptions - before.num_preemptions,
        prefix_hit_rate=hits / queries if queries else 0.0,
    )
    return [timings[i] for i in sorted(timings)], run


def run_bench(
    config_paths: Sequence[str],
    workload_spec: str,
    *,
    seeds: int = 1,
    slo: str | None = None,
    json_path: str | None = None,
    overrides: Sequence[str] = (),
) -> int:
    """Run ``workload_spec`` against every config for ``seeds`` seeds; print a Markdown table
    (mean ± 95% CI half-width per config) and write JSON to ``json_path`` if given."""
    from tqdm import tqdm

    from brigade.config import load_config
    from brigade.engine import EngineCore
    from brigade.registry import default_registry

    if not config_paths:
        raise BenchError("give at least one --config")
    if seeds < 1:
        raise BenchError(f"--seeds {seeds} is not allowed; need >= 1")
    limits = parse_slo(slo) if slo else None
    spec = parse_workload(workload_spec)
    registry = default_registry()
    configs = [load_config(path, registry, overrides=overrides) for path in config_paths]
    # One vocabulary for every config so each seed's workload is identical across configs.
    vocab_size = min(_vocab_size(config) for config in configs)
    names = _column_names(config_paths)
    results: dict[str, dict[str, Summary]] = {}
    runs_by_config: dict[str, list[dict[str, float]]] = {}
    show = sys.stderr.isatty()
    with tqdm(total=len(configs) * seeds, desc="bench", unit="run", disable=not show) as bar:
        for name, path, config in zip(names, config_paths, configs, strict=True):
            simulated = config.plugin("executor") == "simulated"
            engine = None if simulated else EngineCore(config, registry)
            runs = []
            for seed in range(seeds):
                workload = spec.build(seed, vocab_size)
                if engine is None:
                    timings, run = _run_simulated(path, overrides, workload)
                else:
                    timings, run = _run_real(engine, workload, prefix=f"s{seed}-")
                runs.append(summarize_run(timings, run, limits))
                bar.update(1)
            if engine is not None:
                engine.executor.shutdown()
            runs_by_config[name] = runs
            results[name] = summarize(runs)
    print(render_markdown(results), end="")
    if json_path:
        document = {
            "workload": workload_spec,
            "seeds": seeds,
            "slo": limits,
            "configs": {
                name: {
                    "config": path,
                    "metrics": {
                        metric: {
                            "mean": s.mean,
                            "ci95": [s.ci_low, s.ci_high],
                            "samples": list(s.samples),
                        }
                        for metric, s in results[name].items()
                    },
                }
                for name, path in zip(names, config_paths, strict=True)
            },
        }
        try:
            Path(json_path).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            raise BenchError(f"cannot write --json {json_path}: {exc}") from exc
    return 0


def _column_names(paths: Sequence[str]) -> list[str]:
    """File stems, or full paths where two stems collide."""
    stems = [Path(p).stem for p in paths]
    return [s if stems.count(s) == 1 else p for s, p in zip(stems, paths, strict=True)]
