"""The CPU executor's allocation settings (``cpu_memory.py``): large freed buffers are reused
without faulting their pages in again, and the KV pool asks for transparent huge pages."""

from __future__ import annotations

import platform
import resource
from pathlib import Path

import pytest
import torch

from brigade.plugins.executors.cpu_memory import advise_huge_pages, keep_freed_memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _faults_of_a_fresh_buffer(num_bytes: int) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = torch.ones(num_bytes // 4)  # written through: every page is touched
    del buffer
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_a_large_buffer_freed_and_allocated_again_is_not_faulted_in_again() -> None:
    assert keep_freed_memory()
    size = 96 << 20  # above glibc's default mmap threshold (32 MB at most)
    _faults_of_a_fresh_buffer(size)  # the heap grows once
    pages = size // 4096
    faults = min(_faults_of_a_fresh_buffer(size) for _ in range(3))
    assert faults < pages // 10, f"{faults} page faults for a reused {size >> 20} MB buffer"


def _thp_mode() -> str:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    text = path.read_text() if path.exists() else ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "never"


@pytest.mark.skipif(not GLIBC or _thp_mode() == "never", reason="needs transparent huge pages")
def test_the_kv_pool_can_ask_for_huge_pages() -> None:
    assert advise_huge_pages(torch.empty(8 << 20))  # 32 MB: whole 2 MB pages inside
    assert not advise_huge_pages(torch.empty(16)), "no whole 2 MB page inside: nothing to ask"
