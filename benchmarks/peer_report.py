"""benchmarks/peers.py's report: the machine, one table per workload, the engines' facts."""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from peer_checks import Verdict
from peer_setup import (
    CPU_FLAGS,
    JOB_GROUPS,
    NOISY_SHARE,
    PREFIX_WORKLOADS,
    REPO,
    Checkpoint,
    Engine,
    describe_workload,
)

# --- report ----------------------------------------------------------------------------------


def cpu_summary() -> str:
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    marks = " ".join(f"{f}{'+' if f in flags else '-'}" for f in CPU_FLAGS)
    return f"{model}, {os.cpu_count()} cores; {marks}"


def git_revision() -> str:
    def git(*arguments: str) -> str:
        return subprocess.run(
            ["git", "-C", str(REPO), *arguments], capture_output=True, text=True, timeout=30
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return head + (" + uncommitted changes" if dirty else "")


def figures(workload: dict[str, Any], result: dict[str, Any]) -> dict[str, float]:
    """tok/s (throughput) or ms per output token (latency) from one engine's timings."""
    seconds = result["seconds"]
    if workload["kind"] == "latency":
        n = workload["runs"][0]["output_lens"][0]
        return {
            "decode_ms_per_token": 1000 * statistics.median(per_run(workload, result)),
            "total_ms_per_token": 1000 * statistics.median(seconds) / n,
            "first_token_ms": 1000 * statistics.median(result["first_token_seconds"]),
        }
    return {"tokens_per_s": result["output_tokens"] / statistics.median(seconds)}


def per_run(workload: dict[str, Any], result: dict[str, Any]) -> list[float]:
    """Each timed run's time: its seconds, or (latency) its decode seconds per token."""
    if workload["kind"] != "latency":
        return list(result["seconds"])
    n = workload["runs"][0]["output_lens"][0]
    return [
        (full - first) / max(1, n - 1)
        for full, first in zip(result["seconds"], result["first_token_seconds"], strict=True)
    ]


def turn_ratios(
    workload: dict[str, Any], brigade: dict[str, Any], peer: dict[str, Any]
) -> list[float]:
    """Brigade's lead in each turn: the peer's time over Brigade's, run by run. Taking turns,
    run i of every engine falls in the same minutes, so each ratio sees one mood of the
    machine, where the ratio of medians can pair a fast minute of one engine with a slow one
    of the other (one engine's turns spread by up to half on a noisy host). Every run of a
    workload makes the same number of tokens (EOS ignored), so times compare as rates do."""
    return [
        theirs / ours
        for ours, theirs in zip(per_run(workload, brigade), per_run(workload, peer), strict=False)
    ]


def describe_ratios(ratios: list[float]) -> str:
    """``; turns 1.31x (1.20-1.48)``: the median of the turns' ratios and their range."""
    if len(ratios) < 2:
        return ""
    return f"; turns {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


@dataclasses.dataclass
class Measurements:
    """Everything the engines' runs produced, per workload and engine."""

    results: dict[str, dict[str, dict[str, Any]]]
    """workload -> engine -> the driver's figures (``seconds``, ``tokens``, ...)."""
    errors: dict[str, dict[str, str]]
    """workload -> engine -> why it has no figures."""
    others_cpu_share: dict[str, dict[str, float]]
    """workload -> engine -> share of the CPU other processes used during that engine's run."""
    facts: dict[str, Any]
    """engine -> what its drivers reported (versions, settings) and their wall times."""
    notes: list[str]


def record(
    found: Measurements,
    name: str,
    prefix_caching: bool,
    chosen: list[str],
    workloads: dict[str, dict[str, Any]],
    result: dict[str, Any],
    error: str,
) -> None:
    """File one driver's results (or why it has none) under each of its workloads."""
    keep = ("facts", "startup_s", "wall_s", "others_cpu_share")
    found.facts.setdefault(name, {})["prefix" if prefix_caching else "plain"] = {
        k: result.get(k) for k in keep
    }
    for workload in chosen:
        got = result.get("workloads", {}).get(workload)
        if got and "error" not in got:
            found.results[workload][name] = got
            found.others_cpu_share[workload][name] = result["others_cpu_share"]
            # Now, not only in the report: a run cut short keeps what it measured.
            shown = ", ".join(f"{k} {v:.2f}" for k, v in figures(workloads[workload], got).items())
            print(f"  {name} {workload}: {shown}", file=sys.stderr, flush=True)
        else:
            reason = (got or {}).get("error") or error or "no result"
            found.errors[workload][name] = reason.strip()
    status = f" ({error.splitlines()[0]})" if error else ""
    print(f"  {name} done in {result['wall_s']:.0f} s{status}", file=sys.stderr)


def render_table(
    workload: dict[str, Any],
    found: Measurements,
    verdicts: dict[str, Verdict],
    engines: dict[str, Engine],
) -> list[str]:
    name_of_workload = workload["name"]
    results = found.results[name_of_workload]
    rows = {e: figures(workload, r) for e, r in results.items()}
    latency = workload["kind"] == "latency"
    checked = f"greedy tokens ({len(workload['sample'])} checked)"
    if latency:
        lines = [
            "| engine | decode ms/token | total ms/token (incl. prefill) | first token ms "
            f"| engine / Brigade; turn by turn | {checked} |",
            "|---|---|---|---|---|---|",
        ]
    else:
        lines = [
            f"| engine | tok/s | runs (s) | Brigade / engine; turn by turn | {checked} |",
            "|---|---|---|---|---|",
        ]
    ours = rows.get("brigade")

    def turns(name: str) -> str:
        return describe_ratios(turn_ratios(workload, results["brigade"], results[name]))

    for name, engine in engines.items():
        if name not in rows:
            if name in found.errors[name_of_workload]:
                lines.append(f"| {engine.label} | failed (below) |" + " |" * (4 if latency else 3))
            continue
        row = rows[name]
        noisy = found.others_cpu_share[name_of_workload].get(name, 0.0) > NOISY_SHARE
        mark = " (noisy)" if noisy else ""
        verdict = verdicts.get(name, Verdict()).describe()
        if name == "brigade" and verdict != "not checked":
            verdict += " (vs the reference)"
        if latency:
            ms = row["decode_ms_per_token"]
            ratio = (
                f"{ms / ours['decode_ms_per_token']:.2f}x" + turns(name)
                if ours and name != "brigade"
                else "—"
            )
            lines.append(
                f"| {engine.label} | {ms:.2f}{mark} | {row['total_ms_per_token']:.2f} | "
                f"{row['first_token_ms']:.1f} | {ratio} | {verdict} |"
            )
        else:
            rate = row["tokens_per_s"]
            ratio = (
                f"{ours['tokens_per_s'] / rate:.2f}x" + turns(name)
                if ours and name != "brigade"
                else "—"
            )
            runs = " ".join(f"{s:.3g}" for s in results[name]["seconds"])
            lines.append(f"| {engine.label} | {rate:.1f}{mark} | {runs} | {ratio} | {verdict} |")
    return lines


def report(
    args: argparse.Namespace,
    checkpoint: Checkpoint,
    versions: dict[str, str],
    workloads: dict[str, dict[str, Any]],
    engines: dict[str, Engine],
    found: Measurements,
    verdicts: dict[str, dict[str, Verdict]],
) -> None:
    print("# Brigade vs peers")
    print()
    print(f"- CPU: {cpu_summary()}")
    print(f"- threads: {args.threads} per engine; {args.dtype} weights, activations and KV; greedy")
    print(f"- model: {checkpoint.describe()}")
    print(f"- Brigade {git_revision()}" + (f", --set {' '.join(args.set)}" if args.set else ""))
    print("- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    if args.scale != 1.0:
        print(f"- **--scale {args.scale}: not the standard workloads**")
    for name, workload in workloads.items():
        print()
        print(f"## {name}")
        print()
        print(describe_workload(workload, name in PREFIX_WORKLOADS))
        if workload["kind"] == "latency":
            n = workload["runs"][0]["output_lens"][0]
            print(f"Decode ms/token = ({n}-token call - 1-token call) / {n - 1}.")
        print()
        if found.results[name] or found.errors[name]:
            for line in render_table(workload, found, verdicts[name], engines):
                print(line)
        else:
            print("No engine ran.")
        noisy = [
            f"{engines[engine].label} {share:.0%}"
            for engine, share in found.others_cpu_share[name].items()
            if share > NOISY_SHARE
        ]
        if noisy:
            print(f"\nnoisy: other processes' share of the CPU during the run: {'; '.join(noisy)}")
        for engine, verdict in verdicts[name].items():
            for line in verdict.real:
                print(f"\n**REAL DIVERGENCE, {engines[engine].label}**: {line}")
        for engine, error in found.errors[name].items():
            print(f"\n{engines[engine].label} failed: {error}")
    print()
    print("## Engines")
    print()
    for name, jobs in found.facts.items():
        for group, job in jobs.items():
            facts = job.get("facts") or {}
            startup = job.get("startup_s")
            parts = [f"started in {startup:.0f} s" if startup is not None else "did not start"]
            parts += [f"{k}={v}" for k, v in facts.items() if k != "system_info"]
            print(f"- {engines[name].label} ({JOB_GROUPS[group]}): {'; '.join(parts)}")
    for note in found.notes:
        print(f"- {note}")
