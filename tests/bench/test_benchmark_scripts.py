"""The scripts under ``benchmarks/`` import: a renamed API breaks them loudly here, not on the
day someone runs them (the GPU ones otherwise only run on a GPU machine)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_every_benchmark_script_imports() -> None:
    # One interpreter for all of them: module-level imports run, ``main()`` does not. The
    # drivers in peer_drivers/ run in the peers' venvs and are left out.
    names = sorted(path.stem for path in BENCHMARKS.glob("*.py"))
    assert "peers" in names
    assert "attention_kernels" in names
    code = (
        "import importlib, sys\n"
        f"sys.path.insert(0, {str(BENCHMARKS)!r})\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_peer_report_pairs_each_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    # Brigade's lead turn by turn: run i of each engine, taken in the same minutes, compared
    # with each other (the times of a throughput workload; decode seconds a token at batch 1).
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import peer_report

    uniform = {"kind": "throughput"}
    ratios = peer_report.turn_ratios(
        uniform, {"seconds": [10.0, 20.0, 12.0]}, {"seconds": [15.0, 22.0, 18.0]}
    )
    assert ratios == [1.5, 1.1, 1.5]
    assert peer_report.describe_ratios(ratios) == "; turns 1.50x (1.10-1.50)"
    assert peer_report.describe_ratios(ratios[:1]) == ""  # one run: nothing to add
    latency = {"kind": "latency", "runs": [{"output_lens": [11]}]}
    ours = {"seconds": [1.1, 1.2], "first_token_seconds": [0.1, 0.2]}
    theirs = {"seconds": [2.1, 1.7], "first_token_seconds": [0.1, 0.2]}
    assert peer_report.turn_ratios(latency, ours, theirs) == pytest.approx([2.0, 1.5])
