"""KVManager: hands out KV pages to requests and keeps the prefix cache."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any

from brigade.interfaces.attention import PageSizeRule
from brigade.interfaces.request import Request

__all__ = ["Allocation", "KVManager", "KVPoolParams", "KVStats"]


@dataclasses.dataclass(frozen=True, slots=True)
class KVPoolParams:
    """The pool a KV manager manages (decided by core from ``[kv]`` and the executor)."""

    num_pages: int
    page_size: int
    enable_prefix_caching: bool = True


@dataclasses.dataclass(frozen=True, slots=True)
class Allocation:
    """Result of a successful :meth:`KVManager.allocate`."""

    num_cached_tokens: int
    """Prefix tokens found in the cache at admission (0 when growing a running request)."""
    new_page_ids: tuple[int, ...]
    """Pages newly reserved by this call."""


@dataclasses.dataclass(frozen=True, slots=True)
class KVStats:
    num_pages: int
    num_free_pages: int
    prefix_cache_queries: int
    """Tokens looked up at admission (``request.num_tokens``, output included when a request
    is re-admitted after preemption); refused admissions are not counted."""
    prefix_cache_hits: int
    """Of those, tokens found (the sum of ``Allocation.num_cached_tokens``)."""


class KVManager(abc.ABC):
    """Pages of ``page_size`` tokens, block tables per request, and prefix reuse.

    Constructed as ``factory(pool: KVPoolParams, options)``; page ids are ``0 ..
    pool.num_pages - 1``.

    Ownership: during a step the scheduler is the only caller of :meth:`allocate` (admission,
    growth, preemption) and frees the requests it preempts. Core calls :meth:`commit` after a
    step's tokens are accepted and :meth:`free` when a request finishes or is aborted, whether
    or not it holds pages. A ``request_id`` identifies one live request. A page is never
    reused while a request that holds it runs.
    """

    supports_partial_page_reuse = False
    """True when prefix hits may end mid-page (token-granular reuse)."""

    supports_draft_tokens = False
    """True when :meth:`allocate` reserves room for a running request's draft tokens (API
    2.4): its cap is then ``request.num_tokens + len(request.draft_token_ids)`` instead of
    ``request.num_tokens``. Speculative decoding needs it; ``config check`` refuses a
    ``[speculative]`` proposer next to a manager without it."""

    @classmethod
    def supported_page_sizes(cls, options: Any) -> PageSizeRule:
        """Page sizes this manager works with (``config check`` rejects others)."""
        return PageSizeRule()

    @abc.abstractmethod
    def allocate(self, request: Request, num_new_tokens: int) -> Allocation | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``; all or nothing.

        On a request's first call with ``num_computed_tokens == 0`` (it holds no pages: new,
        or preempted by recompute) the manager first matches ``request.all_token_ids``
        against the prefix cache and locks the hit; on success it sets
        ``request.num_cached_tokens``. A hit is capped at ``request.num_tokens - 1`` so at
        least one token is computed. A request that holds no pages but has computed tokens
        (swapped back in) is not matched and gets ``num_cached_tokens = 0``; neither is a
        request whose ``uses_prefix_cache`` is False (API 2.1: an embedding that pools every
        position; core fails such a request if it is matched). It then reserves
        pages so that the first ``min(num_computed_tokens + num_cached + num_new_tokens,
        request.num_tokens)`` tokens fit (``request.num_tokens + len(request.draft_token_ids)``
        with :attr:`supports_draft_tokens`; the pages of drafts that were rejected are kept and
        rewritten by the next step). The caller (the scheduler) adds
        ``Allocation.num_cached_tokens`` to ``request.num_computed_tokens``. None means no
        room: nothing observable changed (pages, locks, stats, request fields).
        """

    @abc.abstractmethod
    def commit(self, request: Request) -> None:
        """Publish the request's full pages up to ``num_computed_tokens`` to the prefix cache.

        Called by core after each step that advanced the request (a no-op when prefix
        caching is off).
        """

    @abc.abstractmethod
    def free(self, request: Request) -> None:
        """Release the request's pages; cached ones stay reusable until evicted.

        Freeing a request that holds no pages is a no-op.
        """

    @abc.abstractmethod
    def block_table(self, request: Request) -> Sequence[int]:
        """The request's page ids in order.

        Empty for a request that holds no pages; may be a live view that callers must not
        mutate. While a request holds pages its table only grows: entries already handed out
        never change until :meth:`free` (core copies only the new tail each step).
        """

    def cached_prefix_len(self, request: Request) -> int:
        """Tokens of ``request`` a first :meth:`allocate` would find in the prefix cache now.

        A read-only peek for scheduling policies (e.g. longest prefix first): no page is
        locked, no statistic changes, and the answer may differ by the time the request is
        admitted. Same cap as :meth:`allocate` (at most ``request.num_tokens - 1``); 0 for
        a request whose ``uses_prefix_cache`` is False. Default:
        0 (a manager without a prefix cache; API 2.0).
        """
        return 0

    @abc.abstractmethod
    def num_free_pages(self) -> int:
        """Pages an allocation could use now (evictable cached pages count as free)."""

    @abc.abstractmethod
    def stats(self) -> KVStats:
        """Counters for metrics and benchmarks."""
