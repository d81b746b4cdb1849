"""Data-parallel replicas behind the router (``ReplicatedEngine``), on real engines: placement
by the router, the same answers as one engine, a dead replica out of rotation while the rest
serve, and the whole engine dead only when every replica is."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from brigade import SamplingParams
from brigade.engine import EngineCore, EngineStats, StepUpdate
from brigade.errors import EngineDeadError
from brigade.interfaces import ReplicaLoad, RouterParams
from brigade.plugins.routers.builtin import (
    CacheAwareOptions,
    CacheAwareRouter,
    RoundRobinRouter,
    RouterNoOptions,
)
from brigade.server.async_engine import AsyncEngine
from brigade.server.data_parallel import ReplicatedEngine, combined_stats
from brigade.server.errors import EngineUnavailableError
from brigade.speculative import SpeculativeStats
from tests.engine_helpers import make_llm, prompts
from tests.server_harness import tiny_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("dp"))


@pytest.fixture
def engines(model_dir: Path) -> Iterator[list[AsyncEngine]]:
    replicas = [AsyncEngine(make_llm(model_dir).engine, max_waiting_requests=64) for _ in range(2)]
    yield replicas
    for replica in replicas:
        replica.shutdown()


async def collect(engine: ReplicatedEngine, request_id: str, prompt: list[int]) -> list[int]:
    admission = engine.replicas[0].engine.admit(prompt, GREEDY)  # type: ignore[attr-defined]
    tokens: list[int] = []
    async for update in engine.generate(request_id, admission, GREEDY):
        tokens += update.new_token_ids
    return tokens


def served_by(replica: AsyncEngine) -> int:
    return replica.engine.stats().num_steps


def test_round_robin_spreads_requests_and_answers_as_one_engine(
    engines: list[AsyncEngine], model_dir: Path
) -> None:
    router = RoundRobinRouter(RouterParams(2, page_size=4), RouterNoOptions())
    replicated = ReplicatedEngine(engines, router)
    token_prompts = prompts([5, 9, 7, 12])

    async def main() -> list[list[int]]:
        return list(
            await asyncio.gather(
                *(collect(replicated, f"r{i}", p) for i, p in enumerate(token_prompts))
            )
        )

    answers = asyncio.run(main())
    reference = make_llm(model_dir).generate(token_prompts, GREEDY, use_tqdm=False)
    assert answers == [o.outputs[0].token_ids for o in reference]
    assert all(served_by(replica) > 0 for replica in engines), "a replica got no request"
    assert replicated.snapshot.num_steps == sum(served_by(r) for r in engines)


def test_cache_aware_routing_sends_a_shared_prefix_to_one_replica(
    engines: list[AsyncEngine],
) -> None:
    router = CacheAwareRouter(RouterParams(2, page_size=4, num_pages=256), CacheAwareOptions())
    replicated = ReplicatedEngine(engines, router)
    head = prompts([32], seed=1)[0]
    placed: list[int] = []
    route = router.route

    def spy(request_id: str, prompt: object, replicas: object) -> int:
        placed.append(route(request_id, prompt, replicas))  # type: ignore[arg-type]
        return placed[-1]

    router.route = spy  # type: ignore[method-assign]

    async def main() -> None:
        for i, tail in enumerate(prompts([3, 4, 5, 6], seed=2)):
            await collect(replicated, f"s{i}", head + tail)

    asyncio.run(main())
    assert len(set(placed)) == 1, f"one shared 32-token head went to replicas {placed}"
    hits = [replica.engine.kv.stats().prefix_cache_hits for replica in engines]
    assert max(hits) >= 3 * 32 - 8, f"prefix cache hits per replica: {hits}"


def test_a_dead_replica_leaves_rotation_and_the_last_death_kills_the_engine(
    engines: list[AsyncEngine],
) -> None:
    deaths: list[str] = []
    router = RoundRobinRouter(RouterParams(2, page_size=4), RouterNoOptions())
    replicated = ReplicatedEngine(engines, router, on_dead=deaths.append)

    def broken_step(self: EngineCore) -> list[StepUpdate]:
        raise EngineDeadError("the device fell off the bus")

    async def one(request_id: str) -> list[int] | BaseException:
        try:
            return await collect(replicated, request_id, prompts([6], seed=3)[0])
        except EngineDeadError as exc:
            return exc

    engines[1].engine.step = broken_step.__get__(engines[1].engine)  # type: ignore[method-assign]

    async def main() -> list[list[int] | BaseException]:
        first = await asyncio.gather(one("a"), one("b"))  # a -> 0, b -> 1 (which dies)
        later = [await one(f"after{i}") for i in range(3)]
        return [*first, *later]

    results = asyncio.run(main())
    assert isinstance(results[1], EngineDeadError), results[1]
    assert all(isinstance(r, list) and len(r) == 6 for i, r in enumerate(results) if i != 1)
    assert replicated.num_live == 1
    assert replicated.dead is None
    assert not deaths
    live, dead = engines[0].snapshot, engines[1].snapshot
    snapshot = replicated.snapshot
    assert (snapshot.num_pages, snapshot.num_running) == (live.num_pages, live.num_running)
    assert snapshot.num_steps == live.num_steps + dead.num_steps, "a running total went back"

    engines[0].engine.step = broken_step.__get__(engines[0].engine)  # type: ignore[method-assign]
    assert isinstance(asyncio.run(one("last")), EngineDeadError)
    deadline = time.monotonic() + 10  # on_dead runs on the dying replica's thread
    while replicated.dead is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert replicated.dead is not None
    assert deaths == [replicated.dead]
    with pytest.raises(EngineUnavailableError, match="every engine replica has failed"):
        replicated.check_capacity()


def test_a_router_that_picks_a_replica_out_of_rotation_is_an_error(
    engines: list[AsyncEngine],
) -> None:
    class Stubborn(RoundRobinRouter):
        def route(self, request_id: str, prompt: object, replicas: object) -> int:
            return 7

    replicated = ReplicatedEngine(
        engines, Stubborn(RouterParams(2, page_size=4), RouterNoOptions())
    )
    with pytest.raises(RuntimeError, match=r"chose replica 7, which is not one of .*\[0, 1\]"):
        asyncio.run(collect(replicated, "x", [5, 6, 7]))


def test_combined_stats_add_counters_and_weigh_queue_time_by_steps() -> None:
    a = EngineStats(10, 2, 1, 0, 100, 50, 20, 64, 0.2)
    b = EngineStats(30, 4, 0, 1, 10, 5, 40, 64, 0.6)
    total = combined_stats([a, b])
    assert (total.num_steps, total.num_running, total.num_waiting) == (40, 6, 1)
    assert (total.num_free_pages, total.num_pages, total.prefix_cache_hits) == (60, 128, 55)
    assert total.mean_queue_time_s == pytest.approx((0.2 * 10 + 0.6 * 30) / 40)
    assert total.speculative is None
    assert ReplicaLoad(0, 2, 1, 0.5).load == 3
    # Taken when the older part was: a front end's combined view is no newer than that.
    stamped = [dataclasses.replace(a, taken_at=5.0), dataclasses.replace(b, taken_at=3.0)]
    assert combined_stats(stamped).taken_at == 3.0


def test_combined_stats_add_speculation_position_by_position() -> None:
    a = EngineStats(10, 2, 1, 0, 100, 50, 20, 64, 0.2, SpeculativeStats(6, 3, 4, (3, 0), (4, 2)))
    b = EngineStats(30, 4, 0, 1, 10, 5, 40, 64, 0.6, SpeculativeStats(5, 4, 3, (3, 1), (3, 2)))
    assert combined_stats([a, b]).speculative == SpeculativeStats(11, 7, 7, (6, 1), (7, 4))


def test_a_replicas_new_snapshot_reaches_the_listener_combined(
    engines: list[AsyncEngine],
) -> None:
    """Front ends of one server publish the engine's gauges as snapshots arrive: a replica's
    new one is passed on as every replica's counters together."""
    replicated = ReplicatedEngine(
        engines, RoundRobinRouter(RouterParams(2, page_size=4), RouterNoOptions())
    )
    heard: list[EngineStats] = []
    replicated.on_snapshot = heard.append
    listener = engines[1].on_snapshot
    assert listener is not None  # the replicated engine listens to each replica
    listener(engines[1].snapshot)
    assert heard == [replicated.snapshot]
    assert heard[0].num_pages == sum(e.snapshot.num_pages for e in engines)
