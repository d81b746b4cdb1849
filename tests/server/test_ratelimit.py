"""Per-key rate limiting on a fake clock: bursts, refill, token limits, eviction."""

from __future__ import annotations

import pytest

from brigade.server.ratelimit import IDLE_EVICTION_S, OVERSIZED_RETRY_AFTER_S, RateLimiter


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_burst_up_to_capacity_then_wait_matches_the_refill_rate(clock: FakeClock) -> None:
    limiter = RateLimiter(requests_per_minute=6, tokens_per_minute=0, clock=clock)
    assert [limiter.acquire("key", 100) for _ in range(6)] == [None] * 6
    wait = limiter.acquire("key", 100)
    assert wait == pytest.approx(10.0)  # 6 per minute: one every 10 s
    clock.advance(4.0)
    assert limiter.acquire("key", 100) == pytest.approx(6.0)  # a refused try charges nothing
    clock.advance(6.0)
    assert limiter.acquire("key", 100) is None
    assert limiter.acquire("key", 100) == pytest.approx(10.0)


def test_refill_never_exceeds_capacity(clock: FakeClock) -> None:
    limiter = RateLimiter(requests_per_minute=2, tokens_per_minute=0, clock=clock)
    limiter.acquire("key", 1)
    clock.advance(3600.0)
    assert [limiter.acquire("key", 1) for _ in range(3)] == [None, None, pytest.approx(30.0)]


def test_tokens_per_minute_limit(clock: FakeClock) -> None:
    limiter = RateLimiter(requests_per_minute=0, tokens_per_minute=1200, clock=clock)
    assert limiter.acquire("key", 1000) is None
    # 200 tokens left; 500 needs 300 more at 20 tokens/s.
    assert limiter.acquire("key", 500) == pytest.approx(15.0)
    assert limiter.acquire("key", 200) is None
    clock.advance(15.0)
    assert limiter.acquire("key", 300) is None


def test_the_longer_of_both_waits_is_returned(clock: FakeClock) -> None:
    limiter = RateLimiter(requests_per_minute=60, tokens_per_minute=600, clock=clock)
    assert limiter.acquire("key", 600) is None
    # The request bucket refills in 1 s; 100 tokens take 10 s.
    assert limiter.acquire("key", 100) == pytest.approx(10.0)


def test_a_request_larger_than_a_minute_of_tokens_is_told_to_wait_a_minute(
    clock: FakeClock,
) -> None:
    limiter = RateLimiter(requests_per_minute=10, tokens_per_minute=100, clock=clock)
    assert limiter.acquire("key", 101) == OVERSIZED_RETRY_AFTER_S
    assert limiter.acquire("key", 100) is None  # the refusal charged nothing


def test_keys_are_independent(clock: FakeClock) -> None:
    limiter = RateLimiter(requests_per_minute=1, tokens_per_minute=0, clock=clock)
    assert limiter.acquire("alice", 1) is None
    assert limiter.acquire("alice", 1) is not None
    assert limiter.acquire("bob", 1) is None


def test_disabled_limits_never_block(clock: FakeClock) -> None:
    limiter = RateLimiter(requests_per_minute=0, tokens_per_minute=0, clock=clock)
    assert not limiter.enabled
    assert all(limiter.acquire("key", 10**9) is None for _ in range(1000))
    assert limiter.num_keys == 0


def test_idle_keys_are_evicted(clock: FakeClock) -> None:
    limiter = RateLimiter(requests_per_minute=1, tokens_per_minute=0, clock=clock)
    for index in range(100):
        limiter.acquire(f"client-{index}", 1)
    clock.advance(IDLE_EVICTION_S / 2)
    limiter.acquire("client-0", 1)  # keeps client-0 alive
    clock.advance(IDLE_EVICTION_S / 2 + 1.0)
    limiter.acquire("newcomer", 1)
    assert limiter.num_keys == 2  # client-0 and the newcomer
    assert limiter.acquire("client-0", 1) is None  # refilled while idle, as before eviction


def test_invalid_arguments_are_refused(clock: FakeClock) -> None:
    with pytest.raises(ValueError, match="rate limits must be >= 0"):
        RateLimiter(requests_per_minute=-1, tokens_per_minute=0)
    limiter = RateLimiter(requests_per_minute=1, tokens_per_minute=1, clock=clock)
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        limiter.acquire("key", -1)
