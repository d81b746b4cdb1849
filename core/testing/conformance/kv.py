"""Conformance of KV managers: page accounting, all-or-nothing allocation, prefix reuse, eviction.

The checks play the scheduler's and core's part the way the contract describes it: after a
successful ``allocate`` they add ``num_cached_tokens`` to ``num_computed_tokens``, compute the
reserved tokens, advance ``num_computed_tokens`` and call ``commit``.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable, Sequence
from typing import Any

from brigade.interfaces import (
    Allocation,
    KVManager,
    KVPoolParams,
    PoolingParams,
    Request,
    RequestStatus,
)
from brigade.testing.requests import make_request

__all__ = ["check_kv_manager"]

KVFactory = Callable[[KVPoolParams, Any], KVManager]


def check_kv_manager(
    factory: KVFactory,
    options: Any,
    *,
    page_sizes: Sequence[int] | None = None,
    lru_eviction: bool = True,
    num_random_steps: int = 400,
    seed: int = 0,
) -> None:
    """Check a KV manager built as ``factory(KVPoolParams(...), options)`` against the contract.

    Covers page accounting and growth across page boundaries, all-or-nothing allocation, prefix
    reuse (capped at ``num_tokens - 1``, shared page ids, stats), divergence and hash-chain
    misses, eviction under pressure, caching switched off, and a randomized workload checking
    that no page serves two live requests unless it holds their identical computed prefix.
    Pass ``lru_eviction=False`` for a manager that evicts in another order than least recently
    freed. ``page_sizes`` defaults to those of 1, 4 and 16 the manager's
    ``supported_page_sizes`` allows. Raises ``AssertionError`` naming the first violation.
    """
    if page_sizes is None:
        rule_of = getattr(factory, "supported_page_sizes", None)
        page_sizes = [p for p in (1, 4, 16) if rule_of is None or rule_of(options).allows(p)]
    assert page_sizes, "none of the page sizes 1, 4, 16 is allowed by the manager"
    for page_size in page_sizes:
        suite = _Suite(factory, options, page_size)
        checks: list[tuple[str, Callable[[], None]]] = [
            ("fresh pool", suite.check_fresh_pool),
            ("admission and growth", suite.check_admission_and_growth),
            ("allocation without room", suite.check_no_room_changes_nothing),
            ("prefix reuse", suite.check_prefix_reuse),
            ("requests that use no prefix cache", suite.check_uncached_requests),
            ("divergent prompts", suite.check_divergence),
            ("eviction", functools.partial(suite.check_eviction, lru_eviction)),
            ("caching off", suite.check_caching_off),
        ]
        for caching in (True, False):
            workload = functools.partial(_run_workload, suite, caching, seed, num_random_steps)
            checks.append((f"random workload, caching={caching}", workload))
        for what, check in checks:
            try:
                check()
            except AssertionError:
                raise
            except Exception as exc:
                # A crash is a violation too: say which check, as an AssertionError.
                raise AssertionError(f"{suite.label}: {what}: raised {exc!r}") from exc


def _run_workload(suite: _Suite, caching: bool, seed: int, num_steps: int) -> None:
    _RandomWorkload(suite, caching, random.Random(seed)).run(num_steps)


def _tokens(tag: int, num_tokens: int) -> list[int]:
    """Token ids that no other tag's tokens share, so prompts only match where meant to."""
    return [tag * 10_000 + i for i in range(num_tokens)]


