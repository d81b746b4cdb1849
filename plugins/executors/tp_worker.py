"""Starting a tensor-parallel group from rank 0, and what each other rank runs.

A rank other than 0 is a :class:`RankWorker`: a
:class:`~brigade.plugins.executors.torch_executor.TorchExecutor` built for its rank (its
shard of the weights, its KV heads' pool) that calls what rank 0 sends (see
``brigade.plugins.executors.tp_ranks``) until told to stop or until rank 0 is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import traceback
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from brigade.interfaces import ConfigError
from brigade.plugins.executors.tp_ranks import (
    COLLECTIVE_TIMEOUT,
    ProcessLauncher,
    RankGroup,
    RankLauncher,
    RankSpec,
    join_group,
)
from brigade.plugins.models import TENSOR_PARALLEL_KEY, TensorParallel

if TYPE_CHECKING:
    from brigade.interfaces import ExecutorParams, ModelArchitecture
    from brigade.plugins.models import DecoderArchitecture

__all__ = ["RankWorker", "check_split", "cpu_threads", "rank_device", "run_rank", "start_ranks"]

_COMMANDS = frozenset(
    {"initialize_kv_cache", "execute", "execute_with_hidden_states", "copy_pages"}
)


def check_split(
    architecture: ModelArchitecture,
    hf_config: Mapping[str, Any],
    size: int,
    *,
    compile: bool,  # noqa: A002 - the option's name
) -> DecoderArchitecture:
    """``architecture`` if the model splits over ``size`` ranks (and ``compile`` is off),
    else a ``ConfigError`` naming the key."""
    from brigade.plugins.models import DecoderArchitecture

    if not isinstance(architecture, DecoderArchitecture):
        raise ConfigError(
            f"{TENSOR_PARALLEL_KEY} = {size}: architecture {type(architecture).__name__} "
            "cannot be split; allowed: 1 (tensor parallelism covers the built-in decoder "
            "architectures)"
        )
    if compile:
        raise ConfigError(
            f"{TENSOR_PARALLEL_KEY} = {size} cannot be combined with [executor] compile = true; "
            "set one of them back"
        )
    architecture.check_split(hf_config, size)
    return architecture


def rank_device(device: torch.device, rank: int, size: int) -> torch.device:
    """The device of ``rank``: the CPU for all, or one GPU each from rank 0's index on."""
    if device.type != "cuda":
        return device
    first = device.index or 0
    if first + size > torch.cuda.device_count():
        raise ConfigError(
            f"{TENSOR_PARALLEL_KEY} = {size} needs {size} CUDA devices from cuda:{first} on; "
            f"{torch.cuda.device_count()} visible (lower {TENSOR_PARALLEL_KEY} or set "
            "[executor] device)"
        )
    return torch.device("cuda", first + rank)


def start_ranks(
    params: ExecutorParams,
    options: Any,
    device: torch.device,
    size: int,
    launcher: RankLauncher | None = None,
) -> tuple[RankGroup, TensorParallel]:
    """Start ranks 1..size-1 and join their process group as rank 0; returns once every rank
    has joined (they load their shards meanwhile: wait for ``"ready"``). ``options``: rank
    0's ``TorchExecutorOptions`` (typed Any: mypy reads torch_executor under two module names,
    its path's and the package's)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    launcher = launcher or ProcessLauncher()
    # Port 0: the store takes a free port, which the ranks are told.
    store = dist.TCPStore(
        launcher.host, 0, size, is_master=True, wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT
    )
    specs = [
        RankSpec(
            rank,
            size,
            store.port,
            backend,
            params,
            dataclasses.replace(options, device=str(rank_device(device, rank, size))),
            launcher.host,
        )
        for rank in range(1, size)
    ]
    group = RankGroup(launcher, size)
    try:
        group.launcher.start(specs)
        group.wait("hello")
        if backend == "nccl":  # NCCL works on the current device: rank 0's is the first
            torch.cuda.set_device(device)
        process_group = join_group(backend, store, 0, size, launcher.host)
    except BaseException:
        group.stop()
        raise
    group.store = store  # the ranks' rendezvous lives as long as the group
    return group, TensorParallel(0, size, process_group)


class RankWorker:
    """One rank other than 0: joins the group, builds its shard, then runs what rank 0 sends.
    Transport-free, so a launcher other than processes (Ray actors) can host it: it is
    handed each message rank 0 sent, in order."""

    def __init__(self, spec: RankSpec, host: str = "127.0.0.1") -> None:
        """``host``: the address the other ranks reach this one at."""
        from brigade.plugins.executors.torch_executor import TorchExecutor

        if spec.backend == "nccl":
            torch.cuda.set_device(torch.device(spec.options.device))
        store = dist.TCPStore(
            spec.store_host,
            spec.store_port,
            spec.world_size,
            is_master=False,
            timeout=COLLECTIVE_TIMEOUT,
        )
        group = join_group(spec.backend, store, spec.rank, spec.world_size, host)
        if spec.options.num_threads == 0 and spec.options.device == "cpu":
            torch.set_num_threads(cpu_threads(spec.world_size))
        tp = TensorParallel(spec.rank, spec.world_size, group)
        self.executor = TorchExecutor(spec.params, spec.options, rank=tp)

    def handle(self, message: bytes) -> bool:
        """Run one message from rank 0 (``tp_ranks.encode``d); False when told to stop."""
        name, args = pickle.loads(message)
        if name == "shutdown":
            return False
        if name not in _COMMANDS:
            raise ValueError(f"unknown tensor-parallel command {name!r}")
        getattr(self.executor, name)(*args)
        return True


def run_rank(spec: RankSpec, connection: Connection, host: str = "127.0.0.1") -> None:
    """A rank's process (:class:`ProcessLauncher`) or actor (``RayLauncher``): a
    :class:`RankWorker` fed from the connection until rank 0 says stop or its end closes."""

    def reply(kind: str, detail: Any = None) -> None:
        connection.send_bytes(pickle.dumps((kind, detail)))

    try:
        reply("hello")
        worker = RankWorker(spec, host)
        reply("ready")
        while True:
            try:
                message = connection.recv_bytes()
            except EOFError:  # rank 0's process is gone
                break
            if not worker.handle(message):
                break
    except BaseException as error:  # report it, so rank 0 names the cause, not a broken socket
        with contextlib.suppress(OSError):
            reply("error", f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=6)}")
        raise SystemExit(1) from error


def cpu_threads(world_size: int) -> int:
    """Threads per rank when ``num_threads`` is 0: the cores shared out, so the ranks do not
    fight over them."""
    return max(1, (os.cpu_count() or 1) // world_size)
