"""Data-parallel replicas on GPUs: on one machine replica r takes its own CUDA devices (from
r x its tensor-parallel size on), on Ray each replica's actor asks its bundle for a GPU; on the
CPU nothing changes. CUDA is simulated here (torch's device count patched, GPUs declared to Ray)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import ray
import torch

from brigade.config import load_config
from brigade.interfaces import ConfigError
from brigade.ray_actors import spread_actors
from brigade.registry import default_registry
from brigade.replica_devices import (
    local_replica_overrides,
    ray_replica_gpus,
    ray_replica_overrides,
)
from tests.ray_helpers import assert_nothing_left, two_node_cluster


def config(*overrides: str) -> Any:
    return load_config(None, default_registry(), overrides=list(overrides))


@pytest.fixture
def four_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)


def test_local_replicas_take_consecutive_gpus_after_their_tensor_parallel_ranks(
    four_gpus: None,
) -> None:
    two_by_two = config("executor.device=cuda", "executor.tensor_parallel_size=2")
    assert [local_replica_overrides(two_by_two, r, 2) for r in range(2)] == [
        ["executor.device=cuda:0"],
        ["executor.device=cuda:2"],
    ]
    auto = config()  # device auto, CUDA "available"
    assert [local_replica_overrides(auto, r, 4) for r in range(4)] == [
        [f"executor.device=cuda:{r}"] for r in range(4)
    ]
    from_one = config("executor.device=cuda:1")
    assert local_replica_overrides(from_one, 2, 3) == ["executor.device=cuda:3"]
    assert local_replica_overrides(two_by_two, 0, 1) == []  # one replica: as configured


def test_too_few_gpus_for_the_replicas_is_a_config_error(four_gpus: None) -> None:
    with pytest.raises(ConfigError, match="need 6 CUDA devices here, and 4 are visible"):
        local_replica_overrides(
            config("executor.device=cuda", "executor.tensor_parallel_size=2"), 0, 3
        )


def test_cpu_replicas_are_left_as_they_are() -> None:
    assert local_replica_overrides(config("executor.device=cpu"), 1, 2) == []
    if not torch.cuda.is_available():
        assert local_replica_overrides(config(), 1, 2) == []  # auto without CUDA: the CPU
    assert ray_replica_gpus(config("executor.device=cpu"), 2, cluster_gpus=8) == 0
    assert ray_replica_gpus(config(), 2, cluster_gpus=0) == 0  # auto on a CPU cluster
    assert ray_replica_gpus(config(), 2, cluster_gpus=1) == 0  # not one GPU for each
    assert ray_replica_gpus(config(), 2, cluster_gpus=2) == 1
    assert ray_replica_gpus(config("executor.device=cuda:3"), 2, cluster_gpus=0) == 1
    assert ray_replica_overrides(config("executor.device=cuda:3")) == ["executor.device=cuda:0"]
    assert ray_replica_overrides(config()) == []


class _Probe:
    def visible(self) -> tuple[str, list[Any], str]:
        return (
            ray.get_runtime_context().get_node_id(),
            ray.get_gpu_ids(),
            os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        )


def test_ray_replicas_get_a_gpu_each_from_their_bundles() -> None:
    with two_node_cluster(num_gpus=1) as address:
        cuda = config("executor.device=cuda")
        gpus = lambda cluster_gpus: ray_replica_gpus(cuda, 2, cluster_gpus)  # noqa: E731
        with spread_actors(_Probe, [1, 1], gpus=gpus) as actors:
            seen = ray.get([actor.visible.remote() for actor in actors])
        assert len({node for node, _, _ in seen}) == 2, seen
        assert all(len(ids) == 1 and visible == str(ids[0]) for _, ids, visible in seen), seen
        assert_nothing_left(address)
