"""The built-in routers, alone and placing requests on simulated data-parallel replicas."""

from __future__ import annotations

from pathlib import Path

import pytest
from simulated_helpers import LLAMA_3_70B, settings

from brigade.bench.simulate import run_simulation
from brigade.bench.workloads import Arrivals, Lengths, shared_prefix
from brigade.config import load_config
from brigade.engine import EngineCore
from brigade.errors import ConfigError
from brigade.interfaces import ReplicaLoad, RouterParams
from brigade.plugins.routers.builtin import (
    CacheAwareOptions,
    CacheAwareRouter,
    LeastLoadedRouter,
    RoundRobinRouter,
    RouterNoOptions,
)
from brigade.registry import default_registry

PARAMS = RouterParams(num_replicas=3, page_size=4, num_pages=100)


def loads(*values: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(index, value, 0, 0.0) for index, value in enumerate(values)]


def test_round_robin_cycles_whatever_the_load() -> None:
    router = RoundRobinRouter(PARAMS, RouterNoOptions())
    assert [router.route(str(i), [1, 2], loads(9, 0, 0)) for i in range(5)] == [0, 1, 2, 0, 1]


def test_least_loaded_counts_running_and_waiting() -> None:
    router = LeastLoadedRouter(PARAMS, RouterNoOptions())
    replicas = [ReplicaLoad(0, 2, 3, 0.1), ReplicaLoad(1, 4, 0, 0.9), ReplicaLoad(2, 4, 0, 0.2)]
    assert router.route("a", [1], replicas) == 2  # 4 each on 1 and 2; 2 uses less KV


def test_cache_aware_keeps_a_prefix_on_its_replica_until_the_loads_drift_apart() -> None:
    router = CacheAwareRouter(PARAMS, CacheAwareOptions(balance_abs_threshold=4))
    system_a, system_b = list(range(100, 116)), list(range(200, 216))  # 4 pages each
    first = router.route("a1", [*system_a, 1, 2], loads(0, 0, 0))
    assert router.matched_tokens(first, [*system_a, 7]) == 16
    # Same system prompt, another question: same replica although it is now the busiest.
    assert router.route("a2", [*system_a, 3, 4, 5], loads(1, 0, 0)) == first == 0
    # Another prefix has no affinity anywhere: the least loaded replica.
    assert router.route("b1", [*system_b, 9], loads(2, 0, 1)) == 1
    assert router.route("b2", [*system_b, 8], loads(2, 1, 1)) == 1
    # A prompt that shares less than half of itself with what a replica holds goes by load.
    assert router.route("c", system_a[:4] + list(range(300, 340)), loads(2, 2, 1)) == 2
    # Affinity yields when the loads drift apart (by > 4 requests and > 1.5x).
    assert router.route("a3", [*system_a, 6], loads(12, 2, 1)) == 2


def test_cache_aware_forgets_the_least_recently_routed_pages() -> None:
    router = CacheAwareRouter(PARAMS, CacheAwareOptions(max_pages_per_replica=4))
    old, new = list(range(100, 116)), list(range(200, 216))
    router.route("old", old, loads(0, 5, 5))
    router.route("new", new, loads(0, 5, 5))
    assert router.matched_tokens(0, new) == 16
    assert router.matched_tokens(0, old) == 0


def test_one_engine_is_one_replica() -> None:
    registry = default_registry()
    config = load_config(None, registry, overrides=["router.data_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"data_parallel_size = 2: one engine .* is one replica"):
        EngineCore(config, registry)


def test_cache_aware_routing_beats_round_robin_on_shared_prefixes(model_70b: Path) -> None:
    """8 system prompts over 4 replicas, each with a small KV pool: round-robin makes every
    replica hold every prefix; cache-aware keeps each prefix on one or two replicas."""
    workload = shared_prefix(
        num_groups=8,
        requests_per_group=24,
        prefix_len=1024,
        suffix_lens=Lengths("uniform", 64, 32),
        output_lens=Lengths("fixed", 32),
        arrivals=Arrivals("poisson", rate=40.0),
        vocab_size=LLAMA_3_70B["vocab_size"],
        seed=1,
    )
    common = ("router.data_parallel_size=4", "kv.num_pages=320", "kv.enable_prefix_caching=true")
    results = {
        plugin: run_simulation(settings(model_70b, *common, f"router.plugin={plugin}"), workload)
        for plugin in ("round-robin", "cache-aware")
    }
    for result in results.values():
        assert len(result.requests) == len(workload)
        assert not result.errors
    aware, spread = results["cache-aware"], results["round-robin"]
    assert aware.prefix_hit_rate > spread.prefix_hit_rate + 0.2  # measured 0.90 vs 0.48
    assert aware.mean_ttft_s() < 0.5 * spread.mean_ttft_s()  # 38 ms vs 1.0 s
    one = run_simulation(settings(model_70b, "kv.num_pages=320"), workload)
    assert results["round-robin"].duration_s < one.duration_s
