"""The scripts under ``benchmarks/`` import: a renamed API breaks them loudly here, not on the
day someone runs them (the GPU ones otherwise only run on a GPU machine)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
