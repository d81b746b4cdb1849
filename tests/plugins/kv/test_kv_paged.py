"""The ``paged`` KV manager: conformance, eviction order, hash chain, random-workload invariants."""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from brigade.interfaces import KVPoolParams, Request, RequestStatus
from brigade.plugins.kv import paged
from brigade.plugins.kv.paged import ROOT_PAGE_DIGEST, PagedKVManager, PagedKVOptions, hash_page
from brigade.testing.conformance.kv import check_kv_manager
from brigade.testing.requests import cached_once, make_request, probe_hit, run_prefill

PS = 4
"""Page size of the unit tests."""


def new_kv(num_pages: int, page_size: int = PS, caching: bool = True) -> PagedKVManager:
    return PagedKVManager(KVPoolParams(num_pages, page_size, caching), PagedKVOptions())


def tokens(tag: int, num_tokens: int) -> list[int]:
    return [tag * 1000 + i for i in range(num_tokens)]


def test_paged_manager_conforms() -> None:
    check_kv_manager(PagedKVManager, PagedKVOptions())


def test_hash_is_blake2b_over_little_endian_uint32_chain() -> None:
    first = hash_page(ROOT_PAGE_DIGEST, [1, 2, 70_000])
    expected = hashlib.blake2b(struct.pack("<3I", 1, 2, 70_000), digest_size=32).digest()
    assert first == expected  # the same bytes in every process and on every host
    assert hash_page(first, [5, 6]) != hash_page(ROOT_PAGE_DIGEST, [5, 6])


def test_hit_is_whole_pages_capped_below_num_tokens() -> None:
    kv = new_kv(16)
    prompt = tokens(1, 3 * PS)
    cached_once(kv, prompt)
    assert probe_hit(kv, prompt) == 2 * PS  # a whole-page prompt recomputes its last page
    assert probe_hit(kv, [*prompt, 9]) == 3 * PS
    assert probe_hit(kv, prompt[: 2 * PS + 1]) == 2 * PS
    assert probe_hit(kv, prompt[: 2 * PS]) == PS


def test_same_page_under_another_parent_does_not_hit() -> None:
    kv = new_kv(16)
    shared_page = tokens(2, PS)
    cached_once(kv, tokens(1, PS) + shared_page)
    assert probe_hit(kv, [*tokens(3, PS), *shared_page, 9]) == 0
    assert probe_hit(kv, [*tokens(1, PS), *shared_page, 9]) == 2 * PS


def test_lru_evicts_least_recently_freed_prefix_first() -> None:
    kv = new_kv(4)
    older = cached_once(kv, tokens(1, 2 * PS), "older")
    newer = cached_once(kv, tokens(2, 2 * PS), "newer")
    assert kv.allocate(make_request("taker", tokens(3, PS)), PS) is not None
    # Freed last page first, so the older prompt loses its tail and keeps its first page.
    assert sorted(kv._cached.values()) == sorted([older[0], *newer])
    assert list(kv._free) == [older[0], newer[1], newer[0]]
    assert probe_hit(kv, [*tokens(2, 2 * PS), 9]) == 2 * PS  # takes older[0] for its new page
    assert probe_hit(kv, [*tokens(1, 2 * PS), 9]) == 0


def test_free_releases_tail_pages_to_eviction_first() -> None:
    kv = new_kv(3)
    table = cached_once(kv, tokens(1, 3 * PS))
    taken = []
    for index in range(3):
        request = make_request(f"filler{index}", tokens(10 + index, PS))
        run_prefill(kv, request)
        taken += list(kv.block_table(request))
    assert taken == table[::-1]


def test_uncached_pages_are_reused_before_cached_ones() -> None:
    kv = new_kv(4)
    table = cached_once(kv, tokens(1, PS + 1))  # page 0 full (cached), page 1 partial
    newcomer = make_request("newcomer", tokens(2, 2 * PS))
    run_prefill(kv, newcomer)
    assert list(kv.block_table(newcomer)) == [table[1], 2]
    assert probe_hit(kv, [*tokens(1, PS), 9]) == PS


