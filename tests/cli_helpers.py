"""The ``brigade`` command as a user runs it, and what a refusal must look like."""

from __future__ import annotations

import os
import subprocess
import sys

__all__ = ["assert_refused", "run_brigade"]


def run_brigade(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``brigade ARGV`` in a subprocess (``env`` adds to the environment)."""
    return subprocess.run(
        [sys.executable, "-m", "brigade", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def assert_refused(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    """Exit status 2 and one error line (every process that reports it says the same) holding
    every fragment; no traceback."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = {line for line in result.stderr.splitlines() if line.startswith("brigade: error: ")}
    assert len(errors) == 1, result.stderr
    for fragment in fragments:
        assert fragment in next(iter(errors)), result.stderr
