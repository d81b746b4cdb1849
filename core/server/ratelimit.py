"""Per-client rate limiting: requests and tokens per minute, as continuously refilled buckets.

Each key (an API key, or the client address when keys are off) owns two token buckets whose
capacity is the per-minute figure and which refill at that figure per 60 s, so a client may
burst up to a minute's allowance and then proceeds at the steady rate. A limit of 0 is off.

The buckets live in a store (``brigade.server.bucket_store``): this process's memory for one
front end, or a database every front end of one server shares, so that the limits hold for
the server as a whole however many front ends take its connections.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from brigade.server.bucket_store import IDLE_EVICTION_S, Buckets, BucketStore, MemoryBuckets

__all__ = ["IDLE_EVICTION_S", "OVERSIZED_RETRY_AFTER_S", "RateLimiter"]

OVERSIZED_RETRY_AFTER_S = 60.0
"""Retry-After for a request needing more tokens than a whole minute's allowance. Such a
request can never pass; the caller may prefer to answer it with a 400 before asking."""

_EPSILON = 1e-9
"""Slack for float rounding, so a client that waits exactly the advised time is admitted."""


class RateLimiter:
    """Admits or delays requests per key against requests- and tokens-per-minute limits.

    ``clock`` returns seconds on a monotonic scale (tests pass a fake one); ``store`` keeps
    the buckets (default: this process's memory). Limiters on one shared store share every
    key's budget.
    """

    def __init__(
        self,
        requests_per_minute: int,
        tokens_per_minute: int,
        clock: Callable[[], float] = time.monotonic,
        *,
        store: BucketStore | None = None,
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
        self.store: BucketStore = MemoryBuckets() if store is None else store

    @property
    def enabled(self) -> bool:
        """True when at least one limit is on."""
        return self.requests_per_minute > 0 or self.tokens_per_minute > 0

    @property
    def num_keys(self) -> int:
        """Keys currently tracked (those seen within :data:`IDLE_EVICTION_S`)."""
        return self.store.num_keys

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
        if self.tokens_per_minute and tokens > self.tokens_per_minute:
            return OVERSIZED_RETRY_AFTER_S
        now = self._clock()
        return self.store.update(key, now, lambda stored: self._charge(stored, now, tokens))

    def _charge(
        self, stored: Buckets | None, now: float, tokens: int
    ) -> tuple[Buckets, float | None]:
        """The buckets refilled up to ``now`` and charged when both hold enough; else the same
        buckets, refilled only, and the wait."""
        buckets = self._refilled(stored, now)
        wait = 0.0
        if self.requests_per_minute:
            missing = 1.0 - buckets.requests
            if missing > _EPSILON:
                wait = missing / self._requests_per_s
        if self.tokens_per_minute:
            missing = tokens - buckets.tokens
            if missing > _EPSILON:
                wait = max(wait, missing / self._tokens_per_s)
        if wait > 0.0:
            return buckets, wait
        buckets.requests = max(buckets.requests - 1.0, 0.0)
        buckets.tokens = max(buckets.tokens - tokens, 0.0)
        return buckets, None

    def _refilled(self, stored: Buckets | None, now: float) -> Buckets:
        if stored is None:  # a new key starts with a full minute's allowance
            return Buckets(self.requests_per_minute, self.tokens_per_minute, now)
        elapsed = max(now - stored.updated_at, 0.0)
        return Buckets(
            min(stored.requests + elapsed * self._requests_per_s, self.requests_per_minute),
            min(stored.tokens + elapsed * self._tokens_per_s, self.tokens_per_minute),
            now,
        )
