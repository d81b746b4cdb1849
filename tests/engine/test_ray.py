"""The Ray backend on a two-node Ray cluster (both nodes on 127.0.0.1): data-parallel replicas
one per node and a tensor-parallel rank as actors; greedy answers equal one engine's, and no
actor or placement group is left behind."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from brigade import SamplingParams
from brigade.offline_replicas import generate_on_replicas
from tests.engine_helpers import (
    assert_replicas_answer_as_one_engine,
    assert_same_greedy,
    make_llm,
    prompts,
    run,
)
from tests.ray_helpers import assert_nothing_left, two_node_cluster
from tests.server_harness import tiny_model

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
PROMPTS = ["one", "two three", "four five six", "seven"]


@pytest.fixture(scope="module")
def cluster_address() -> Iterator[str]:
    with two_node_cluster(num_cpus=2) as address:  # Ray's CPUs: slots, not cores
        yield address


def test_replicas_run_as_actors_one_per_node_and_leave_nothing_behind(
    cluster_address: str, tmp_path: Path
) -> None:
    model_dir = tiny_model(tmp_path)
    settings = [f"model.path={model_dir}", "kv.page_size=8", "kv.num_pages=128"]
    results = generate_on_replicas(
        None,
        [
            *settings,
            "router.data_parallel_size=2",
            "router.plugin=round-robin",
            "executor.distributed_executor_backend=ray",
        ],
        PROMPTS,
        GREEDY,
    )
    assert_replicas_answer_as_one_engine(results, settings, PROMPTS, GREEDY)
    assert len({r.node for r in results}) == 2, "both replicas ran on one node"
    assert_nothing_left(cluster_address)


def test_a_tensor_parallel_rank_runs_as_an_actor_and_leaves_nothing_behind(
    cluster_address: str, tmp_path: Path
) -> None:
    model_dir = tiny_model(tmp_path)
    llm = make_llm(
        model_dir, "executor.tensor_parallel_size=2", "executor.distributed_executor_backend=ray"
    )
    try:
        token_prompts = prompts([5, 17, 30])
        ours = run(llm, token_prompts)
        local_ranks = [p for p in multiprocessing.active_children() if "tp-rank" in p.name]
        assert local_ranks == [], "rank 1 ran as a local process, not as a Ray actor"
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        assert_same_greedy(ours, run(make_llm(model_dir), token_prompts), "tp=2 on ray vs tp=1")
    finally:
        llm.engine.executor.shutdown()
    assert not ray.is_initialized(), "the launcher left its Ray connection open"
    assert_nothing_left(cluster_address)


def rank_actors(address: str) -> int:
    """Tensor-parallel rank actors the cluster has seen, dead or alive."""
    ray.init(address=address)
    try:
        return sum(
            a["ActorClassName"] == "_RankActor" for a in ray._private.state.actors().values()
        )
    finally:
        ray.shutdown()


def test_replicas_with_tensor_parallel_ranks_all_run_as_actors(
    cluster_address: str, tmp_path: Path
) -> None:
    """-dp 2 -tp 2: each replica's actor starts its rank 1 as an actor of its own."""
    model_dir = tiny_model(tmp_path)
    settings = [f"model.path={model_dir}", "kv.page_size=8", "kv.num_pages=128"]
    ranks_before = rank_actors(cluster_address)
    results = generate_on_replicas(
        None,
        [
            *settings,
            "router.data_parallel_size=2",
            "router.plugin=round-robin",
            "executor.tensor_parallel_size=2",
            "executor.distributed_executor_backend=ray",
        ],
        PROMPTS,
        GREEDY,
    )
    assert_replicas_answer_as_one_engine(results, settings, PROMPTS, GREEDY)
    assert rank_actors(cluster_address) == ranks_before + 2, "a rank 1 was not a Ray actor"
    assert_nothing_left(cluster_address)
