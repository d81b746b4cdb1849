"""Offline data parallel: ``brigade generate --data-parallel-size N``.

The prompts are placed on N engine replicas by the router station (as the server places
requests), each replica runs in its own process with its own engine and an equal share of the
CPU threads, and the answers come back in prompt order. The router sees each prompt's UTF-8
bytes in page-sized pieces (tokenizing in the parent would load a tokenizer for nothing): the
same shared head still lands on the same replica. A replica that fails fails only its own
prompts; the others' answers are kept.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from brigade.config import load_config
from brigade.interfaces import ReplicaLoad, RouterParams, SamplingParams
from brigade.output import RequestOutput
from brigade.registry import default_registry

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


def generate_on_replicas(
    config_path: str | None,
    overrides: Sequence[str],
    prompts: Sequence[str],
    params: SamplingParams,
    *,
    chat: bool = False,
) -> list[ReplicaResult]:
    """Run ``prompts`` on ``[router] data_parallel_size`` replica processes; one result per
    replica that got prompts."""
    registry = default_registry()
    config = load_config(config_path, registry, overrides=overrides)
    num_replicas = config["router"].settings.data_parallel_size
    placed = place_prompts(config, registry, prompts, num_replicas)
    threads = _threads_per_replica(config, num_replicas)
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch pools
    running: list[tuple[int, list[int], Any, Connection]] = []
    for replica in range(num_replicas):
        indices = [i for i, target in enumerate(placed) if target == replica]
        if not indices:
            continue
        receive, send = context.Pipe(duplex=False)
        replica_overrides = [*overrides, "router.data_parallel_size=1"]
        if threads:
            replica_overrides.append(f"executor.num_threads={threads}")
        process = context.Process(
            target=_replica_main,
            args=(send, config_path, replica_overrides, [prompts[i] for i in indices]),
            kwargs={"params": params, "chat": chat},
            name=f"brigade-replica-{replica}",
        )
        process.start()
        send.close()
        running.append((replica, indices, process, receive))
    results = []
    for replica, indices, process, receive in running:
        try:
            message = receive.recv()
        except EOFError:  # it died before answering (killed, out of memory, a crash)
            process.join()
            message = {"error": f"the replica process exited with status {process.exitcode}"}
        process.join()
        results.append(
            ReplicaResult(
                replica,
                indices,
                message.get("outputs"),
                message.get("error"),
                message.get("num_steps", 0),
                message.get("prefix_cache_hits", 0),
                message.get("prefix_cache_queries", 0),
            )
        )
    return results


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
        from brigade.llm import LLM

        llm = LLM(config_path, overrides=overrides)
        if chat:
            conversations = [[{"role": "user", "content": prompt}] for prompt in prompts]
            outputs = llm.chat(conversations, params, use_tqdm=False)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        kv = llm.engine.kv.stats()
        send.send(
            {
                "outputs": outputs,
                "num_steps": llm.engine.num_steps,
                "prefix_cache_hits": kv.prefix_cache_hits,
                "prefix_cache_queries": kv.prefix_cache_queries,
            }
        )
    except BaseException as exc:  # the parent reports it; its prompts fail alone
        send.send({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
    finally:
        send.close()
