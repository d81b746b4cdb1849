"""The CPU executor's allocation settings (``cpu_memory.py``): large freed buffers are reused
without faulting their pages in again."""

from __future__ import annotations

import platform
import resource

import pytest
import torch

from brigade.plugins.executors.cpu_memory import keep_freed_memory

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
