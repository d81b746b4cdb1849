"""Per-client rate limiting: requests and tokens per minute, as continuously refilled buckets.

Each key (an API key, or the client address when keys are off) owns two token buckets whose
capacity is the per-minute figure and which refill at that figure per 60 s, so a client may
burst up to a minute's allowance and then proceeds at the steady rate. A limit of 0 is off.

Not thread-safe: the server calls it from its one event loop, between awaits.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["IDLE_EVICTION_S", "OVERSIZED_RETRY_AFTER_S", "RateLimiter"]

IDLE_EVICTION_S = 600.0
"""A key unused for this long is forgotten. Any bucket idle for 60 s is full again, so
forgetting it after 10 minutes changes no decision; it only bounds memory."""

OVERSIZED_RETRY_AFTER_S = 60.0
"""Retry-After for a request needing more tokens than a whole minute's allowance. Such a
request can never pass; the caller may prefer to answer it with a 400 before asking."""

_EPSILON = 1e-9
"""Slack for float rounding, so a client that waits exactly the advised time is admitted."""


class _Buckets:
    """The two buckets of one key and the time they were last refilled."""

    __slots__ = ("requests", "tokens", "updated_at")

    def __init__(self, requests: float, tokens: float, now: float) -> None:
        self.requests = requests
        self.tokens = tokens
        self.updated_at = now


class RateLimiter:
    """Admits or delays requests per key against requests- and tokens-per-minute limits.

    ``clock`` returns seconds on a monotonic scale (tests pass a fake one).
    """

    def __init__(
        self,
        requests_per_minute: int,
        tokens_per_minute: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if requests_per_minute < 0 or tokens_per_minute < 0:
            raise ValueError(
                "rate limits must be >= 0 (0 turns a limit off); got "
                f"requests_per_minute={requests_per_minute}, "
                f"tokens_per_minute={tokens_per_minute}"
            )
        self.requests_per_minute = requests_per_minute
        self.tokens_per_minute = tokens_per_minute
        self._requests_per_s = requests_per_minute / 60.0
        self._tokens_per_s = tokens_per_minute / 60.0
        self._clock = clock
        # Least recently used first, so idle keys are evicted from the front.
        self._buckets: OrderedDict[str, _Buckets] = OrderedDict()

    @property
    def enabled(self) -> bool:
        """True when at least one limit is on."""
        return self.requests_per_minute > 0 or self.tokens_per_minute > 0

    @property
    def num_keys(self) -> int:
        """Keys currently tracked (those seen within :data:`IDLE_EVICTION_S`)."""
        return len(self._buckets)

    def acquire(self, key: str, tokens: int) -> float | None:
        """Take one request and ``tokens`` tokens from ``key``'s allowance.

        Returns None when the request is admitted (and charged), otherwise the seconds until the
        same request would be admitted, charging nothing; the caller sends ``ceil`` of it as
        ``Retry-After`` with a 429. A request needing more tokens than ``tokens_per_minute`` can
        never be admitted and gets :data:`OVERSIZED_RETRY_AFTER_S`.
        """
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        if not self.enabled:
            return None
        now = self._clock()
        self._evict_idle(now)
        buckets = self._refilled(key, now)
        wait = 0.0
        if self.requests_per_minute:
            missing = 1.0 - buckets.requests
            if missing > _EPSILON:
                wait = missing / self._requests_per_s
        if self.tokens_per_minute:
            if tokens > self.tokens_per_minute:
                return OVERSIZED_RETRY_AFTER_S
            missing = tokens - buckets.tokens
            if missing > _EPSILON:
                wait = max(wait, missing / self._tokens_per_s)
        if wait > 0.0:
            return wait
        buckets.requests = max(buckets.requests - 1.0, 0.0)
        buckets.tokens = max(buckets.tokens - tokens, 0.0)
        return None

    def _refilled(self, key: str, now: float) -> _Buckets:
        buckets = self._buckets.get(key)
        if buckets is None:
            buckets = _Buckets(self.requests_per_minute, self.tokens_per_minute, now)
            self._buckets[key] = buckets
            return buckets
        self._buckets.move_to_end(key)
        elapsed = max(now - buckets.updated_at, 0.0)
        buckets.requests = min(
            buckets.requests + elapsed * self._requests_per_s, self.requests_per_minute
        )
        buckets.tokens = min(buckets.tokens + elapsed * self._tokens_per_s, self.tokens_per_minute)
        buckets.updated_at = now
        return buckets

    def _evict_idle(self, now: float) -> None:
        # The dict is ordered by last use, so stale keys sit at the front: each call pops only
        # what it evicts, which makes eviction O(1) amortised and memory bounded by the keys seen
        # in the last IDLE_EVICTION_S.
        while self._buckets:
            key, buckets = next(iter(self._buckets.items()))
            if now - buckets.updated_at <= IDLE_EVICTION_S:
                return
            del self._buckets[key]
