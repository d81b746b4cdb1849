"""The serving frontend: turns engine updates into per-choice text deltas.

Runs on the event loop: detokenization, stop strings (a match aborts the request in the
engine; usage counts tokens up to the stop), ``n`` choices, per-request metrics and the
finish log line. HTTP formatting is the app's job.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import Any

import structlog

from brigade.engine import StepUpdate, TokenLogprob
from brigade.errors import RequestError, RequestFailedError
from brigade.interfaces import EMPTY_EXTRA, Detokenizer, ExtraValue, SamplingParams
from brigade.server.async_engine import AsyncEngine
from brigade.server.logs import log_request_finished
from brigade.server.metrics import ServerMetrics

__all__ = ["ChoiceDelta", "Frontend"]


@dataclasses.dataclass(frozen=True, slots=True)
class ChoiceDelta:
    """New output of one choice; ``finish_reason`` is set on its last delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    stop_reason: str | None = None
    error: RequestError | RequestFailedError | None = None
    """Why the choice failed (``finish_reason`` "error"): invalid, or a plugin failed for it."""


@dataclasses.dataclass(slots=True)
class _Choice:
    index: int
    request_id: str
    state: Any
    num_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None


class Frontend:
    """Everything between an HTTP handler and the async engine."""

    def __init__(
        self,
        engine: AsyncEngine,
        detokenizer: Detokenizer,
        metrics: ServerMetrics,
    ) -> None:
        self.engine = engine
        self.detokenizer = detokenizer
        self.metrics = metrics
        self.logger = structlog.get_logger("brigade.server")

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        index_offset: int = 0,
        extra: Mapping[str, ExtraValue] = EMPTY_EXTRA,
    ) -> AsyncGenerator[ChoiceDelta, None]:
        """Yield deltas of ``params.n`` choices, indexed from ``index_offset``; every choice's
        request carries ``extra`` (``Request.extra``).

        Choice 0 runs first; the others join once its prompt is prefilled, so their prompt
        pages come from the prefix cache (shared with choice 0, not recomputed). Choice i
        uses seed + i. Leaving the iterator early aborts every choice. A choice that fails
        on its own ends with a delta whose ``finish_reason`` is "error" and whose ``error``
        says why; the other choices go on.
        """
        arrival = time.monotonic()
        deltas: asyncio.Queue[ChoiceDelta | BaseException | None] = asyncio.Queue()
        tasks: list[asyncio.Task[None]] = []

        def start(child: int) -> None:
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + child
                child_params = dataclasses.replace(params, n=1, seed=seed)
            task = asyncio.create_task(
                self._run_choice(
                    f"{request_id}-{child}",
                    index_offset + child,
                    prompt_token_ids,
                    child_params,
                    priority,
                    arrival,
                    deltas,
                    on_first_token=fork if child == 0 and params.n > 1 else None,
                    check_queue=child == 0,
                    extra=extra,
                )
            )
            tasks.append(task)

        def fork() -> None:
            for child in range(1, params.n):
                start(child)

        start(0)
        remaining = params.n
        try:
            while remaining:
                item = await deltas.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_choice(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        priority: int,
        arrival: float,
        out: asyncio.Queue[ChoiceDelta | BaseException | None],
        on_first_token: Callable[[], None] | None,
        check_queue: bool,
        extra: Mapping[str, ExtraValue] = EMPTY_EXTRA,
    ) -> None:
        choice: _Choice | None = None
        finish_reason = "abort"
        try:
            stream = self.engine.generate(
                request_id,
                prompt_token_ids,
                params,
                priority=priority,
                check_queue=check_queue,
                extra=extra,
            )
            async for update in stream:
                if choice is None:
                    choice = _Choice(index, request_id, self.detokenizer.start(update.request))
                    self._first_token(choice, update, arrival)
                    if on_first_token is not None:
                        on_first_token()
                else:
                    self._next_token(choice)
                delta = self._delta(choice, update)
                if delta.finish_reason is not None:
                    finish_reason = delta.finish_reason
                    if delta.stop_reason is not None:  # a stop string: the engine may go on
                        await stream.aclose()
                out.put_nowait(delta)
                if delta.finish_reason is not None:
                    break
        except asyncio.CancelledError:
            raise
        except (RequestError, RequestFailedError) as exc:  # this choice alone failed
            finish_reason = "error"
            out.put_nowait(ChoiceDelta(index, "", [], None, "error", error=exc))
            if choice is None and on_first_token is not None:
                on_first_token()  # the other choices were to start after this one's prefill
        except Exception as exc:  # handed to the consumer, which re-raises it
            out.put_nowait(exc)
            return
        finally:
            if choice is not None:
                self._finished(choice, len(prompt_token_ids), arrival, finish_reason)
        out.put_nowait(None)

    def _delta(self, choice: _Choice, update: StepUpdate) -> ChoiceDelta:
        if update.error is not None:  # it failed after its first token
            text = self.detokenizer.finish(choice.state).text
            error = RequestFailedError(update.error)
            return ChoiceDelta(choice.index, text, [], None, "error", error=error)
        tokens = update.new_token_ids
        text_delta = self.detokenizer.step(choice.state, tokens)
        logprobs = update.logprobs
        if text_delta.stop_reason is not None:
            keep = text_delta.num_tokens_to_stop
            already = choice.num_tokens
            if keep is not None:
                cut = max(0, keep - already)
                tokens = tokens[:cut]
                logprobs = None if logprobs is None else logprobs[:cut]
            choice.num_tokens = already + len(tokens)
            return ChoiceDelta(
                choice.index, text_delta.text, tokens, logprobs, "stop", text_delta.stop_reason
            )
        choice.num_tokens += len(tokens)
        text = text_delta.text
        finish_reason = None
        if update.finished:
            text += self.detokenizer.finish(choice.state).text
            finish_reason = update.request.status.value
        return ChoiceDelta(choice.index, text, tokens, logprobs, finish_reason)

    def _first_token(self, choice: _Choice, update: StepUpdate, arrival: float) -> None:
        now = time.monotonic()
        choice.first_token_at = choice.last_token_at = now
        scheduled = update.request.first_scheduled_time or now
        self.metrics.observe_first_token(now - arrival, max(0.0, scheduled - arrival))

    def _next_token(self, choice: _Choice) -> None:
        now = time.monotonic()
        if choice.last_token_at is not None:
            self.metrics.observe_inter_token(now - choice.last_token_at)
        choice.last_token_at = now

    def _finished(
        self, choice: _Choice, prompt_tokens: int, arrival: float, finish_reason: str
    ) -> None:
        now = time.monotonic()
        ttft = (choice.first_token_at or now) - arrival
        self.metrics.observe_finished(
            prompt_tokens, choice.num_tokens, now - arrival, finish_reason
        )
        with structlog.contextvars.bound_contextvars(request_id=choice.request_id):
            log_request_finished(
                self.logger,
                request_id=choice.request_id,
                prompt_tokens=prompt_tokens,
                output_tokens=choice.num_tokens,
                ttft_s=ttft,
                duration_s=now - arrival,
                finish_reason=finish_reason,
            )
