"""Run a workload against any OpenAI-compatible server over streaming ``/v1/completions``.

Requests are sent at their arrival times (at most ``max_concurrency`` in flight; a request
that finds every slot busy waits, and so do those behind it), each with
``max_tokens = output_len`` and ``ignore_eos: true`` (a vLLM and brigade extension; a server
that ignores it may stop early, which the measured token counts then show), and a request's
``extra`` data as ``extra_args`` (brigade's field; vLLM reads ``vllm_xargs``). Latencies are
measured from when a request is sent: TTFT to its first streamed chunk with a choice, ITL
between such chunks, e2e to the end of the stream. Token counts come from the final usage
chunk (``stream_options.include_usage``), or, without one, from the number of chunks.
An error answer, a dropped connection or a timeout counts the request as failed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import httpx

from brigade.bench.report import BenchError, RequestTiming, RunMetrics
from brigade.bench.workloads import WorkloadRequest, extra_json

__all__ = ["Endpoint", "EndpointRun", "run_endpoint"]

# Text prompts map each token id to one of these words: deterministic, and shared prefixes
# of ids stay shared prefixes of text (so a server's prefix cache still sees them).
_WORD_LIST = (
    "the of and to in is was for on that with as by at from his her they this which be or "
    "an had not are but were one all their there been has have when who will more no if out "
    "so said what up its about into than them can only other new some could time these two "
    "may then do first any my now such like our over man me even most made after also did "
    "many before must through back years where much your way well down should because each "
    "just those people how too little state good very make world still own see men work long"
)
_WORDS = tuple(_WORD_LIST.split())


@dataclasses.dataclass(frozen=True, slots=True)
class Endpoint:
    """Where and how to send the workload."""

    base_url: str
    """Up to and including ``/v1``, e.g. ``http://127.0.0.1:8000/v1``."""
    model: str
    prompt_format: Literal["token_ids", "text"] = "token_ids"
    max_concurrency: int = 64
    request_timeout_s: float = 600.0
    api_key: str | None = None

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise BenchError(
                f"--endpoint {self.base_url!r} is not allowed; give an http(s) URL ending in /v1"
            )
        if self.max_concurrency < 1:
            raise BenchError(f"--max-concurrency {self.max_concurrency} is not allowed; need >= 1")
        if not self.request_timeout_s > 0:
            raise BenchError("--request-timeout must be > 0 seconds")


@dataclasses.dataclass(frozen=True, slots=True)
class EndpointRun:
    """What one pass of a workload over HTTP measured."""

    timings: list[RequestTiming]
    """Of the requests that succeeded, in workload order."""
    metrics: RunMetrics
    errors: list[str]
    """One message per failed request."""
    short_outputs: int
    """Successful requests that returned fewer tokens than asked (the server ignored
    ``ignore_eos`` or stopped for another reason)."""


def text_prompt(token_ids: Sequence[int]) -> str:
    """The words standing in for ``token_ids`` when the server takes only text."""
    return " ".join(_WORDS[token % len(_WORDS)] for token in token_ids)


def run_endpoint(
    endpoint: Endpoint,
    workload: Sequence[WorkloadRequest],
    on_finished: Callable[[], object] | None = None,
) -> EndpointRun:
    """Send ``workload`` to ``endpoint`` at its arrival times and wait for every answer."""
    return asyncio.run(_run(endpoint, workload, on_finished))


async def _run(
    endpoint: Endpoint,
    workload: Sequence[WorkloadRequest],
    on_finished: Callable[[], object] | None,
) -> EndpointRun:
    url = endpoint.base_url.rstrip("/") + "/completions"
    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    limits = httpx.Limits(max_connections=endpoint.max_concurrency)
    timeout = httpx.Timeout(endpoint.request_timeout_s, connect=min(endpoint.request_timeout_s, 30))
    order = sorted(range(len(workload)), key=lambda index: workload[index].arrival_time)
    offset = workload[order[0]].arrival_time if order else 0.0
    slots = asyncio.Semaphore(endpoint.max_concurrency)
    results: dict[int, RequestTiming | str] = {}

    async def send(client: httpx.AsyncClient, index: int) -> None:
        try:
            results[index] = await _request(client, url, headers, endpoint, workload[index])
        finally:
            slots.release()
            if on_finished is not None:
                on_finished()

    start = time.perf_counter()
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        tasks = []
        for index in order:
            delay = workload[index].arrival_time - offset - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            await slots.acquire()
            tasks.append(asyncio.create_task(send(client, index)))
        await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    timings = [r for _, r in sorted(results.items()) if isinstance(r, RequestTiming)]
    failed = [index for index, r in sorted(results.items()) if isinstance(r, str)]
    errors = [str(results[index]) for index in failed]
    short = sum(
        1
        for index, result in results.items()
        if isinstance(result, RequestTiming) and result.output_tokens < workload[index].output_len
    )
    metrics = RunMetrics(
        duration,
        None,
        None,
        num_failed=len(errors),
        failed_extra=tuple(workload[index].extra for index in failed),
    )
    return EndpointRun(timings, metrics, errors, short)


async def _request(
    client: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    endpoint: Endpoint,
    request: WorkloadRequest,
) -> RequestTiming | str:
    """One streamed completion: its timing, or a one-line error message."""
    body = _completion_body(endpoint, request)
    arrivals: list[float] = []
    usage_tokens: int | None = None
    sent = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if not response.is_success:  # 2xx: some servers (Litestar) answer a POST with 201
                detail = (await response.aread()).decode("utf-8", "replace")
                return f"HTTP {response.status_code}: {' '.join(detail.split())[:300]}"
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    return f"unexpected stream event: {data[:200]}"
                if "error" in chunk:
                    return f"error event: {json.dumps(chunk['error'])[:300]}"
                if chunk.get("choices"):
                    arrivals.append(time.perf_counter())
                usage = chunk.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                    usage_tokens = usage["completion_tokens"]
            if not done:
                return "the stream ended without data: [DONE]"
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    except ValueError as exc:
        return f"a stream event is not JSON: {exc}"
    finished = time.perf_counter()
    if not arrivals:
        return "the stream carried no tokens"
    gaps = tuple(later - earlier for earlier, later in itertools.pairwise(arrivals))
    tokens = usage_tokens if usage_tokens is not None else len(arrivals)
    return RequestTiming(
        arrivals[0] - sent, finished - sent, tokens, gaps, request.priority, request.extra
    )


def _completion_body(endpoint: Endpoint, request: WorkloadRequest) -> dict[str, Any]:
    """The streamed ``/v1/completions`` request for ``request``: greedy, exactly
    ``output_len`` tokens (``ignore_eos``), usage in the last chunk."""
    prompt: str | list[int] = (
        list(request.prompt_token_ids)
        if endpoint.prompt_format == "token_ids"
        else text_prompt(request.prompt_token_ids)
    )
    body: dict[str, Any] = {
        "model": endpoint.model,
        "prompt": prompt,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.priority:
        body["priority"] = request.priority
    if request.extra:
        body["extra_args"] = extra_json(request.extra)
    return body
