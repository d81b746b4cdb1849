"""The CPU executor's allocation settings (``cpu_memory.py``): large freed buffers are reused
without faulting their pages in again; the KV pool is committed at start on huge pages, or
faulted in lazily when told."""

from __future__ import annotations

import ctypes
import mmap
import platform
import resource
from pathlib import Path

import pytest
import torch
from executor_helpers import PAGE_SIZE, make_executor

from brigade.model_input import SeqChunk, build_model_input
from brigade.models.create import create_model
from brigade.plugins.cpu.memory import advise_huge_pages, keep_freed_memory

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
    """Linux's transparent huge page mode ('always', 'madvise', 'never'), or '' without THP."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else ""


def _huge_kib_at(address: int) -> int:
    """AnonHugePages of the mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def _thp_fallbacks() -> int:
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("thp_fault_fallback "):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(not GLIBC, reason="Linux's madvise through glibc")
def test_a_range_advised_before_its_first_touch_gets_huge_pages() -> None:
    assert not advise_huge_pages(4096, 4096), "no whole huge page inside: nothing to advise"
    if _thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {_thp_mode() or 'not built'} here")
    # A fresh private anonymous mapping (what malloc maps): untouched, whatever malloc kept
    # from earlier tests.
    region = mmap.mmap(-1, 16 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = ctypes.c_char.from_buffer(region)
    address = ctypes.addressof(buffer)
    assert advise_huge_pages(address, 16 << 20)
    fallbacks = _thp_fallbacks()
    pool = torch.frombuffer(region, dtype=torch.uint8)
    pool.fill_(1)  # the first touch
    huge = _huge_kib_at(address + (8 << 20))
    del pool, buffer
    region.close()
    if huge == 0 and _thp_fallbacks() > fallbacks:
        pytest.skip("the kernel had no free huge page at the fault (thp_fault_fallback)")
    assert huge >= 2048


def test_the_cpu_kv_pool_is_committed_at_start_unless_told_to_fault_it_in_lazily(
    tmp_path: Path,
) -> None:
    model = create_model(tmp_path / "llama", "llama", overrides={"num_hidden_layers": 2})
    committed = make_executor(model)
    assert committed._unzeroed is None
    for key_cache, value_cache in committed.kv_caches:  # the warm-up's page 0 included
        assert not key_cache.any()
        assert not value_cache.any()
    lazy = make_executor(model, kv_prefault=False)
    assert lazy._unzeroed is not None
    assert bool(lazy._unzeroed[0]), "the warm-up's page is zeroed before a request uses it"
    assert int(lazy._unzeroed.sum()) == lazy.num_pages
    # Both serve a request on page 0 right after the warm-up alike.
    batch = build_model_input([SeqChunk(list(range(3, 9)), 0, [0, 1], "all")], PAGE_SIZE)
    torch.testing.assert_close(committed.execute(batch), lazy.execute(batch), atol=0, rtol=0)
