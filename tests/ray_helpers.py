"""A two-node Ray cluster on 127.0.0.1 for the Ray backend's tests, and the check that a run
left no actor or placement group on it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import ray
from ray.cluster_utils import Cluster

NODE_MEMORY = {"object_store_memory": 80 * 1024 * 1024}


@contextlib.contextmanager
def two_node_cluster(num_cpus: int = 1, num_gpus: int = 0) -> Iterator[str]:
    """Yield the address of a head and a worker node of ``num_cpus`` CPUs each, both on
    loopback; ``RAY_ADDRESS`` names it meanwhile (for this process and the ones it starts).
    ``num_gpus`` GPUs per node are declared to Ray only (it hands them out, and sets an
    actor's ``CUDA_VISIBLE_DEVICES``, without looking for real ones)."""
    saved = {
        key: os.environ.get(key) for key in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    }
    # Every Ray process on loopback (Ray's single-machine mode), as the test machines require.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    node = {"num_cpus": num_cpus, "num_gpus": num_gpus, **NODE_MEMORY}
    cluster = Cluster(initialize_head=True, head_node_args=node)
    cluster.add_node(**node)
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


def assert_nothing_left(address: str) -> None:
    """No live actor and no placement group that is not removed, on the cluster at ``address``."""
    ray.init(address=address)
    try:
        alive = [a for a in ray._private.state.actors().values() if a["State"] != "DEAD"]
        groups = ray.util.placement_group_table()
        assert alive == [], f"actors left behind: {alive}"
        assert all(g["state"] == "REMOVED" for g in groups.values()), groups
    finally:
        ray.shutdown()
