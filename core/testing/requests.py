"""Request builders for scheduler and KV manager tests: no model, no tokenizer, just token ids."""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from brigade.interfaces import (
    KVManager,
    PoolingParams,
    Request,
    RequestStatus,
    SamplingParams,
    freeze_extra,
)

__all__ = ["cached_once", "make_request", "make_requests", "probe_hit", "run_prefill"]


def make_request(
    request_id: str,
    token_ids: Sequence[int],
    *,
    max_tokens: int = 16,
    priority: int = 0,
    arrival_time: float = 0.0,
    eos_token_ids: Iterable[int] = (),
    extra: Mapping[str, object] | None = None,
    pooling: PoolingParams | None = None,
    **sampling: Any,
) -> Request:
    """A waiting request with prompt ``token_ids`` and ``extra`` data (``Request.extra``),
    an embedding request when ``pooling`` is set; further keywords go to
    :class:`SamplingParams`."""
    return Request(
        request_id=request_id,
        prompt_token_ids=list(token_ids),
        sampling_params=SamplingParams(max_tokens=max_tokens, **sampling),
        eos_token_ids=frozenset(eos_token_ids),
        arrival_time=arrival_time,
        priority=priority,
        extra=freeze_extra(extra),
        pooling=pooling,
    )


def make_requests(
    num_requests: int,
    num_prompt_tokens: int | Sequence[int],
    *,
    max_tokens: int = 16,
    num_shared_prefix_tokens: int = 0,
    vocab_size: int = 32_000,
    seed: int = 0,
    id_prefix: str = "req-",
    **sampling: Any,
) -> list[Request]:
    """``num_requests`` requests with seeded random prompts, named ``req-0``, ``req-1``, ...

    ``num_prompt_tokens`` is one length for all or one per request. The first
    ``num_shared_prefix_tokens`` tokens are the same in every prompt (for prefix-cache tests);
    ``arrival_time`` is the request's index, so FCFS order is list order.
    """
    lengths = (
        [num_prompt_tokens] * num_requests
        if isinstance(num_prompt_tokens, int)
        else list(num_prompt_tokens)
    )
    if len(lengths) != num_requests:
        raise ValueError(f"got {len(lengths)} prompt lengths for {num_requests} requests")
    if any(length < 1 for length in lengths):
        raise ValueError(f"every prompt needs at least one token, got lengths {lengths}")
    rng = random.Random(seed)
    shared = [rng.randrange(vocab_size) for _ in range(num_shared_prefix_tokens)]
    requests = []
    for index, length in enumerate(lengths):
        own = [rng.randrange(vocab_size) for _ in range(max(0, length - len(shared)))]
        requests.append(
            make_request(
                f"{id_prefix}{index}",
                (shared + own)[:length],
                max_tokens=max_tokens,
                arrival_time=float(index),
                **sampling,
            )
        )
    return requests


def run_prefill(kv: KVManager, request: Request) -> int:
    """Admit and compute the whole request, commit, and return the cached tokens found."""
    allocation = kv.allocate(request, request.num_tokens)
    if allocation is None:
        raise AssertionError(f"no room to admit {request.request_id}")
    request.num_computed_tokens = request.num_tokens
    kv.commit(request)
    return allocation.num_cached_tokens


def cached_once(kv: KVManager, prompt: list[int], request_id: str = "owner") -> list[int]:
    """Compute ``prompt`` in a request, free it, and return the pages it used."""
    owner = make_request(request_id, prompt)
    run_prefill(kv, owner)
    table = list(kv.block_table(owner))
    owner.status = RequestStatus.FINISHED_STOPPED
    kv.free(owner)
    return table


def probe_hit(kv: KVManager, prompt: list[int]) -> int:
    """Cached tokens a new request with ``prompt`` finds (it is freed again, uncommitted)."""
    probe = make_request("probe", prompt)
    allocation = kv.allocate(probe, probe.num_tokens)
    if allocation is None:
        raise AssertionError("no room to admit the probe")
    probe.status = RequestStatus.FINISHED_ABORTED
    kv.free(probe)
    return allocation.num_cached_tokens
