"""KVManager: hands out KV pages to requests and keeps the prefix cache."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence

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
    """Prompt tokens looked up in the prefix cache."""
    prefix_cache_hits: int
    """Of those, tokens found."""


class KVManager(abc.ABC):
    """Pages of ``page_size`` tokens, block tables per request, and prefix reuse.

    Ownership: during a step the scheduler is the only caller of :meth:`allocate` (admission,
    growth, preemption). Core calls :meth:`commit` after a step's tokens are accepted and
    :meth:`free` when a request finishes, is aborted or is preempted by recompute. A page is
    never reused while a request that holds it runs.
    """

    supports_partial_page_reuse = False
    """True when prefix hits may end mid-page (token-granular reuse)."""

    @abc.abstractmethod
    def allocate(self, request: Request, num_new_tokens: int) -> Allocation | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        On a request's first call this matches the cached prefix (a hit is capped at
        ``num_prompt_tokens - 1`` so one token is always computed), locks it and sets
        ``request.num_cached_tokens``. All of it happens in one call or not at all: None means
        no room and nothing changed.
        """

    @abc.abstractmethod
    def commit(self, request: Request) -> None:
        """Publish the request's newly computed full pages to the prefix cache."""

    @abc.abstractmethod
    def free(self, request: Request) -> None:
        """Release the request's pages; cached ones stay reusable until evicted."""

    @abc.abstractmethod
    def block_table(self, request: Request) -> Sequence[int]:
        """The request's page ids in order."""

    @abc.abstractmethod
    def num_free_pages(self) -> int:
        """Pages an allocation could use now (evictable cached pages count as free)."""

    @abc.abstractmethod
    def stats(self) -> KVStats:
        """Counters for metrics and benchmarks."""
