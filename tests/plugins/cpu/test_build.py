"""The CPU kernels' build: one cache directory per checkout, torch install and target, one
warning naming what to install when they cannot be built, and ``brigade kernels``."""

from __future__ import annotations

import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest
from cli_helpers import run_brigade

from brigade.cli import main
from brigade.plugins.cpu import build as cpu_build
from brigade.plugins.cpu.build import cpu_ops, exclusive_build, kernel_cache

_PACKAGE = Path(cpu_build.__file__).resolve().parent


def _load_build_module(package: Path, name: str) -> ModuleType:
    """``build.py`` of ``package`` as its own module, as another checkout would import it."""
    spec = importlib.util.spec_from_file_location(name, package / "build.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def test_two_checkouts_of_the_same_sources_never_share_a_kernel_directory(tmp_path: Path) -> None:
    # torch's load rewrites build.ninja with its caller's absolute source paths and ninja then
    # rebuilds everything: two checkouts in one directory rebuild after each other's every start.
    other = tmp_path / "other-checkout" / "cpu"
    shutil.copytree(_PACKAGE / "kernels", other / "kernels")
    shutil.copy(_PACKAGE / "build.py", other / "build.py")
    copy = _load_build_module(other, "other_checkout_build")
    assert copy.kernel_cache().directory != kernel_cache().directory
    assert copy.kernel_cache().directory.parent == kernel_cache().directory.parent
    assert kernel_cache() == kernel_cache()  # and one checkout always finds its own again


def test_another_torch_install_gets_its_own_kernel_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.utils.cpp_extension

    ours = kernel_cache().directory
    monkeypatch.setattr(
        torch.utils.cpp_extension, "include_paths", lambda device_type="cpu": ["/other/include"]
    )
    assert kernel_cache().directory != ours


def test_the_target_is_part_of_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BRIGADE_CPU_MARCH", "x86-64-v3")
    avx2 = _load_build_module(_PACKAGE, "avx2_build").kernel_cache()
    monkeypatch.setenv("BRIGADE_CPU_MARCH", "x86-64-v4")
    avx512 = _load_build_module(_PACKAGE, "avx512_build").kernel_cache()
    assert (avx2.march, avx512.march) == ("x86-64-v3", "x86-64-v4")
    assert avx2.directory != avx512.directory


def test_waiting_for_another_processs_build_is_logged_once_with_its_directory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    done = threading.Event()

    def build_next() -> None:
        with exclusive_build(tmp_path):
            done.set()

    with caplog.at_level(logging.WARNING), exclusive_build(tmp_path):
        worker = threading.Thread(target=build_next)  # its own open file: flock conflicts
        worker.start()
        deadline = time.monotonic() + 10
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not done.is_set()
    worker.join(timeout=10)
    assert done.is_set()
    waits = [r.getMessage() for r in caplog.records if "waiting for another" in r.getMessage()]
    expected = f"waiting for another process to finish building the CPU kernels in {tmp_path}"
    assert waits == [expected]


_LOAD_TWICE = """
from brigade.plugins.cpu.build import amx_tiles_usable, cpu_ops, paged_decode_kernel
assert paged_decode_kernel() is None and cpu_ops() is None
amx_tiles_usable()
"""


@pytest.mark.parametrize(
    ("tools", "named"),
    [
        ("no compiler", ["no C++ compiler: `{tmp}/no-such-c++` not found"]),
        ("empty PATH", ["no C++ compiler: `c++` not found", "no ninja"]),
    ],
)
def test_missing_tools_fall_back_with_one_warning_saying_what_to_install(
    tmp_path: Path, tools: str, named: list[str]
) -> None:
    env = {**os.environ, "BRIGADE_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("CXX", None)
    if tools == "no compiler":
        env["CXX"] = str(tmp_path / "no-such-c++")
    else:
        (tmp_path / "bin").mkdir()
        env["PATH"] = str(tmp_path / "bin")
    result = subprocess.run(
        [sys.executable, "-c", _LOAD_TWICE], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    [warning] = result.stderr.strip().splitlines()  # torch's own compiler warnings included
    assert warning.startswith("the CPU kernels could not be built (")
    for fragment in named:
        assert fragment.format(tmp=tmp_path) in warning
    assert "install a C++ compiler (g++, or clang++ with libomp) and ninja (pip install ninja)" in (
        warning
    )
    assert "decode attention gathers pages for SDPA" in warning


def test_kernels_build_without_a_compiler_warns_and_fails(tmp_path: Path) -> None:
    result = run_brigade(
        "kernels",
        "build",
        env={"CXX": str(tmp_path / "no-such-c++"), "BRIGADE_CACHE_DIR": str(tmp_path)},
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    [warning] = result.stderr.strip().splitlines()
    assert warning.startswith("brigade: warning: the CPU kernels could not be built (no C++ ")
    assert "install a C++ compiler" in warning


def test_kernels_status_names_the_directory_a_build_would_fill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BRIGADE_CACHE_DIR", str(tmp_path))
    assert main(["kernels", "status"]) == 0
    assert main(["kernels", "status", "--check"]) == 1
    out = capsys.readouterr().out
    assert f"not built for this host (-march={kernel_cache().march})" in out
    assert str(kernel_cache().directory) in out
    assert kernel_cache().directory.is_relative_to(tmp_path)


def test_kernels_build_then_status(capsys: pytest.CaptureFixture[str]) -> None:
    if cpu_ops() is None:
        pytest.skip("the CPU kernels cannot be built here")
    assert main(["kernels", "build"]) == 0
    assert main(["kernels", "status", "--check"]) == 0
    built, status = capsys.readouterr().out.splitlines()
    directory = kernel_cache().directory
    assert built.startswith("found the CPU kernels already built for -march=")
    assert built.endswith(f" s: {directory}")
    assert status.endswith(f"are built for this host (-march={kernel_cache().march}): {directory}")


def test_the_kernels_run_the_vector_width_of_their_target() -> None:
    """Under ``BRIGADE_CPU_MARCH=x86-64-v3`` (scripts/test.sh's second run) the AVX2 paths of
    ``cpu_vec.h`` are the ones compiled and tested, even on an AVX-512 machine."""
    ops = cpu_ops()
    if ops is None or platform.machine() != "x86_64":
        pytest.skip("needs the kernels built for x86-64")
    march = kernel_cache().march
    avx512 = " avx512f " in Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    expected = {"x86-64-v3": 8, "x86-64-v4": 16, "native": 16 if avx512 else 8}
    if march not in expected:
        pytest.skip(f"no expectation for -march={march}")
    assert ops.vector_lanes() == expected[march]