def _num_pages(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def _snapshot(kv: KVManager, requests: Sequence[Request]) -> tuple[Any, ...]:
    tables = [
        (r.request_id, tuple(kv.block_table(r)), r.num_cached_tokens, r.num_computed_tokens)
        for r in requests
    ]
    return kv.num_free_pages(), kv.stats(), tables


@dataclasses.dataclass
class _Suite:
    factory: KVFactory
    options: Any
    page_size: int
    label: str = ""
    partial: bool = False
    """The manager under test may find hits that end mid-page."""

    def new(self, num_pages: int, caching: bool = True) -> KVManager:
        kv = self.factory(KVPoolParams(num_pages, self.page_size, caching), self.options)
        self.label = f"{type(kv).__name__} (page_size={self.page_size}, caching={caching})"
        self.partial = kv.supports_partial_page_reuse
        return kv

    def prefill(self, kv: KVManager, request: Request) -> Allocation:
        """Admit ``request`` and compute all its tokens in one chunk, then commit."""
        allocation = kv.allocate(request, request.num_tokens - request.num_computed_tokens)
        assert allocation is not None, f"{self.label}: no room for {request.request_id}"
        request.num_computed_tokens = request.num_tokens
        kv.commit(request)
        return allocation

    def check_hit(self, request: Request, hit: int, matching: int, what: str) -> None:
        """``hit`` tokens were found where ``matching`` leading tokens are cached."""
        ps, cap = self.page_size, request.num_tokens - 1
        whole_pages = min(matching // ps, cap // ps) * ps
        label = f"{self.label}: {what}: {request.request_id} found {hit} cached tokens"
        if self.partial:
            assert whole_pages <= hit <= min(matching, cap), f"{label}, expected {whole_pages}+"
        else:
            assert hit == whole_pages, f"{label}, expected {whole_pages}"
        assert request.num_cached_tokens == hit, f"{label} but num_cached_tokens disagrees"

    def probe(self, kv: KVManager, prompt: list[int], matching: int, what: str) -> None:
        """Admit a request with ``prompt``, check its hit against ``matching``, free it."""
        probe = make_request("probe", prompt)
        before = _snapshot(kv, [probe])
        peeked = kv.cached_prefix_len(probe)
        assert _snapshot(kv, [probe]) == before, (
            f"{self.label}: cached_prefix_len changed the pool, the stats or the request ({what})"
        )
        allocation = kv.allocate(probe, probe.num_tokens)
        assert allocation is not None, f"{self.label}: no room for a probe of {what}"
        self.check_hit(probe, allocation.num_cached_tokens, matching, what)
        if type(kv).cached_prefix_len is KVManager.cached_prefix_len:
            assert peeked == 0, f"{self.label}: the default cached_prefix_len is 0"
        else:
            assert peeked == allocation.num_cached_tokens, (
                f"{self.label}: {what}: cached_prefix_len said {peeked} tokens, admission "
                f"found {allocation.num_cached_tokens}"
            )
        kv.free(probe)

    def check_fresh_pool(self) -> None:
        kv = self.new(8)
        stats = kv.stats()
        assert kv.num_free_pages() == stats.num_free_pages == stats.num_pages == 8, (
            f"{self.label}: a fresh pool of 8 pages reports {stats}"
        )
        assert stats.prefix_cache_queries == stats.prefix_cache_hits == 0, f"{self.label}: {stats}"
        stranger = make_request("stranger", [1, 2, 3])
        kv.free(stranger)
        assert kv.num_free_pages() == 8, f"{self.label}: freeing a pageless request changed it"
        assert not kv.block_table(stranger), f"{self.label}: a pageless request has a block table"

    def check_admission_and_growth(self) -> None:
        ps, kv = self.page_size, self.new(16)
        first = make_request("first", _tokens(1, 2 * ps + 1))
        admitted = self.prefill(kv, first)
        table = list(kv.block_table(first))
        label = f"{self.label}: {2 * ps + 1} tokens got block table {table}, new {admitted}"
        assert len(table) == 3, label
        assert list(admitted.new_page_ids) == table, label
        second = make_request("second", _tokens(2, ps))
        self.prefill(kv, second)
        pages = table + list(kv.block_table(second))
        label = f"{self.label}: live requests' pages overlap or leave the pool: {pages}"
        assert len(set(pages)) == len(pages) == 4, label
        assert all(0 <= p < 16 for p in pages), label
        assert kv.num_free_pages() == 12, f"{self.label}: 4 of 16 pages held, yet free is wrong"
        for step in range(2 * ps + 1):  # decode one token at a time across page boundaries
            first.output_token_ids.append(step)
            before = list(kv.block_table(first))
            grown = kv.allocate(first, 1)
            assert grown is not None, f"{self.label}: no room to grow by one token"
            assert grown.num_cached_tokens == 0, f"{self.label}: growth reported a hit: {grown}"
            after = list(kv.block_table(first))
            label = f"{self.label}: at {first.num_tokens} tokens the table went {before} -> {after}"
            assert after == before + list(grown.new_page_ids), label
            assert len(after) == _num_pages(first.num_tokens, ps), label
            first.num_computed_tokens += 1
            kv.commit(first)
        assert not set(kv.block_table(first)) & set(kv.block_table(second)), self.label
        third = make_request("third", _tokens(3, ps))
        # Asking for more tokens than a request has reserves only what it has.
        assert kv.allocate(third, 10 * ps) is not None, f"{self.label}: no room for third"
        assert len(kv.block_table(third)) == 1, f"{self.label}: {ps} tokens in more than 1 page"
        kv.free(first)
        kv.free(first)
        assert not kv.block_table(first), f"{self.label}: a freed request keeps a block table"
        assert kv.num_free_pages() == 16 - 2, f"{self.label}: free did not return the pages"

    def check_no_room_changes_nothing(self) -> None:
        ps, kv = self.page_size, self.new(4)
        self.prefill(kv, holder := make_request("holder", _tokens(1, 3 * ps)))
        waiting = make_request("waiting", _tokens(2, 2 * ps))
        self.expect_no_room(kv, [holder], waiting, 2 * ps, "admission needing 2 of 1 free pages")
        self.prefill(kv, filler := make_request("filler", _tokens(3, ps)))
        holder.output_token_ids.append(0)
        self.expect_no_room(kv, [filler], holder, 1, "growth into a full pool")
        kv.free(filler)
        assert kv.allocate(holder, 1) is not None, f"{self.label}: growth failed with a free page"
        # Cached free pages revived by a hit are not room for the request's new tokens.
        kv, prefix = self.new(6), _tokens(5, 3 * ps)
        self.prefill(kv, owner := make_request("owner", prefix))
        kv.free(owner)
        self.prefill(kv, holder := make_request("holder", _tokens(6, 2 * ps)))
        long = make_request("long", prefix + _tokens(7, ps + 1))
        what = "a hit of 3 pages from the free queue plus 2 new pages, with 4 pages free"
        self.expect_no_room(kv, [holder], long, long.num_tokens, what)
        self.probe(kv, [*prefix, 7], 3 * ps, "3 hit pages + 1 new page after a refused hit")

    def expect_no_room(
        self, kv: KVManager, others: list[Request], request: Request, num_new: int, what: str
    ) -> None:
        before = _snapshot(kv, [*others, request])
        allocation = kv.allocate(request, num_new)
        assert allocation is None, f"{self.label}: {what} should not fit, got {allocation}"
        after = _snapshot(kv, [*others, request])
        assert after == before, f"{self.label}: refused {what} changed state {before} -> {after}"

    def check_prefix_reuse(self) -> None:
        ps, kv = self.page_size, self.new(16)
        prompt = _tokens(1, 3 * ps)
        owner, twin = make_request("owner", prompt), make_request("twin", prompt)
        longer = make_request("longer", [*prompt, 5])
        self.prefill(kv, owner)
        owner_table = list(kv.block_table(owner))
        queries, hits = owner.num_tokens, 0
        for request in (twin, longer):
            hit = self.prefill(kv, request).num_cached_tokens
            self.check_hit(request, hit, 3 * ps, "same prompt while the owner runs")
            table = list(kv.block_table(request))
            assert table[: hit // ps] == owner_table[: hit // ps], (
                f"{self.label}: a hit of {hit} tokens must reuse {owner_table}, got {table}"
            )
            assert not set(table[_num_pages(hit, ps) :]) & set(owner_table), (
                f"{self.label}: {request.request_id} will write into the owner's pages {table}"
            )
            queries, hits = queries + request.num_tokens, hits + hit
        for request in (owner, twin, longer):
            kv.free(request)
        again = make_request("again", [*prompt, 6])
        hit = self.prefill(kv, again).num_cached_tokens
        self.check_hit(again, hit, 3 * ps, "same prompt after every holder was freed")
        assert list(kv.block_table(again))[: hit // ps] == owner_table[: hit // ps], self.label
        stats = kv.stats()
        expected = (queries + again.num_tokens, hits + hit)
        assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == expected, (
            f"{self.label}: expected (queries, hits) == {expected}, stats say {stats}"
        )

    def check_uncached_requests(self) -> None:
        """A request whose ``uses_prefix_cache`` is False (mean-pooled embedding) is never
        matched, nor peeked at, but its pages serve later requests (API 2.1)."""
        ps, kv = self.page_size, self.new(16)
        prompt = _tokens(1, 3 * ps)
        self.prefill(kv, owner := make_request("owner", prompt))
        mean = PoolingParams(mode="mean")
        embedded = make_request("embedded", [*prompt, 5], pooling=mean)
        assert not embedded.uses_prefix_cache
        peeked = kv.cached_prefix_len(embedded)
        hit = self.prefill(kv, embedded).num_cached_tokens
        assert peeked == hit == embedded.num_cached_tokens == 0, (
            f"{self.label}: a request with uses_prefix_cache False found {hit} cached tokens "
            f"(cached_prefix_len said {peeked}); it must compute every token"
        )
        assert not set(kv.block_table(embedded)) & set(kv.block_table(owner)), (
            f"{self.label}: the uncached request shares the owner's pages"
        )
        kv.free(owner)
        kv.free(embedded)
        self.probe(kv, [*prompt, 6], 3 * ps, "the cached prefix, after an uncached request")

    def check_divergence(self) -> None:
        ps, kv = self.page_size, self.new(16)
        prompt = _tokens(1, 4 * ps)
        self.prefill(kv, owner := make_request("owner", prompt))
        kv.free(owner)
        for page in range(4):
            offset = ps - 1 if page % 2 else 0
            changed = list(prompt)
            changed[page * ps + offset] = 7  # page 0 changed: the later pages match only alone
            what = f"token {page * ps + offset} differs (page {page}; pages are chained)"
            self.probe(kv, [*changed, 8], page * ps + offset, what)

    def check_eviction(self, lru_eviction: bool) -> None:
        ps, kv = self.page_size, self.new(6)
        older, newer = _tokens(1, 3 * ps), _tokens(2, 3 * ps)
        for name, prompt in (("older", older), ("newer", newer), ("third", _tokens(3, 3 * ps))):
            self.prefill(kv, request := make_request(name, prompt))
            kv.free(request)
            assert kv.num_free_pages() == 6, f"{self.label}: cached free pages must count as free"
        if lru_eviction:
            self.probe(kv, [*newer, 1], 3 * ps, "the recently freed prefix after an eviction")
            self.probe(kv, [*older, 1], 0, "the least recently freed prefix after an eviction")
        self.prefill(kv, whole := make_request("whole", _tokens(4, 6 * ps)))
        assert kv.num_free_pages() == 0, f"{self.label}: a 6-page request in a 6-page pool"
        kv.free(whole)
        self.probe(kv, [*newer, 1], 0, "a prefix evicted by a pool-sized request")

    def check_caching_off(self) -> None:
        ps, kv = self.page_size, self.new(8, caching=False)
        prompt = _tokens(1, 2 * ps)
        self.prefill(kv, owner := make_request("owner", prompt))
        for name, tokens in (("twin", prompt), ("longer", [*prompt, 3])):
            hit = self.prefill(kv, request := make_request(name, tokens)).num_cached_tokens
            assert hit == request.num_cached_tokens == 0, f"{self.label}: a hit of {hit}"
            assert not set(kv.block_table(request)) & set(kv.block_table(owner)), self.label
            kv.free(request)
        assert kv.stats().prefix_cache_hits == 0, f"{self.label}: {kv.stats()}"


class _RandomWorkload:
    """Random admissions, chunks, decodes, preemptions and finishes against a model of pages."""

    def __init__(self, suite: _Suite, caching: bool, rng: random.Random) -> None:
        self.suite, self.rng, self.caching = suite, rng, caching
        self.kv = suite.new(12, caching)
        self.live: dict[str, Request] = {}
        self.reserved: dict[str, int] = {}
        self.waiting: list[Request] = []
        self.content: dict[int, tuple[int, ...]] = {}
        """What the modelled KV in each page was computed from: the prefix up to its end."""
        self.queries = self.hits = 0
        ps = suite.page_size
        self.prefixes = [_tokens(tag, 3 * ps) for tag in (1, 2, 3)]
        self.next_tag = 100

    def run(self, num_steps: int) -> None:
        for _ in range(num_steps):
            roll = self.rng.random()
            if roll < 0.3 or not self.live:
                self.admit()
            elif roll < 0.8:
                self.advance(self.rng.choice(list(self.live.values())))
            elif roll < 0.9:
                self.leave(
                    self.rng.choice(list(self.live.values())), RequestStatus.FINISHED_ABORTED
                )
            else:
                self.leave(self.rng.choice(list(self.live.values())), RequestStatus.PREEMPTED)
            self.check_invariants()

    def admit(self) -> None:
        rng, ps = self.rng, self.suite.page_size
        if self.waiting and rng.random() < 0.1:
            # Aborted while waiting: core frees it although it holds no pages.
            self.kv.free(self.waiting.pop(rng.randrange(len(self.waiting))))
            return
        if self.waiting and rng.random() < 0.6:
            request = self.waiting.pop(rng.randrange(len(self.waiting)))
        else:
            self.next_tag += 1
            prompt = rng.choice(self.prefixes)[: rng.randint(0, 3 * ps)]
            prompt += _tokens(self.next_tag, rng.randint(1, 2 * ps))
            request = make_request(f"r{self.next_tag}", prompt, max_tokens=rng.randint(1, 2 * ps))
        num_new = rng.randint(1, request.num_tokens)
        before = _snapshot(self.kv, [*self.live.values(), request])
        allocation = self.kv.allocate(request, num_new)
        if allocation is None:
            assert _snapshot(self.kv, [*self.live.values(), request]) == before, (
                f"{self.suite.label}: a refused admission changed state"
            )
            self.waiting.append(request)
            return
        hit = allocation.num_cached_tokens
        label = f"{self.suite.label}: admission found {hit} of {request.num_tokens} tokens"
        assert hit == request.num_cached_tokens, label
        assert 0 <= hit < request.num_tokens, label
        assert self.caching or hit == 0, f"{self.suite.label}: a hit with caching off"
        tokens, table = request.all_token_ids, list(self.kv.block_table(request))
        for index in range(hit // ps):
            assert self.content.get(table[index]) == tuple(tokens[: (index + 1) * ps]), (
                f"{self.suite.label}: page {table[index]} served as a hit holds other tokens"
            )
        self.queries, self.hits = self.queries + request.num_tokens, self.hits + hit
        request.num_computed_tokens += hit
        request.status = RequestStatus.RUNNING
        self.live[request.request_id] = request
        self.reserved[request.request_id] = min(hit + num_new, request.num_tokens)
        self.compute(request, allocation)

    def advance(self, request: Request) -> None:
        computed, num_tokens = request.num_computed_tokens, request.num_tokens
        num_new = self.rng.randint(1, num_tokens - computed)
        before = _snapshot(self.kv, list(self.live.values()))
        num_held = len(self.kv.block_table(request))
        allocation = self.kv.allocate(request, num_new)
        if allocation is None:
            assert _snapshot(self.kv, list(self.live.values())) == before, (
                f"{self.suite.label}: a refused growth changed state"
            )
            needed = _num_pages(min(computed + num_new, num_tokens), self.suite.page_size)
            assert needed - num_held > self.kv.num_free_pages(), (
                f"{self.suite.label}: growth refused with {self.kv.num_free_pages()} free pages"
            )
            self.leave(self.rng.choice(list(self.live.values())), RequestStatus.PREEMPTED)
            return
        assert allocation.num_cached_tokens == 0, f"{self.suite.label}: growth reported a hit"
        rid = request.request_id
        self.reserved[rid] = max(self.reserved[rid], min(computed + num_new, num_tokens))
        self.compute(request, allocation)

    def compute(self, request: Request, allocation: Allocation) -> None:
        """Write the reserved tokens' KV into the model, then advance and commit like core."""
        ps, table = self.suite.page_size, list(self.kv.block_table(request))
        new_pages = list(allocation.new_page_ids)
        assert table[len(table) - len(new_pages) :] == new_pages, (
            f"{self.suite.label}: new pages {new_pages} are not the end of {table}"
        )
        start, end = request.num_computed_tokens, self.reserved[request.request_id]
        tokens = request.all_token_ids
        for index in range(start // ps, _num_pages(end, ps)):
            holders = [r for r in self.live.values() if table[index] in self.kv.block_table(r)]
            assert holders == [request], (
                f"{self.suite.label}: page {table[index]} is written while shared by "
                f"{[r.request_id for r in holders]}"
            )
            self.content[table[index]] = tuple(tokens[: min((index + 1) * ps, end)])
        request.num_computed_tokens = end
        self.kv.commit(request)
        if end == request.num_tokens:
            if request.num_output_tokens >= request.sampling_params.max_tokens:
                self.leave(request, RequestStatus.FINISHED_LENGTH)
            else:
                request.output_token_ids.append(self.rng.randint(1, 3))

    def leave(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        del self.live[request.request_id], self.reserved[request.request_id]
        if status is RequestStatus.PREEMPTED:
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self.waiting.append(request)

    def check_invariants(self) -> None:
        ps, label, kv = self.suite.page_size, self.suite.label, self.kv
        holders: dict[int, list[tuple[Request, int]]] = {}
        for rid, request in self.live.items():
            table = list(kv.block_table(request))
            assert len(table) == _num_pages(self.reserved[rid], ps), (
                f"{label}: {rid} reserved {self.reserved[rid]} tokens but holds pages {table}"
            )
            assert len(set(table)) == len(table), f"{label}: {rid} holds {table}"
            assert all(0 <= p < 12 for p in table), f"{label}: {rid} holds {table}"
            for index, page in enumerate(table):
                holders.setdefault(page, []).append((request, index))
        for page, sharing in holders.items():
            if len(sharing) < 2:
                continue
            end = (sharing[0][1] + 1) * ps
            assert all(index == sharing[0][1] for _, index in sharing), (
                f"{label}: page {page} sits at different positions of several block tables"
            )
            prefixes = {tuple(r.all_token_ids[:end]) for r, _ in sharing}
            names = [r.request_id for r, _ in sharing]
            assert self.caching, f"{label}: page {page} is held by {names}"
            assert len(prefixes) == 1, (
                f"{label}: page {page} is held by {names}, whose prefixes up to it differ"
            )
            assert all(r.num_computed_tokens >= end for r, _ in sharing), (
                f"{label}: shared page {page} is not yet fully computed"
            )
        assert kv.num_free_pages() == 12 - len(holders), (
            f"{label}: {len(holders)} pages held, but {kv.num_free_pages()} of 12 free"
        )
        stats = kv.stats()
        assert stats.prefix_cache_hits == self.hits, f"{label}: hits {stats} vs {self.hits}"
        assert not self.caching or stats.prefix_cache_queries == self.queries, (
            f"{label}: queries {stats} vs {self.queries}"
        )
