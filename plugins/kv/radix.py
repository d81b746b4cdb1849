"""KV manager ``radix``: a radix tree over token ids with lock references (as in SGLang).

Each edge holds a run of token ids and their KV pages, one page per token: the manager needs
``page_size = 1``, so a prefix hit may end at any token (``paged`` reuses whole pages only).
Admission matches the longest cached prefix, splitting the last edge when the match ends
inside it, and locks the path; ``commit`` inserts the computed tokens below it. A node's lock
count is the number of running requests whose path includes it, so a locked node's ancestors
are locked and an unlocked node is evictable once its descendants are. Eviction trims the
least recently used unlocked leaf from its tail (a heap by last use, lazy deletion); an
emptied leaf leaves the tree and its parent may become a leaf.

A request that computed tokens a running request had already inserted *borrows* that node: it
keeps its own identical pages private and its later tokens still go below the node. When the
last request reading a locked node's pages leaves, a borrower's copy takes their place, so a
locked node's pages are always in use and every unlocked page can be handed out. Work per call
is proportional to the tokens touched (plus heap operations), never to the tree or pool size.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Sequence
from typing import Any

from brigade.interfaces import (
    Allocation,
    KVManager,
    KVPoolParams,
    KVStats,
    PageSizeRule,
    Request,
)
from brigade.plugins.kv.common import running_state

__all__ = ["RadixKVManager", "RadixKVOptions"]

_HEAP_SLACK = 1024
"""Heap entries tolerated beyond two per page (a node has at least one) before a rebuild."""


@dataclasses.dataclass(frozen=True)
class RadixKVOptions:
    """Options of the ``radix`` KV manager (none yet: the pool comes from ``[kv]``)."""


@dataclasses.dataclass(slots=True, eq=False)
class _Node:
    """An edge of the tree and the node it ends at; the root has no tokens and is never locked."""

    parent: _Node | None
    """None for the root and for an evicted node."""
    start: int
    """Position of the edge's first token in every sequence through the node."""
    token_ids: list[int]
    page_ids: list[int]
    lock_count: int
    last_access: int
    children: dict[int, _Node] = dataclasses.field(default_factory=dict)
    """Keyed by the first token of the child's edge."""
    borrowers: dict[_RequestState, None] = dataclasses.field(default_factory=dict)
    """Path users that hold their own copy of these tokens' KV (an insertion-ordered set)."""


@dataclasses.dataclass(slots=True, eq=False)
class _RequestState:
    request: Request
    page_ids: list[int]
    node: _Node
    """The end of the request's locked path, which spells its first ``num_committed`` tokens;
    on nodes it does not borrow the path's pages are its ``page_ids[:num_committed]``."""
    num_committed: int


