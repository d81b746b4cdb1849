"""Offline data parallel: ``brigade generate --data-parallel-size N``.

The prompts are placed on N engine replicas by the router station (as the server places
requests), each replica runs in its own process with its own engine and an equal share of the
CPU threads, and the answers come back in prompt order. The replicas are local processes, or
(``[executor] distributed_executor_backend = "ray"``) Ray actors placed by a placement group
over the nodes of a Ray cluster. The router sees each prompt's UTF-8
bytes in page-sized pieces (tokenizing in the parent would load a tokenizer for nothing): the
same shared head still lands on the same replica. A replica that fails fails only its own
prompts; the others' answers are kept.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import os
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from brigade.config import OFFLINE_DEFAULTS, load_config
from brigade.interfaces import ReplicaLoad, RouterParams, SamplingParams
from brigade.limits import check_machine
from brigade.output import RequestOutput
from brigade.ray_actors import replicas_on_ray, require_ray, spread_actors
from brigade.registry import default_registry
from brigade.replica_devices import local_replica_overrides, ray_replica_gpus, ray_replica_overrides

__all__ = ["ReplicaResult", "generate_on_replicas", "place_prompts"]


@dataclasses.dataclass(frozen=True)
class ReplicaResult:
    """What one replica did with its share of the prompts."""

    replica: int
    indices: list[int]
    """Positions of its prompts in the caller's list."""
    outputs: list[RequestOutput] | None
    """Their answers, in the order of ``indices``; None when the replica failed."""
    error: str | None = None
    num_steps: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_queries: int = 0
    node: str = ""
    """Where it ran: ``local``, or the Ray node's id."""


def place_prompts(
    config: Any, registry: Any, prompts: Sequence[str], num_replicas: int
) -> list[int]:
    """The replica of each prompt, as the configured router places them arriving all at once
    (each replica's load = the prompts placed on it so far)."""
    page_size = config["kv"].settings.page_size
    component = registry.get("router", config.plugin("router") or "round-robin")
    router = component.factory(RouterParams(num_replicas, page_size), config["router"].options)
    loads = [0] * num_replicas
    placed = []
    for index, prompt in enumerate(prompts):
        replicas = [ReplicaLoad(i, 0, loads[i], 0.0) for i in range(num_replicas)]
        target = router.route(str(index), list(prompt.encode()), replicas)
        loads[target] += 1
        placed.append(target)
    return placed


@dataclasses.dataclass(frozen=True)
class _Job:
    replica: int
    indices: list[int]
    overrides: list[str]
    prompts: list[str]
    threads: int


def generate_on_replicas(
    config_path: str | None,
    overrides: Sequence[str],
    prompts: Sequence[str],
    params: SamplingParams,
    *,
    chat: bool = False,
) -> list[ReplicaResult]:
    """Run ``prompts`` on ``[router] data_parallel_size`` replicas; one result per replica
    that got prompts. They run where ``[executor] distributed_executor_backend`` says: ``mp``
    (local processes) or ``ray`` (Ray actors in a placement group, on the cluster
    ``RAY_ADDRESS`` names, else a local one)."""
    registry = default_registry()
    config = load_config(config_path, registry, overrides=overrides, defaults=OFFLINE_DEFAULTS)
    check_machine(config, registry)  # before any replica starts
    num_replicas = config["router"].settings.data_parallel_size
    placed = place_prompts(config, registry, prompts, num_replicas)
    threads = _threads_per_replica(config, num_replicas)
    on_ray = replicas_on_ray(config)
    jobs = []
    for replica in range(num_replicas):
        indices = [i for i, target in enumerate(placed) if target == replica]
        if not indices:
            continue
        replica_overrides = [*overrides, "router.data_parallel_size=1"]
        if on_ray:
            replica_overrides += ray_replica_overrides(config)
        else:
            replica_overrides += local_replica_overrides(config, replica, num_replicas)
        if threads:
            replica_overrides.append(f"executor.num_threads={threads}")
        share = [prompts[i] for i in indices]
        jobs.append(_Job(replica, indices, replica_overrides, share, threads or 1))
    if on_ray:
        gpus = functools.partial(ray_replica_gpus, config, num_replicas)
        messages = _run_on_ray(jobs, config_path, params, chat, gpus)
    else:
        messages = _run_in_processes(jobs, config_path, params, chat)
    return [
        ReplicaResult(
            job.replica,
            job.indices,
            message.get("outputs"),
            message.get("error"),
            message.get("num_steps", 0),
            message.get("prefix_cache_hits", 0),
            message.get("prefix_cache_queries", 0),
            message.get("node", ""),
        )
        for job, message in zip(jobs, messages, strict=True)
    ]