def test_commit_keeps_the_first_copy_of_a_block() -> None:
    kv = new_kv(8)
    first, second = (
        make_request("first", tokens(1, 2 * PS)),
        make_request("second", tokens(1, 2 * PS)),
    )
    for request in (first, second):  # both admitted before either commits: no sharing yet
        assert kv.allocate(request, request.num_tokens) is not None
    for request in (first, second):
        request.num_computed_tokens = request.num_tokens
        kv.commit(request)
    first_table, second_table = list(kv.block_table(first)), list(kv.block_table(second))
    assert not set(first_table) & set(second_table)
    assert sorted(kv._cached.values()) == sorted(first_table)
    for request in (second, first):
        request.status = RequestStatus.FINISHED_STOPPED
        kv.free(request)
    assert set(list(kv._free)[:2]) == set(second_table)  # the duplicates are reused first
    reader = make_request("reader", [*tokens(1, 2 * PS), 9])
    run_prefill(kv, reader)
    assert list(kv.block_table(reader))[:2] == first_table


def test_recompute_after_preemption_matches_prompt_and_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hashed: list[list[int]] = []

    def counting_hash(parent: bytes, token_ids: list[int]) -> bytes:
        hashed.append(list(token_ids))
        return hash_page(parent, token_ids)

    monkeypatch.setattr(paged, "hash_page", counting_hash)
    kv = new_kv(16)
    request = make_request("r", tokens(1, 2 * PS + 1), max_tokens=32)
    run_prefill(kv, request)
    for step in range(PS + 2):  # decode into a third full page and beyond
        request.output_token_ids.append(step)
        assert kv.allocate(request, 1) is not None
        request.num_computed_tokens += 1
        kv.commit(request)
    before = list(kv.block_table(request))
    request.status = RequestStatus.PREEMPTED
    kv.free(request)
    request.num_computed_tokens, request.status = 0, RequestStatus.WAITING
    allocation = kv.allocate(request, request.num_tokens)
    assert allocation is not None
    assert allocation.num_cached_tokens == request.num_cached_tokens == 3 * PS
    assert list(kv.block_table(request))[:3] == before[:3]
    assert len(hashed) == 3  # each page hashed once, across the preemption too


def test_digests_kept_for_a_preempted_request_never_serve_another_with_its_id() -> None:
    kv = new_kv(16)
    first = make_request("reused-id", tokens(1, 2 * PS))
    run_prefill(kv, first)
    first.status = RequestStatus.PREEMPTED
    kv.free(first)  # its digests are kept for its return
    stranger = make_request("reused-id", [*tokens(2, 2 * PS), 9])
    assert run_prefill(kv, stranger) == 0
    assert probe_hit(kv, [*tokens(1, 2 * PS), 9]) == 2 * PS


def test_swap_in_with_computed_tokens_skips_the_lookup() -> None:
    kv = new_kv(8)
    cached_once(kv, tokens(1, 2 * PS))
    returning = make_request("returning", [*tokens(1, 2 * PS), 9])
    returning.num_computed_tokens = 2 * PS  # its KV comes back from elsewhere
    allocation = kv.allocate(returning, 1)
    assert allocation is not None
    assert allocation.num_cached_tokens == returning.num_cached_tokens == 0
    assert len(kv.block_table(returning)) == 3
    assert kv.stats().prefix_cache_queries == 2 * PS  # only the owner's admission


def test_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="page_size >= 1"):
        new_kv(4, page_size=0)
    kv = new_kv(4)
    with pytest.raises(ValueError, match="num_new_tokens"):
        kv.allocate(make_request("r", [1]), -1)
    assert kv.allocate(make_request("same", [1, 2]), 2) is not None
    with pytest.raises(ValueError, match="already holds KV pages"):
        kv.allocate(make_request("same", [3, 4]), 2)


