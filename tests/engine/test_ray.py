"""The Ray backend on a two-node Ray cluster (both nodes on 127.0.0.1): data-parallel replicas
one per node and a tensor-parallel rank as actors; greedy answers equal one engine's, and no
actor or placement group is left behind."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from brigade import LLM, SamplingParams
from brigade.offline_replicas import generate_on_replicas
from tests.engine_helpers import assert_same_greedy, make_llm, prompts, run
from tests.server_harness import tiny_model

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
PROMPTS = ["one", "two three", "four five six", "seven"]
NODE_MEMORY = {"object_store_memory": 80 * 1024 * 1024}


@pytest.fixture(scope="module")
def cluster_address() -> Iterator[str]:
    saved = {
        key: os.environ.get(key) for key in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    }
    # Every Ray process on loopback (Ray's single-machine mode), as the test machines require.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, **NODE_MEMORY})
    cluster.add_node(num_cpus=1, **NODE_MEMORY)
    os.environ["RAY_ADDRESS"] = cluster.address
    try:
        yield cluster.address
    finally:
        cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


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
    assert all(r.error is None for r in results), [r.error for r in results]
    assert len({r.node for r in results}) == 2, "both replicas ran on one node"
    answers = {
        i: o.outputs[0].token_ids
        for r in results
        for i, o in zip(r.indices, r.outputs or [], strict=True)
    }
    reference = LLM(overrides=settings).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [answers[i] for i in range(len(PROMPTS))] == [o.outputs[0].token_ids for o in reference]
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


def assert_nothing_left(address: str) -> None:
    ray.init(address=address)
    try:
        alive = [a for a in ray._private.state.actors().values() if a["State"] != "DEAD"]
        groups = ray.util.placement_group_table()
        assert alive == [], f"actors left behind: {alive}"
        assert all(g["state"] == "REMOVED" for g in groups.values()), groups
    finally:
        ray.shutdown()