class RadixKVManager(KVManager):
    """Token-granular prefix cache: radix tree, lock references, LRU eviction of leaves.

    Needs ``[kv] page_size = 1``: with larger pages a hit ending inside a page would need a
    copy-on-write of that page, and copying KV is the executor's job, out of a manager's reach.
    """

    supports_partial_page_reuse = True
    supports_draft_tokens = True

    @classmethod
    def supported_page_sizes(cls, options: Any) -> PageSizeRule:
        """Single-token pages only (see the class docstring)."""
        return PageSizeRule(minimum=1, maximum=1)

    def __init__(self, pool: KVPoolParams, options: RadixKVOptions) -> None:
        if pool.page_size != 1:
            raise ValueError(
                f"the radix KV manager caches single tokens and needs [kv] page_size = 1, got "
                f'page_size = {pool.page_size}; use kv.plugin = "paged" for larger pages'
            )
        if pool.num_pages < 1:
            raise ValueError(f"the radix KV manager needs num_pages >= 1, got {pool.num_pages}")
        self.pool = pool
        self.options = options
        self._caching = pool.enable_prefix_caching
        self._root = _Node(None, 0, [], [], 0, 0)
        self._free: list[int] = list(range(pool.num_pages - 1, -1, -1))
        """Pages with no content; the end is handed out first."""
        self._num_evictable = 0
        """Pages of unlocked nodes: cached, and free for allocation."""
        self._heap: list[tuple[int, int, _Node]] = []
        """(last_access, tie-break, node) of unlocked leaves; stale entries are skipped."""
        self._tie_break = itertools.count()
        self._clock = 0
        self._running: dict[str, _RequestState] = {}
        self._num_queried_tokens = 0
        self._num_hit_tokens = 0

    def allocate(self, request: Request, num_new_tokens: int) -> Allocation | None:
        """Match and lock the cached prefix on first call, then reserve pages; all or nothing."""
        state = running_state(self._running, request, num_new_tokens)
        if state is None:
            return self._admit(request, num_new_tokens)
        num_tokens = min(
            request.num_computed_tokens + num_new_tokens,
            request.num_tokens + len(request.draft_token_ids),
        )
        num_new_pages = num_tokens - len(state.page_ids)
        if num_new_pages <= 0:
            return Allocation(num_cached_tokens=0, new_page_ids=())
        if num_new_pages > self.num_free_pages():
            return None
        new_page_ids = self._take_pages(num_new_pages)
        state.page_ids.extend(new_page_ids)
        return Allocation(num_cached_tokens=0, new_page_ids=tuple(new_page_ids))

    def commit(self, request: Request) -> None:
        """Insert the computed tokens below the request's path, splitting edges as needed.

        Where an unlocked node already holds the same tokens, its pages go back to the free
        list and the request's take their place; where a locked one does, the request borrows
        it and its own copies stay private.
        """
        state = self._running.get(request.request_id)
        if not self._caching or state is None:
            return
        start = state.num_committed
        end = min(request.num_computed_tokens, len(state.page_ids))
        if end <= start:
            return
        token_ids = _token_slice(request, start, end)
        node, offset, now = state.node, 0, self._tick()
        while offset < len(token_ids):
            position = start + offset
            child = node.children.get(token_ids[offset])
            if child is None:
                pages = state.page_ids[position:end]
                if node.lock_count == 1 and not node.children and node is not self._root:
                    # Only this request uses the leaf: grow it rather than chain a node per step.
                    node.token_ids.extend(token_ids[offset:])
                    node.page_ids.extend(pages)
                    node.last_access = now
                else:
                    child = _Node(node, position, token_ids[offset:], pages, 1, now)
                    node.children[token_ids[offset]] = node = child
                break
            matched = _common_prefix_length(child.token_ids, token_ids, offset)
            if matched < len(child.token_ids):
                child = self._split(child, matched)
            if child.lock_count:
                child.borrowers[state] = None  # running requests read its pages
            else:
                self._free.extend(child.page_ids)
                self._num_evictable -= matched
                child.page_ids = state.page_ids[position : position + matched]
            child.lock_count += 1
            child.last_access = now
            node, offset = child, offset + matched
        state.node, state.num_committed = node, end

    def free(self, request: Request) -> None:
        """Unlock the request's path (its pages stay cached) and free its private pages."""
        state = self._running.pop(request.request_id, None)
        if state is None:
            return
        node, now = state.node, self._tick()
        while (parent := node.parent) is not None:  # up to the root, which is never locked
            node.lock_count -= 1
            node.last_access = now
            end = node.start + len(node.page_ids)
            if state in node.borrowers:
                del node.borrowers[state]
                self._free.extend(state.page_ids[node.start : end])
            elif node.lock_count and node.lock_count == len(node.borrowers):
                # No one reads the node's pages any more: an identical copy takes their place.
                heir = next(iter(node.borrowers))
                del node.borrowers[heir]
                self._free.extend(node.page_ids)
                node.page_ids = heir.page_ids[node.start : end]
            if not node.lock_count:
                self._num_evictable += len(node.page_ids)
                if not node.children:
                    self._push_leaf(node)
            node = parent
        self._free.extend(state.page_ids[state.num_committed :])

    def block_table(self, request: Request) -> Sequence[int]:
        """The request's page ids in order (a live view: do not mutate); empty if it holds none."""
        state = self._running.get(request.request_id)
        return state.page_ids if state is not None else ()

    def cached_prefix_len(self, request: Request) -> int:
        """The longest cached prefix of the request's tokens (a walk down the tree)."""
        if not self._caching or request.num_computed_tokens or not request.uses_prefix_cache:
            return 0
        if request.request_id in self._running:
            return request.num_cached_tokens
        return sum(matched for _, matched in self._match(request))

    def num_free_pages(self) -> int:
        """Pages with no content plus pages of unlocked (evictable) nodes, in O(1)."""
        return len(self._free) + self._num_evictable

    def stats(self) -> KVStats:
        """Pool occupancy and the prefix cache's token counters."""
        return KVStats(
            num_pages=self.pool.num_pages,
            num_free_pages=self.num_free_pages(),
            prefix_cache_queries=self._num_queried_tokens,
            prefix_cache_hits=self._num_hit_tokens,
        )

    def _admit(self, request: Request, num_new_tokens: int) -> Allocation | None:
        # A request that holds no pages but has computed tokens is being swapped back in: its
        # KV comes from elsewhere, so nothing is matched (or counted as a lookup).
        lookup = self._caching and request.num_computed_tokens == 0 and request.uses_prefix_cache
        path = self._match(request) if lookup else []
        num_cached_tokens = sum(matched for _, matched in path)
        num_tokens = min(
            request.num_computed_tokens + num_cached_tokens + num_new_tokens, request.num_tokens
        )
        num_new_pages = num_tokens - num_cached_tokens
        # Unlocked hit tokens stop being evictable once locked: they are not room for new ones.
        num_revived = sum(matched for node, matched in path if not node.lock_count)
        if num_new_pages > self.num_free_pages() - num_revived:
            return None
        hit_pages = [page for hit, matched in path for page in hit.page_ids[:matched]]
        node = self._root
        if path:
            node, matched = path[-1]
            if matched < len(node.token_ids):
                node = self._split(node, matched)
        self._lock_path(node)
        new_page_ids = self._take_pages(num_new_pages)
        self._running[request.request_id] = _RequestState(
            request, hit_pages + new_page_ids, node, num_cached_tokens
        )
        request.num_cached_tokens = num_cached_tokens
        if lookup:
            self._num_queried_tokens += request.num_tokens
            self._num_hit_tokens += num_cached_tokens
        return Allocation(num_cached_tokens=num_cached_tokens, new_page_ids=tuple(new_page_ids))

    def _match(self, request: Request) -> list[tuple[_Node, int]]:
        """The path spelling the longest cached prefix, capped so one token is left to compute,
        as (node, tokens matched in its edge) pairs; only the last may end inside its edge."""
        token_ids = request.all_token_ids[: request.num_tokens - 1]
        path: list[tuple[_Node, int]] = []
        node, offset = self._root, 0
        while offset < len(token_ids):
            child = node.children.get(token_ids[offset])
            if child is None:
                break
            matched = _common_prefix_length(child.token_ids, token_ids, offset)
            path.append((child, matched))
            offset += matched
            if matched < len(child.token_ids):
                break
            node = child
        return path

    def _split(self, node: _Node, length: int) -> _Node:
        """Cut ``node``'s edge after ``length`` tokens; returns the new upper node.

        The lower part keeps its identity, so a request state pointing at it stays valid.
        """
        parent = node.parent
        if parent is None:
            raise RuntimeError("radix KV manager: cannot split the root or an evicted node")
        tokens, pages = node.token_ids[:length], node.page_ids[:length]
        head = _Node(parent, node.start, tokens, pages, node.lock_count, node.last_access)
        head.borrowers = dict(node.borrowers)
        head.children[node.token_ids[length]] = node
        parent.children[head.token_ids[0]] = head
        del node.token_ids[:length], node.page_ids[:length]
        node.parent, node.start = head, node.start + length
        return head

    def _lock_path(self, node: _Node) -> None:
        now = self._tick()
        while (parent := node.parent) is not None:
            if not node.lock_count:
                self._num_evictable -= len(node.page_ids)
            node.lock_count += 1
            node.last_access = now
            node = parent

    def _take_pages(self, num_pages: int) -> list[int]:
        if num_pages > len(self._free):
            self._evict(num_pages - len(self._free))
        return [self._free.pop() for _ in range(num_pages)]

    def _evict(self, num_pages: int) -> None:
        """Move ``num_pages`` tree pages to the free list, least recently used leaves first."""
        while num_pages > 0:
            if not self._heap:
                raise RuntimeError("radix KV manager: no evictable leaf although pages count free")
            entry = self._heap[0]
            if not _is_current(entry):
                heapq.heappop(self._heap)
                continue
            leaf = entry[2]
            parent = leaf.parent
            if parent is None:  # _is_current says it is in the tree; this informs the type
                raise RuntimeError("radix KV manager: a current heap entry has left the tree")
            if len(leaf.page_ids) > num_pages:
                # Trim the tail: the leaf's prefix stays cached and keeps its heap entry.
                self._free.extend(leaf.page_ids[-num_pages:])
                del leaf.token_ids[-num_pages:], leaf.page_ids[-num_pages:]
                self._num_evictable -= num_pages
                return
            heapq.heappop(self._heap)
            self._free.extend(leaf.page_ids)
            self._num_evictable -= len(leaf.page_ids)
            num_pages -= len(leaf.page_ids)
            del parent.children[leaf.token_ids[0]]
            leaf.parent = None
            if parent is not self._root and not parent.lock_count and not parent.children:
                self._push_leaf(parent)

    def _push_leaf(self, node: _Node) -> None:
        heapq.heappush(self._heap, (node.last_access, next(self._tie_break), node))
        if len(self._heap) > 2 * self.pool.num_pages + _HEAP_SLACK:
            # Amortized O(1) per push: drop entries that can no longer be evicted.
            self._heap = [entry for entry in self._heap if _is_current(entry)]
            heapq.heapify(self._heap)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock


def _is_current(entry: tuple[int, int, _Node]) -> bool:
    """False once the node was evicted, locked, got children or was used since the push."""
    last_access, _, node = entry
    is_leaf = node.parent is not None and not node.children
    return is_leaf and not node.lock_count and node.last_access == last_access


def _common_prefix_length(edge: list[int], token_ids: list[int], offset: int) -> int:
    """How many leading tokens of ``edge`` equal ``token_ids[offset:]``."""
    limit = min(len(edge), len(token_ids) - offset)
    if edge[:limit] == token_ids[offset : offset + limit]:  # the common case, compared in C
        return limit
    length = 0
    while edge[length] == token_ids[offset + length]:
        length += 1
    return length


def _token_slice(request: Request, start: int, end: int) -> list[int]:
    """``request.all_token_ids[start:end]`` without concatenating prompt and output."""
    prompt, num_prompt = request.prompt_token_ids, request.num_prompt_tokens
    if end <= num_prompt:
        return prompt[start:end]
    output = request.output_token_ids
    if start >= num_prompt:
        return output[start - num_prompt : end - num_prompt]
    return prompt[start:] + output[: end - num_prompt]
