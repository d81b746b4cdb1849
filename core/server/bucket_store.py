"""Where the rate limiter keeps each client's buckets: in this process, or shared by every
front end of one server.

With one front end (``[server] api_server_count = 1``, or the engine on a thread) the buckets
are a dict in that process (:class:`MemoryBuckets`). With several, each front end takes the
connections the kernel hands it from the one listening socket, so a client's requests land
on any of them; per-process buckets would let a client through N times its limit. They then
share :class:`SharedBuckets`, an SQLite database in the supervisor's private run directory:
each charge reads, decides and writes one key's row inside one ``BEGIN IMMEDIATE``
transaction, so two front ends charging one key at once are serialised and the budget holds
across all of them. Buckets refill on ``time.monotonic``'s clock, which every process of one
machine shares.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

__all__ = [
    "IDLE_EVICTION_S",
    "LOCK_TIMEOUT_S",
    "BucketStore",
    "Buckets",
    "Charge",
    "MemoryBuckets",
    "SharedBuckets",
]

IDLE_EVICTION_S = 600.0
"""A key unused for this long is forgotten. Any bucket idle for 60 s is full again, so
forgetting it after 10 minutes changes no decision; it only bounds memory."""

LOCK_TIMEOUT_S = 1.0
"""How long a front end waits for another's charge to finish (each holds the database for
one short transaction): past it, the wait is an error rather than a stalled event loop."""


@dataclasses.dataclass(slots=True)
class Buckets:
    """One key's two buckets and the time they were last refilled."""

    requests: float
    tokens: float
    updated_at: float
    """On ``time.monotonic``'s clock."""


Charge = Callable[[Buckets | None], tuple[Buckets, float | None]]
"""What a store runs for one key: given its buckets (None: a key not seen, or forgotten), the
buckets to keep and the limiter's answer."""


class BucketStore(Protocol):
    """The rate limiter's memory of every key's buckets."""

    def update(self, key: str, now: float, charge: Charge) -> float | None:
        """Run ``charge`` on ``key``'s buckets, keep the buckets it returns and return its
        answer, as one step that no other user of the store interleaves with; first forget
        the keys unused since ``now - IDLE_EVICTION_S``."""
        ...

    @property
    def num_keys(self) -> int:
        """Keys currently remembered."""
        ...


class MemoryBuckets:
    """Buckets in this process, for a server with one front end. Not thread-safe: the server
    charges from its one event loop, between awaits."""

    def __init__(self) -> None:
        # Least recently used first, so idle keys are evicted from the front.
        self._buckets: OrderedDict[str, Buckets] = OrderedDict()

    @property
    def num_keys(self) -> int:
        return len(self._buckets)

    def update(self, key: str, now: float, charge: Charge) -> float | None:
        self._evict_idle(now)
        stored = self._buckets.get(key)
        if stored is not None:
            self._buckets.move_to_end(key)
        buckets, answer = charge(stored)
        self._buckets[key] = buckets
        return answer

    def _evict_idle(self, now: float) -> None:
        # The dict is ordered by last use, so stale keys sit at the front: each call pops only
        # what it evicts, which makes eviction O(1) amortised and memory bounded by the keys seen
        # in the last IDLE_EVICTION_S.
        while self._buckets:
            key, buckets = next(iter(self._buckets.items()))
            if now - buckets.updated_at <= IDLE_EVICTION_S:
                return
            del self._buckets[key]


class SharedBuckets:
    """Buckets in the SQLite database at ``path``, which every front end of one server opens
    (:meth:`create` makes it, once, before they start). Eviction deletes through an index on
    the last use, so each charge's work is bounded by the rows it reads and the stale ones it
    removes, and the table by the keys seen in the last :data:`IDLE_EVICTION_S`.

    The database is scratch state in a private temporary directory: it is written without
    waiting for the disk (a machine that crashes loses the server with it), and its
    write-ahead log keeps it whole when a front end is killed mid-transaction (the lock dies
    with the process). Not thread-safe: each front end charges from its one event loop.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"no shared rate-limit database at {self.path}")
        self._db = _connect(self.path)

    @classmethod
    def create(cls, path: str | Path) -> None:
        """Make the database at ``path`` (its folder must exist) and its table."""
        db = _connect(Path(path))
        try:
            db.execute("PRAGMA journal_mode = WAL")
            db.execute(
                "CREATE TABLE IF NOT EXISTS buckets (key TEXT PRIMARY KEY, "
                "requests REAL NOT NULL, tokens REAL NOT NULL, updated_at REAL NOT NULL)"
            )
            db.execute("CREATE INDEX IF NOT EXISTS buckets_by_use ON buckets (updated_at)")
        finally:
            db.close()

    @property
    def num_keys(self) -> int:
        (count,) = self._db.execute("SELECT COUNT(*) FROM buckets").fetchone()
        return int(count)

    def update(self, key: str, now: float, charge: Charge) -> float | None:
        db = self._db
        db.execute("BEGIN IMMEDIATE")  # the write lock first: no other charge in between
        try:
            db.execute("DELETE FROM buckets WHERE updated_at < ?", (now - IDLE_EVICTION_S,))
            row = db.execute(
                "SELECT requests, tokens, updated_at FROM buckets WHERE key = ?", (key,)
            ).fetchone()
            buckets, answer = charge(None if row is None else Buckets(*row))
            db.execute(
                "INSERT OR REPLACE INTO buckets (key, requests, tokens, updated_at) "
                "VALUES (?, ?, ?, ?)",
                (key, buckets.requests, buckets.tokens, buckets.updated_at),
            )
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        return answer

    def close(self) -> None:
        self._db.close()


def _connect(path: Path) -> sqlite3.Connection:
    # Autocommit mode (isolation_level None): transactions are the explicit BEGIN/COMMIT above.
    db = sqlite3.connect(path, timeout=LOCK_TIMEOUT_S, isolation_level=None)
    db.execute("PRAGMA synchronous = OFF")
    return db
