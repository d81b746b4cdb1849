"""The GPUs of data-parallel replicas (``[router] data_parallel_size = N``).

On one machine (``[executor] distributed_executor_backend = "mp"``) replica ``r`` of an engine
on CUDA takes the devices from ``cuda:(first + r * tp)`` on, ``first`` being the configured
device's index (0 for ``cuda`` and ``auto``) and ``tp`` its ``tensor_parallel_size``: with
``-dp 2 -tp 2`` replica 0 runs on GPUs 0-1 and replica 1 on GPUs 2-3, as vLLM lays out its
data-parallel ranks. On Ray each replica's actor gets one GPU from its bundle (its
tensor-parallel ranks ask Ray for their own), which the actor sees as ``cuda:0``. Engines on
the CPU are left as they are.
"""

from __future__ import annotations

from typing import Any

import torch

from brigade.interfaces import ConfigError

__all__ = [
    "executor_device",
    "local_replica_overrides",
    "ray_replica_gpus",
    "ray_replica_overrides",
    "tensor_parallel_size",
]


def executor_device(config: Any) -> str | None:
    """The executor's ``device`` option (None: it has none, e.g. the simulated executor)."""
    device = getattr(config["executor"].options, "device", None)
    return None if device is None else str(device)


def tensor_parallel_size(config: Any) -> int:
    """The executor's ``tensor_parallel_size`` option (1 for an executor without it)."""
    return int(getattr(config["executor"].options, "tensor_parallel_size", 1))


def local_replica_overrides(config: Any, replica: int, num_replicas: int) -> list[str]:
    """The config overrides that put ``replica`` of ``num_replicas`` local replicas on its
    own GPUs (none on the CPU); ``ConfigError`` when this machine has too few of them."""
    device = executor_device(config)
    if device is None or device == "cpu" or num_replicas == 1:
        return []
    if device == "auto" and not torch.cuda.is_available():
        return []
    first = 0 if device == "auto" else (torch.device(device).index or 0)
    per_replica = tensor_parallel_size(config)
    needed = first + num_replicas * per_replica
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible < needed:
        raise ConfigError(
            f"[router] data_parallel_size = {num_replicas} replicas of {per_replica} GPU(s) "
            f"each from cuda:{first} need {needed} CUDA devices here, and {visible} are "
            "visible; use fewer replicas, or device 'cpu'"
        )
    return [f"executor.device=cuda:{first + replica * per_replica}"]


def ray_replica_gpus(config: Any, num_replicas: int, cluster_gpus: float) -> int:
    """GPUs each of ``num_replicas`` replicas' Ray bundles asks for: 1 for an engine on CUDA
    (``cuda``, ``cuda:N``, or ``auto`` on a cluster with a GPU for every rank of every replica,
    ``cluster_gpus`` being what Ray counts), else 0."""
    device = executor_device(config)
    if device is None or device == "cpu":
        return 0
    if device == "auto":
        return 1 if cluster_gpus >= num_replicas * tensor_parallel_size(config) else 0
    return 1


def ray_replica_overrides(config: Any) -> list[str]:
    """Overrides for a replica in its Ray actor: its one GPU is ``cuda:0`` there, whatever
    index the config names (Ray sets ``CUDA_VISIBLE_DEVICES`` for the actor)."""
    device = executor_device(config)
    return ["executor.device=cuda:0"] if device is not None and device.startswith("cuda:") else []