def _run_in_processes(
    jobs: list[_Job], config_path: str | None, params: SamplingParams, chat: bool
) -> list[dict[str, Any]]:
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch pools
    running: list[tuple[Any, Connection]] = []
    for job in jobs:
        receive, send = context.Pipe(duplex=False)
        process = context.Process(
            target=_replica_main,
            args=(send, config_path, job.overrides, job.prompts),
            kwargs={"params": params, "chat": chat},
            name=f"brigade-replica-{job.replica}",
        )
        process.start()
        send.close()
        running.append((process, receive))
    messages = []
    for process, receive in running:
        try:
            message = receive.recv()
        except EOFError:  # it died before answering (killed, out of memory, a crash)
            process.join()
            message = {"error": f"the replica process exited with status {process.exitcode}"}
        process.join()
        messages.append(message)
    return messages


def _run_on_ray(
    jobs: list[_Job],
    config_path: str | None,
    params: SamplingParams,
    chat: bool,
    gpus: Callable[[float], int],
) -> list[dict[str, Any]]:
    """One Ray actor per replica (``gpus`` of the cluster's count each), each in its bundle
    of a placement group spread over the cluster's nodes; every actor and the group are gone
    when this returns."""
    ray = require_ray()
    with spread_actors(_ReplicaActor, [job.threads for job in jobs], gpus=gpus) as actors:
        refs = [
            actor.run.remote(config_path, job.overrides, job.prompts, params, chat)
            for actor, job in zip(actors, jobs, strict=True)
        ]
        messages = []
        for ref in refs:
            try:
                messages.append(ray.get(ref))
            except ray.exceptions.RayError as exc:  # the actor or its node died
                messages.append({"error": f"the replica's Ray actor failed: {exc}"})
        return messages


class _ReplicaActor:
    """A replica as a Ray actor (wrapped by ``ray.remote`` when the backend is used)."""

    def run(
        self,
        config_path: str | None,
        overrides: list[str],
        prompts: list[str],
        params: SamplingParams,
        chat: bool,
    ) -> dict[str, Any]:
        import ray

        message = _replica_work(config_path, overrides, prompts, params=params, chat=chat)
        return {**message, "node": ray.get_runtime_context().get_node_id()}


def _threads_per_replica(config: Any, num_replicas: int) -> int:
    """The machine's cores split evenly, when the executor takes ``num_threads`` and leaves
    it to torch (0 = set nothing: the executor has no such option, or the config set it)."""
    options = config["executor"].options
    if getattr(options, "num_threads", None) != 0:
        return 0
    return max(1, (os.cpu_count() or 1) // num_replicas)


def _replica_main(
    send: Connection,
    config_path: str | None,
    overrides: list[str],
    prompts: list[str],
    *,
    params: SamplingParams,
    chat: bool,
) -> None:
    try:
        message = _replica_work(config_path, overrides, prompts, params=params, chat=chat)
        send.send({**message, "node": "local"})
    finally:
        send.close()


def _replica_work(
    config_path: str | None,
    overrides: list[str],
    prompts: list[str],
    *,
    params: SamplingParams,
    chat: bool,
) -> dict[str, Any]:
    """Load the engine, answer the prompts: the replica's message to the parent."""
    try:
        from brigade.llm import LLM

        llm = LLM(config_path, overrides=overrides)
        if chat:
            conversations = [[{"role": "user", "content": prompt}] for prompt in prompts]
            outputs = llm.chat(conversations, params, use_tqdm=False)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        kv = llm.engine.kv.stats()
        return {
            "outputs": outputs,
            "num_steps": llm.engine.num_steps,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "prefix_cache_queries": kv.prefix_cache_queries,
        }
    except Exception as exc:  # the parent reports it; its prompts fail alone
        return {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
