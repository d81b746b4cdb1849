"""Packaging: the wheel holds every module, data file and entry point; contracts stay light."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_interfaces_import_without_torch() -> None:
    code = (
        "import sys, brigade.interfaces as i; "
        "heavy = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]; "
        "print(','.join(heavy) or 'light', len(i.COMPONENT_KINDS))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["light", "11"]  # eleven component kinds


@pytest.mark.slow
def test_wheel_contains_every_module_and_the_entry_point(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("brigade_llm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, package in (
        ("core", "brigade"),
        ("interfaces", "brigade/interfaces"),
        ("plugins", "brigade/plugins"),
    ):
        for source in (ROOT / folder).rglob("*.py"):
            relative = source.relative_to(ROOT / folder).as_posix()
            if package == "brigade" and relative.split("/")[0] in ("interfaces", "plugins"):
                continue
            assert f"{package}/{relative}" in names, f"{folder}/{relative} missing from wheel"
    assert "brigade/models/data/corpus.txt" in names
    assert not any(n.startswith(("core/", "interfaces/", "plugins/", "tests/")) for n in names)
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[brigade]\nbuiltins = brigade.plugins.builtins" in text
    assert "brigade = brigade.cli:main" in text

    # Installed on its own, the wheel's copy is what runs, and it finds its built-ins.
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    code = (
        "import brigade, sys; from brigade.cli import main; "
        "print(brigade.__file__, file=sys.stderr); sys.exit(main(['plugins', '--json']))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(target)},
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith(str(target)), result.stderr
    assert '"name": "sdpa"' in result.stdout
