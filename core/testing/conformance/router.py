"""Conformance of a router: it answers with a replica index, for any load, over many requests."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from brigade.interfaces import ReplicaLoad, Router, RouterParams

__all__ = ["check_router"]


def check_router(factory: Callable[..., Router], options: Any) -> None:
    """Build the router for 1 and for 3 replicas and route 300 requests (shared and distinct
    prompt heads, loads that grow and shrink; with 3, replica 1 is out of rotation for the
    last third, as after it died): every answer must be the index of a replica it was shown,
    and ``finished`` must accept every request routed. Raises AssertionError."""
    rng = random.Random(0)
    heads = [[rng.randrange(32000) for _ in range(48)] for _ in range(4)]
    for num_replicas in (1, 3):
        router = factory(RouterParams(num_replicas, page_size=16, num_pages=64), options)
        assert isinstance(router, Router), f"the factory built {type(router).__name__}"
        loads = [0] * num_replicas
        live: list[tuple[str, int]] = []
        for number in range(300):
            head = heads[number % len(heads)] if number % 3 else []
            prompt = head + [rng.randrange(32000) for _ in range(rng.randrange(1, 40))]
            in_rotation = [
                index
                for index in range(num_replicas)
                if not (num_replicas > 1 and index == 1 and number >= 200)
            ]
            replicas = [
                ReplicaLoad(index, loads[index], rng.randrange(3), min(1.0, loads[index] / 50))
                for index in in_rotation
            ]
            request_id = f"r{number}"
            chosen = router.route(request_id, prompt, replicas)
            assert isinstance(chosen, int), f"route returned {chosen!r}, not an int"
            assert chosen in in_rotation, (
                f"route returned {chosen}; the replicas in rotation were {in_rotation}"
            )
            loads[chosen] += 1
            live.append((request_id, chosen))
            if rng.random() < 0.4 and live:
                done_id, done_replica = live.pop(rng.randrange(len(live)))
                loads[done_replica] -= 1
                router.finished(done_id, done_replica)
        for request_id, replica in live:
            router.finished(request_id, replica)
