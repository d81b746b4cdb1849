"""The serving frontend: streams an admitted prompt's choices as text deltas.

Runs on the event loop: one task per choice reads its engine stream and hands each update to
the :class:`~brigade.output.OutputProcessor` (detokenization, stop strings, ``n`` fan-out,
finish reasons; the same one ``LLM`` uses); a stop string closes the stream, which aborts
the request in the engine. Per-request metrics and the finish log line are kept here. HTTP
formatting is the app's job.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Mapping

import structlog

from brigade.admission import Admission
from brigade.errors import RequestError, RequestFailedError
from brigade.interfaces import EMPTY_EXTRA, Detokenizer, ExtraValue, Request
from brigade.output import Choice, ChoiceDelta, OutputProcessor
from brigade.server.logs import log_request_finished
from brigade.server.metrics import ServerMetrics
from brigade.server.request_streams import RequestStreams

__all__ = ["Frontend"]


class Frontend:
    """Everything between an HTTP handler and the async engine."""

    def __init__(
        self,
        engine: RequestStreams,
        detokenizer: Detokenizer,
        metrics: ServerMetrics,
    ) -> None:
        self.engine = engine
        self.processor = OutputProcessor(detokenizer)
        self.metrics = metrics
        self.logger = structlog.get_logger("brigade.server")

    async def generate(
        self,
        request_id: str,
        admission: Admission,
        *,
        priority: int = 0,
        index_offset: int = 0,
        extra: Mapping[str, ExtraValue] = EMPTY_EXTRA,
    ) -> AsyncGenerator[ChoiceDelta, None]:
        """Yield deltas of the admitted prompt's ``n`` choices, indexed from ``index_offset``;
        every choice's request carries ``extra`` (``Request.extra``).

        The choices are :meth:`OutputProcessor.fan_out`'s: choice 0 runs first, the others
        join once it has its first token. Leaving the iterator early aborts every choice. A
        choice that fails on its own ends with a delta whose ``finish_reason`` is "error" and
        whose ``error`` says why; the other choices go on.
        """
        arrival = time.monotonic()
        deltas: asyncio.Queue[ChoiceDelta | BaseException | None] = asyncio.Queue()
        tasks: list[asyncio.Task[None]] = []
        choices = self.processor.fan_out(request_id, admission.params, index_offset=index_offset)

        def start(choice: Choice) -> None:
            run = self._run_choice(
                choice,
                admission,
                priority,
                arrival,
                deltas,
                start,
                check_queue=not tasks,
                extra=extra,
            )
            tasks.append(asyncio.create_task(run))

        start(choices[0])
        remaining = len(choices)
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
        choice: Choice,
        admission: Admission,
        priority: int,
        arrival: float,
        out: asyncio.Queue[ChoiceDelta | BaseException | None],
        start: Callable[[Choice], None],
        *,
        check_queue: bool,
        extra: Mapping[str, ExtraValue] = EMPTY_EXTRA,
    ) -> None:
        """Put the choice's deltas in ``out``, then None (after a failure of anything but the
        choice itself, the exception instead); start its followers once it has a token."""
        first_token_at: float | None = None
        scheduled_at = arrival
        last_token_at = arrival
        finish_reason = "abort"
        try:
            stream = self.engine.generate(
                choice.request_id,
                admission,
                choice.params,
                priority=priority,
                check_queue=check_queue,
                extra=extra,
            )
            async for update in stream:
                now = time.monotonic()
                if first_token_at is None:
                    first_token_at = now
                    scheduled_at = self._first_token(update.request, arrival, now)
                else:
                    self.metrics.observe_inter_token(now - last_token_at)
                last_token_at = now
                delta = self.processor.process(choice, update)
                if choice.followers:
                    for follower in choice.take_followers():
                        start(follower)
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
            self._choice_failed(choice, exc, out, start)
        except Exception as exc:  # handed to the consumer, which re-raises it
            out.put_nowait(exc)
            return
        finally:
            if first_token_at is not None:
                self._finished(
                    choice, admission, (arrival, scheduled_at, first_token_at), finish_reason, out
                )
        out.put_nowait(None)

    def _first_token(self, request: Request, arrival: float, now: float) -> float:
        """Record a choice's time to first token (``now``) and its time queued; returns when
        it was first scheduled (``now``, when the engine did not say)."""
        scheduled_at = request.first_scheduled_time or now
        self.metrics.observe_first_token(now - arrival, max(0.0, scheduled_at - arrival))
        return scheduled_at

    def _choice_failed(
        self,
        choice: Choice,
        exc: RequestError | RequestFailedError,
        out: asyncio.Queue[ChoiceDelta | BaseException | None],
        start: Callable[[Choice], None],
    ) -> None:
        """End a choice that failed on its own with its error delta, and start the choices
        that were to follow its prefill."""
        out.put_nowait(self.processor.fail(choice, exc))
        for follower in choice.take_followers():
            start(follower)

    def _finished(
        self,
        choice: Choice,
        admission: Admission,
        times: tuple[float, float, float],
        finish_reason: str,
        out: asyncio.Queue[ChoiceDelta | BaseException | None],
    ) -> None:
        """Metrics and the finish log line; a failure there (stderr closed, ...) goes to the
        consumer like any other, so that the response ends rather than waits for this choice."""
        now = time.monotonic()
        arrival, scheduled_at, first_token_at = times  # monotonic: arrival, 1st step, 1st token
        prompt_tokens = len(admission.prompt_token_ids)
        try:
            self.metrics.observe_finished(
                prompt_tokens,
                choice.num_tokens,
                now - arrival,
                finish_reason,
                prefill_s=first_token_at - scheduled_at,
                decode_s=now - first_token_at,
            )
            with structlog.contextvars.bound_contextvars(request_id=choice.request_id):
                log_request_finished(
                    self.logger,
                    request_id=choice.request_id,
                    prompt_tokens=prompt_tokens,
                    output_tokens=choice.num_tokens,
                    ttft_s=first_token_at - arrival,
                    duration_s=now - arrival,
                    finish_reason=finish_reason,
                )
        except Exception as exc:
            out.put_nowait(exc)
