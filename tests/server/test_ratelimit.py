"""Per-key rate limiting on a fake clock: bursts, refill, token limits, eviction; in one
process's memory and in the store that several front ends share."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from brigade.server.bucket_store import SharedBuckets
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


@pytest.fixture
def shared_path(tmp_path: Path) -> Path:
    """A fresh shared bucket database, as the supervisor makes it for its front ends."""
    path = tmp_path / "buckets.sqlite"
    SharedBuckets.create(path)
    return path


def test_two_limiters_on_one_shared_store_share_each_keys_budget(
    clock: FakeClock, shared_path: Path
) -> None:
    """Two front ends' limiters: the key's minute allowance is spent once, whichever asks."""
    first = RateLimiter(4, 0, clock=clock, store=SharedBuckets(shared_path))
    second = RateLimiter(4, 0, clock=clock, store=SharedBuckets(shared_path))
    answers = [limiter.acquire("key", 1) for limiter in (first, second, first, second, first)]
    assert answers[:4] == [None] * 4
    assert answers[4] == pytest.approx(15.0)  # 4 per minute: one every 15 s
    assert second.acquire("key", 1) == pytest.approx(15.0)
    clock.advance(15.0)  # the refill is seen by both
    assert second.acquire("key", 1) is None
    assert first.acquire("key", 1) == pytest.approx(15.0)
    assert first.acquire("other", 1) is None  # keys stay independent


def test_shared_tokens_per_minute_and_retry_after(clock: FakeClock, shared_path: Path) -> None:
    first = RateLimiter(0, 1200, clock=clock, store=SharedBuckets(shared_path))
    second = RateLimiter(0, 1200, clock=clock, store=SharedBuckets(shared_path))
    assert first.acquire("key", 1000) is None
    assert second.acquire("key", 500) == pytest.approx(15.0)  # 300 missing at 20 tokens/s
    assert second.acquire("key", 200) is None
    assert first.acquire("key", 1201) == OVERSIZED_RETRY_AFTER_S


def test_concurrent_charges_on_a_shared_store_never_admit_more_than_the_limit(
    shared_path: Path,
) -> None:
    """Front ends charging one key at the same moment: each charge is one transaction, so
    the admitted total is the limit, not a multiple of it (no refill: a fixed clock)."""
    limit, attempts, threads = 50, 60, 4
    admitted: list[int] = []

    def charge() -> None:
        limiter = RateLimiter(limit, 0, clock=lambda: 1000.0, store=SharedBuckets(shared_path))
        admitted.append(sum(limiter.acquire("key", 1) is None for _ in range(attempts)))

    workers = [threading.Thread(target=charge) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert sum(admitted) == limit
    assert len(admitted) == threads


def test_idle_keys_are_evicted_from_a_shared_store(clock: FakeClock, shared_path: Path) -> None:
    first = RateLimiter(1, 0, clock=clock, store=SharedBuckets(shared_path))
    second = RateLimiter(1, 0, clock=clock, store=SharedBuckets(shared_path))
    for index in range(100):
        (first if index % 2 else second).acquire(f"client-{index}", 1)
    clock.advance(IDLE_EVICTION_S / 2)
    first.acquire("client-0", 1)  # keeps client-0 alive
    clock.advance(IDLE_EVICTION_S / 2 + 1.0)
    second.acquire("newcomer", 1)
    assert first.num_keys == second.num_keys == 2  # client-0 and the newcomer
    assert first.acquire("client-0", 1) is None  # refilled while idle, as before eviction


def test_a_shared_store_must_have_been_created(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no shared rate-limit database"):
        SharedBuckets(tmp_path / "missing.sqlite")
