"""Round-robin, least-loaded and cache-aware routing.

``cache-aware`` places a request on the replica most likely to hold its prompt's first pages,
bounded by load, as SGLang's router does: it remembers, per replica, the page-aligned prompt
prefixes it routed there (the paged KV manager's chain digest per full page, least recently used
dropped beyond the replica's page count), so it needs nothing from the replicas but their load.
When the loads drift apart by more than ``balance_abs_threshold`` requests and
``balance_rel_threshold`` times, or no replica holds at least ``cache_threshold`` of the prompt,
it picks the least loaded replica instead.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from brigade.interfaces import ReplicaLoad, Router, RouterParams, option
from brigade.plugins.kv import ROOT_PAGE_DIGEST, hash_page

__all__ = [
    "CacheAwareOptions",
    "CacheAwareRouter",
    "LeastLoadedRouter",
    "RoundRobinRouter",
    "RouterNoOptions",
]


@dataclasses.dataclass(frozen=True)
class RouterNoOptions:
    """This router takes no options."""


class RoundRobinRouter(Router):
    """Replica 0, 1, ..., N - 1, 0, ... in arrival order, whatever their load (skipping
    replicas out of rotation)."""

    def __init__(self, params: RouterParams, options: RouterNoOptions) -> None:
        self.num_replicas = params.num_replicas
        self._next = 0

    def route(
        self, request_id: str, prompt_token_ids: Sequence[int], replicas: Sequence[ReplicaLoad]
    ) -> int:
        # The first replica in rotation at or after the turn's index, wrapping around.
        index = min(replicas, key=lambda r: (r.index - self._next) % self.num_replicas).index
        self._next = (index + 1) % self.num_replicas
        return index


def least_loaded(replicas: Sequence[ReplicaLoad]) -> int:
    """The replica holding the fewest requests (ties: less KV in use, then the lowest index)."""
    return min(replicas, key=lambda r: (r.load, r.kv_usage, r.index)).index


class LeastLoadedRouter(Router):
    """The replica holding the fewest requests, running and waiting."""

    def __init__(self, params: RouterParams, options: RouterNoOptions) -> None:
        self.num_replicas = params.num_replicas

    def route(
        self, request_id: str, prompt_token_ids: Sequence[int], replicas: Sequence[ReplicaLoad]
    ) -> int:
        return least_loaded(replicas)


@dataclasses.dataclass(frozen=True)
class CacheAwareOptions:
    cache_threshold: float = option(
        0.5,
        help="share of a prompt a replica must be remembered to hold for the request to go "
        "there; below it on every replica, the least loaded replica takes it",
        ge=0,
        le=1,
    )
    balance_abs_threshold: int = option(
        32, help="loads may differ by this many requests before balance wins over affinity", ge=0
    )
    balance_rel_threshold: float = option(
        1.5,
        help="... and the most loaded replica must hold this many times the least loaded's",
        ge=1,
    )
    max_pages_per_replica: int = option(
        0,
        help="prefix pages remembered per replica (least recently routed dropped first); "
        "0 = the replica's KV page count, else 65536",
        ge=0,
    )


class CacheAwareRouter(Router):
    """Prefix affinity bounded by load (see the module docstring)."""

    def __init__(self, params: RouterParams, options: CacheAwareOptions) -> None:
        self.params = params
        self.options = options
        self.capacity = options.max_pages_per_replica or params.num_pages or 65536
        self._pages: list[collections.OrderedDict[bytes, None]] = [
            collections.OrderedDict() for _ in range(params.num_replicas)
        ]

    def route(
        self, request_id: str, prompt_token_ids: Sequence[int], replicas: Sequence[ReplicaLoad]
    ) -> int:
        digests = self._digests(prompt_token_ids)
        index = self._choose(digests, len(prompt_token_ids), replicas)
        self._remember(index, digests)
        return index

    def matched_tokens(self, replica: int, prompt_token_ids: Sequence[int]) -> int:
        """Tokens of the prompt's head this router remembers ``replica`` holding."""
        return self._matched_pages(replica, self._digests(prompt_token_ids)) * self.params.page_size

    def _choose(self, digests: list[bytes], length: int, replicas: Sequence[ReplicaLoad]) -> int:
        options = self.options
        loads = [r.load for r in replicas]
        lightest, heaviest = min(loads), max(loads)
        if (
            heaviest - lightest > options.balance_abs_threshold
            and heaviest > options.balance_rel_threshold * lightest
        ):
            return least_loaded(replicas)
        matched = {r.index: self._matched_pages(r.index, digests) for r in replicas}
        best = max(replicas, key=lambda r: (matched[r.index], -r.load, -r.index))
        tokens = matched[best.index] * self.params.page_size
        if tokens and tokens >= options.cache_threshold * length:
            return best.index
        return least_loaded(replicas)

    def _digests(self, tokens: Sequence[int]) -> list[bytes]:
        """The paged KV manager's chain digest per full page of ``tokens``."""
        page = self.params.page_size
        digests: list[bytes] = []
        parent = ROOT_PAGE_DIGEST
        for start in range(0, len(tokens) - page + 1, page):
            parent = hash_page(parent, tokens[start : start + page])
            digests.append(parent)
        return digests

    def _matched_pages(self, replica: int, digests: list[bytes]) -> int:
        pages = self._pages[replica]
        count = 0
        for digest in digests:
            if digest not in pages:
                break
            count += 1
        return count

    def _remember(self, replica: int, digests: list[bytes]) -> None:
        pages = self._pages[replica]
        for digest in digests:
            pages[digest] = None
            pages.move_to_end(digest)
        while len(pages) > self.capacity:
            pages.popitem(last=False)
