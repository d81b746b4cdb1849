"""What this machine can hold, checked against a config before anything starts or is allocated.

Every front end, replica and tensor-parallel rank is a Python process of its own: a config that
asks for a thousand of them exhausts the memory before one serves. Process counts are held to
this machine's cores here, the memory the settings allocate to its memory in
``brigade.memory_limits``; ``check_config`` runs both before the model is built, and
:func:`check_machine` before a command starts any process.

A config is an ``EngineConfig`` typed ``Any``, as in ``brigade.replica_devices``:
``brigade.config`` calls these functions, and mypy, checking ``core/`` by path, would name
its class ``core.config.EngineConfig``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from brigade.errors import ConfigError
from brigade.ray_actors import replicas_on_ray
from brigade.replica_devices import executor_device, tensor_parallel_size

if TYPE_CHECKING:
    from brigade.registry import Registry

__all__ = [
    "FRONTENDS_PER_CORE",
    "MachineMemory",
    "check_machine",
    "check_process_counts",
    "cuda_available",
    "executor_models_time",
    "machine_cores",
    "machine_memory",
    "runs_on_cpu",
]

FRONTENDS_PER_CORE = 2
"""Front-end processes a CPU core may carry: a front end waits on sockets and the engine most
of the time, so two per core keep every core busy; more only cost each one's memory."""
GIB = 1 << 30
_CGROUP_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),  # cgroup v2
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # cgroup v1
)


def machine_cores() -> int:
    """The CPU cores this process may run on (its affinity: a container's or taskset's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclasses.dataclass(frozen=True, slots=True)
class MachineMemory:
    """The memory a setting can be held to: the host's, and its largest GPU's."""

    host_bytes: int
    """Physical memory, or the container's memory limit when that is lower."""
    gpu_bytes: int = 0
    """The largest visible CUDA device's memory (0: none)."""

    @property
    def largest(self) -> int:
        """What the largest single pool (host or one GPU) can hold."""
        return max(self.host_bytes, self.gpu_bytes)

    def describe(self) -> str:
        gpu = f" and {self.gpu_bytes / GIB:.1f} GiB on its largest GPU" if self.gpu_bytes else ""
        return f"this machine has {self.host_bytes / GIB:.1f} GiB of memory{gpu}"


def machine_memory(*, gpus: bool = False) -> MachineMemory:
    """The host's physical memory (``os.sysconf``; a cgroup's limit when lower) and, with
    ``gpus``, the largest CUDA device's (asking initializes CUDA in this process)."""
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit_file in _CGROUP_LIMITS:
        try:
            text = limit_file.read_text(encoding="ascii").strip()
        except OSError:
            continue
        if text.isdigit():
            host = min(host, int(text))
    gpu = 0
    import torch

    if gpus and torch.cuda.is_available():
        gpu = max(
            torch.cuda.get_device_properties(index).total_memory
            for index in range(torch.cuda.device_count())
        )
    return MachineMemory(host, gpu)


def check_process_counts(config: Any, registry: Registry, *, starts_replicas: bool = False) -> None:
    """``ConfigError`` naming the key, its value, this machine's cores and the limit when a
    config would start more processes than this machine's cores can run.

    - ``[server] api_server_count``: at most :data:`FRONTENDS_PER_CORE` per core.
    - an executor computing on this machine's CPU: ``[router] data_parallel_size`` x
      ``[executor] tensor_parallel_size`` ranks, at most one per core (each rank runs its
      torch threads on cores of its own).
    - ``[router] data_parallel_size`` engine processes otherwise: at most two per core.

    Replicas and ranks placed by Ray (``distributed_executor_backend = "ray"``) run on the
    cluster and are not counted. ``starts_replicas``: the caller starts the replicas as
    processes here (``brigade serve``, ``brigade generate``) even with an executor that models
    time (``brigade bench`` simulates such replicas in one process).
    """
    cores = machine_cores()
    where = f"{config.source}:"
    frontends = config["server"].settings.api_server_count
    if frontends > FRONTENDS_PER_CORE * cores:
        raise ConfigError(
            f"{where} [server] api_server_count = {frontends} front-end processes is more than "
            f"this machine's {_cores(cores)} can run: at most {FRONTENDS_PER_CORE * cores} "
            f"({FRONTENDS_PER_CORE} per core)"
        )
    if replicas_on_ray(config):
        return
    replicas = config["router"].settings.data_parallel_size
    ranks = tensor_parallel_size(config)
    if runs_on_cpu(executor_device(config)) and replicas * ranks > cores:
        raise ConfigError(
            f"{where} [router] data_parallel_size = {replicas} x [executor] "
            f"tensor_parallel_size = {ranks} is {replicas * ranks} engine ranks computing on "
            f"this machine's {_cores(cores)}; each needs a core of its own, so at most {cores} "
            '(or place them on a cluster: distributed_executor_backend = "ray")'
        )
    if (starts_replicas or not executor_models_time(config, registry)) and replicas > 2 * cores:
        raise ConfigError(
            f"{where} [router] data_parallel_size = {replicas} engine processes is more than "
            f"this machine's {_cores(cores)} can run: at most {2 * cores} (2 per core)"
        )


def check_machine(config: Any, registry: Registry) -> None:
    """What ``check_config`` holds a config to on this machine, from the model's headers and
    no tokenizer: the processes (counting the replicas this caller starts), the model's config
    against its weights, the memory. A command that starts processes (``brigade serve``,
    ``brigade generate`` with replicas) runs it first, so that a config no process could run
    starts none; each engine then runs ``check_config`` in full."""
    from brigade.memory_limits import check_memory
    from brigade.models.checkpoint import open_checkpoint
    from brigade.models.tensor_shapes import check_weights_match_config, require_weights

    check_process_counts(config, registry, starts_replicas=True)
    settings = config["model"].settings
    checkpoint = open_checkpoint(settings.path, chat_template=settings.chat_template)
    check_weights_match_config(checkpoint)
    if not executor_models_time(config, registry):
        require_weights(checkpoint)
    check_memory(config, registry, checkpoint, ask_gpus=False)


def executor_models_time(config: Any, registry: Registry) -> bool:
    """Whether the configured executor models its steps' time (``Executor.models_time``: the
    simulated one) rather than running a model: it loads no weights and allocates no KV."""
    factory = registry.get("executor", config.plugin("executor")).factory
    return bool(getattr(factory, "models_time", False))


def _cores(cores: int) -> str:
    return f"{cores} CPU core{'s' * (cores != 1)}"


def cuda_available() -> bool:
    """``torch.cuda.is_available()`` (torch imported on the first call)."""
    import torch

    return torch.cuda.is_available()


def runs_on_cpu(device: str | None) -> bool:
    """Whether an executor on ``device`` (its option; None: it has none) computes on this
    machine's CPU: ``cpu``, or ``auto`` without CUDA."""
    if device == "cpu":
        return True
    return device == "auto" and not cuda_available()