# --- invariants under random workloads ---------------------------------------------------------


def snapshot(kv: PagedKVManager, requests: list[Request]) -> tuple[Any, ...]:
    return (
        list(kv._ref_counts),
        list(kv._page_digests),
        dict(kv._cached),
        list(kv._free),
        {r.request_id: list(kv.block_table(r)) for r in requests},
        kv.stats(),
        [(r.num_cached_tokens, r.num_computed_tokens) for r in requests],
    )


def chain_digest(prefix: tuple[int, ...], page_size: int) -> bytes:
    digest = ROOT_PAGE_DIGEST
    for start in range(0, len(prefix), page_size):
        digest = hash_page(digest, prefix[start : start + page_size])
    return digest


def check_invariants(
    kv: PagedKVManager, live: list[Request], content: dict[int, tuple[int, ...]]
) -> None:
    num_pages, page_size = kv.pool.num_pages, kv.pool.page_size
    holders = [0] * num_pages
    for request in live:
        for page in kv.block_table(request):
            holders[page] += 1
    assert kv._ref_counts == holders
    held = {page for page in range(num_pages) if holders[page]}
    assert not held & set(kv._free)
    assert kv.num_free_pages() + len(held) == num_pages
    for digest, page in kv._cached.items():
        assert kv._page_digests[page] == digest
        assert len(content[page]) % page_size == 0
        assert chain_digest(content[page], page_size) == digest
    assert sum(d is not None for d in kv._page_digests) == len(kv._cached)


OPS = st.lists(
    st.tuples(st.sampled_from(["admit", "step", "step", "finish", "preempt"]), st.integers(0, 99)),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(page_size=st.sampled_from([1, 2, 4]), num_pages=st.integers(3, 10), ops=OPS)
def test_invariants_hold_under_random_workloads(
    page_size: int, num_pages: int, ops: list[tuple[str, int]]
) -> None:
    kv = new_kv(num_pages, page_size)
    prefixes = [tokens(1, 3 * page_size), tokens(2, 2 * page_size)]
    live: list[Request] = []
    waiting: list[Request] = []
    content: dict[int, tuple[int, ...]] = {}
    for index, (op, value) in enumerate(ops):
        if op == "admit" or not live:
            if waiting and value % 2:
                request = waiting.pop()
            else:
                prompt = prefixes[value % 2][: value % (3 * page_size + 1)] + tokens(10 + index, 1)
                request = make_request(f"r{index}", prompt)
            num_new = 1 + value % request.num_tokens
        else:
            request = live[value % len(live)]
            if op in ("finish", "preempt"):
                request.status = RequestStatus.FINISHED_ABORTED
                if op == "preempt":
                    request.status = RequestStatus.PREEMPTED
                    waiting.append(request)
                kv.free(request)
                live.remove(request)
                request.num_computed_tokens = 0
                check_invariants(kv, live, content)
                continue
            num_new = 1 + value % (request.num_tokens - request.num_computed_tokens)
        before = snapshot(kv, [*live, request])
        allocation = kv.allocate(request, num_new)
        if allocation is None:
            assert snapshot(kv, [*live, request]) == before
            if request not in live and request not in waiting:
                waiting.append(request)
            continue
        if request not in live:
            live.append(request)
        request.num_computed_tokens += allocation.num_cached_tokens
        start = request.num_computed_tokens
        end = min(start + num_new, request.num_tokens)
        table, all_tokens = kv.block_table(request), request.all_token_ids
        for page_index in range(start // page_size, -(-end // page_size)):
            content[table[page_index]] = tuple(all_tokens[: min((page_index + 1) * page_size, end)])
        request.num_computed_tokens = end
        kv.commit(request)
        if end == request.num_tokens:
            request.output_token_ids.append(value % 3)
        check_invariants(kv, live, content)
