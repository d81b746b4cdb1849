"""The engine core: one step = schedule, build the batch, execute, sample, account.

Token ids in, token ids out; text, stop strings and HTTP live in the frontend (``LLM``, the
server), outside the step loop.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from brigade.assemble import build_executor, open_model
from brigade.config import EngineConfig, check_config
from brigade.errors import ConfigError, RequestError
from brigade.interfaces import (
    KVManager,
    KVPoolParams,
    LogitsProcessor,
    Request,
    RequestStatus,
    Sampler,
    SamplerParams,
    SamplingParams,
    Scheduler,
    SchedulerParams,
)
from brigade.persistent_batch import PersistentBatch
from brigade.registry import Registry

__all__ = ["EngineCore", "EngineStats", "StepUpdate", "TokenLogprob"]

logger = logging.getLogger(__name__)

GATE_WAIT_S = 0.01
"""With nothing to run but requests waiting for their grammar, a step waits this long for one."""


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log probability of a sampled token and the top alternatives at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters for comparing policies on one workload."""

    num_steps: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_free_pages: int
    num_pages: int
    mean_queue_time_s: float
    """Mean time from arrival to first scheduled step, over requests scheduled so far."""

    @property
    def prefix_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


@dataclasses.dataclass(frozen=True, slots=True)
class StepUpdate:
    """What one step did for one request."""

    request: Request
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finished: bool
    error: str | None = None
    """Why the request was refused after it was queued (its grammar failed to compile)."""


class EngineCore:
    """Owns the scheduler, KV manager, executor, sampler and the persistent batch."""

    def __init__(self, config: EngineConfig, registry: Registry) -> None:
        started = time.perf_counter()
        self.config = config
        self.hook = registry.hook
        self.checkpoint = open_model(config)
        # Cross-station rules and the model's config and tokenizer, before loading weights.
        check_config(config, registry, self.checkpoint)
        model = build_executor(config, registry, self.checkpoint)
        self.executor, self.model_dir = model.executor, model.model_dir
        spec = self.executor.kv_cache_spec()
        self.vocab_size = spec.vocab_size
        self.eos_token_ids = self.checkpoint.eos_token_ids
        self.sampling_defaults: dict[str, float] = (
            dict(self.checkpoint.sampling_defaults())
            if config["model"].settings.generation_config == "auto"
            else {}
        )
        """Sampling parameters that requests leaving them unset get (the model's advice)."""
        settings = config["scheduler"].settings
        # A sequence never outgrows the pool, so a request alone always fits.
        self.max_model_len = min(model.max_model_len, model.num_pages * model.page_size)
        if not settings.enable_chunked_prefill and (
            settings.max_num_batched_tokens < self.max_model_len
        ):
            raise ConfigError(
                f"{config.source} [scheduler]: with enable_chunked_prefill = false, "
                f"max_num_batched_tokens ({settings.max_num_batched_tokens}) must be at least "
                f"max_model_len ({self.max_model_len})"
            )
        kv_settings = config["kv"].settings
        self.kv: KVManager = registry.get("kv", config.plugin("kv")).factory(
            KVPoolParams(model.num_pages, model.page_size, kv_settings.enable_prefix_caching),
            config["kv"].options,
        )
        self.scheduler: Scheduler = registry.get("scheduler", config.plugin("scheduler")).factory(
            SchedulerParams(
                max_num_seqs=settings.max_num_seqs,
                max_num_batched_tokens=settings.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=settings.enable_chunked_prefill,
                preemption=settings.preemption,
                host_pages=model.host_pages,
            ),
            self.kv,
            config["scheduler"].options,
        )
        self.device = torch.device(getattr(self.executor, "device", "cpu"))
        self.sampler_name = config.plugin("sampler")
        self.sampler: Sampler = registry.get("sampler", self.sampler_name).factory(
            SamplerParams(
                settings.max_num_seqs,
                self.vocab_size,
                str(self.device),
                model_dir=self.checkpoint.path,
                eos_token_ids=tuple(sorted(self.eos_token_ids)),
                checkpoint=self.checkpoint,
            ),
            config["sampler"].options,
        )
        # An executor that returns token ids (no logits) leaves processors nothing to act on.
        self._executor_returns_token_ids = type(self.executor).returns_token_ids
        self.processors: list[LogitsProcessor] = (
            [] if self._executor_returns_token_ids else list(self.sampler.logits_processors())
        )
        self._grammar_stage = next((p for p in self.processors if p.structured_output), None)
        self._gates: dict[Request, concurrent.futures.Future[Any]] = {}
        """Requests waiting for their grammar, with its compile future."""
        self.batch = PersistentBatch(
            settings.max_num_seqs,
            self.max_model_len,
            model.page_size,
            settings.max_num_batched_tokens,
        )
        self.requests: dict[str, Request] = {}
        self._generators: dict[str, torch.Generator] = {}
        self.num_steps = 0
        self._queue_time_total = 0.0
        self._num_scheduled = 0
        torch.manual_seed(config["model"].settings.seed)
        self.load_time_s = time.perf_counter() - started
        """Seconds from the start of construction until the engine could run (weights, KV)."""
        if self.hook is not None:
            self.hook.brigade_engine_started(components=config.components)

    # -- requests -----------------------------------------------------------------------

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ``RequestError`` if the engine cannot serve this request."""
        if not prompt_token_ids:
            raise RequestError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt_token_ids)} tokens; this engine serves at most "
                f"{self.max_model_len - 1} prompt tokens (max_model_len {self.max_model_len})"
            )
        for name, ids in (
            ("logit_bias", params.logit_bias or {}),
            ("stop_token_ids", params.stop_token_ids),
        ):
            outside = [t for t in ids if not 0 <= int(t) < self.vocab_size]
            if outside:
                raise RequestError(f"{name} token id {outside[0]} is outside the vocabulary")

    def prepare(self, params: SamplingParams) -> concurrent.futures.Future[Any] | None:
        """Start compiling the request's grammar (None: it has none). Thread-safe.

        The future fails with ``ValueError`` saying why when the grammar is invalid. The
        server awaits it before answering, so a bad schema is a 400; a request added while
        its grammar compiles waits behind a gate without holding pages. Raises
        ``RequestError`` when this engine cannot constrain output at all.
        """
        if params.structured_output is None:
            return None
        if self._grammar_stage is None:
            why = (
                "this executor returns token ids, not logits"
                if self._executor_returns_token_ids
                else f"the configured sampler {self.sampler_name!r} has no grammar stage; "
                'use [sampler] plugin = "xgrammar"'
            )
            raise RequestError(f"structured output is not available: {why}")
        return self._grammar_stage.prepare(params)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
    ) -> Request:
        """Validate and queue a request; it runs from the next step on."""
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in the engine")
        self.validate(prompt_token_ids, params)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=time.monotonic(),
            priority=priority,
        )
        gate = self.prepare(params)
        if gate is not None:
            if gate.done() and gate.exception() is not None:
                raise RequestError(str(gate.exception()))
            if not gate.done():
                request.ready = False
                self._gates[request] = gate
        if params.seed is not None:
            generator = torch.Generator(self.device)
            generator.manual_seed(params.seed)
            self._generators[request_id] = generator
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request

    def abort_request(self, request_id: str) -> Request | None:
        """Stop a request wherever it is and free its pages; None if it is not here."""
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        self._gates.pop(request, None)
        self._leave(request)
        return request

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        """Scheduler and KV counters plus queue time, for policy comparisons."""
        scheduler, kv = self.scheduler.stats(), self.kv.stats()
        return EngineStats(
            num_steps=self.num_steps,
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_free_pages=kv.num_free_pages,
            num_pages=kv.num_pages,
            mean_queue_time_s=self._queue_time_total / max(1, self._num_scheduled),
        )

    # -- the step -----------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepUpdate]:
        """Run one engine step; returns an update per request that got a token or finished."""
        refused = self._open_gates() if self._gates else []
        output = self.scheduler.schedule()
        for request in output.preempted:
            if request in self.batch:
                self._release_row(request)
        for copies in (output.swap_out, output.swap_in):  # out first: ins may reuse its pages
            if copies:
                sources, targets = zip(*copies, strict=True)
                self.executor.copy_pages(sources, targets)
        if output.is_empty:
            if self._gates:  # only requests waiting for their grammar: do not spin
                concurrent.futures.wait(
                    self._gates.values(),
                    timeout=GATE_WAIT_S,
                    return_when=concurrent.futures.FIRST_COMPLETED,
                )
            return refused
        for item in output.scheduled:
            if item.request not in self.batch:
                self._take_row(item.request)
        plan = self.batch.prepare(output.scheduled, self.kv)
        result = self.executor.execute(plan.model_input)
        self.num_steps += 1
        updates: list[StepUpdate] = refused
        finished: list[Request] = []
        if plan.sampled:
            if self._executor_returns_token_ids:  # no logits: no processors, no sampler
                tokens, logprobs = result.tolist(), None
            else:
                tokens, logprobs = self._sample(result, plan.sampled_rows)
            positions = [request.num_tokens for request in plan.sampled]
            self.batch.append_tokens(plan.sampled_rows, positions, tokens)
            for processor in self.processors:
                if processor.needs_tokens:
                    processor.accept_batch(plan.sampled_rows, tokens)
            # Rows whose grammar is complete: nothing but a stop token could follow.
            complete = set(self._grammar_stage.finished_rows()) if self._grammar_stage else ()
            for index, (request, token) in enumerate(zip(plan.sampled, tokens, strict=True)):
                request.output_token_ids.append(token)
                status = self._finish_status(request, token)
                if status is None and plan.sampled_rows[index] in complete:
                    status = RequestStatus.FINISHED_STOPPED
                if status is not None:
                    request.status = status
                    finished.append(request)
                row_logprobs = None if logprobs is None else [logprobs[index]]
                updates.append(StepUpdate(request, [token], row_logprobs, status is not None))
        self.scheduler.update(output, finished)
        for item in output.scheduled:
            self.kv.commit(item.request)
        for request in finished:
            self.kv.free(request)
            self._leave(request)
        return updates

    def _open_gates(self) -> list[StepUpdate]:
        """Let requests whose grammar is ready be scheduled; refuse those whose failed."""
        refused = []
        for request, gate in list(self._gates.items()):
            if not gate.done():
                continue
            del self._gates[request]
            error = gate.exception()
            if error is None:
                request.ready = True
                continue
            logger.warning("request %s refused: %s", request.request_id, error)
            if self.scheduler.abort(request.request_id) is not None:
                self._leave(request)
                refused.append(StepUpdate(request, [], None, True, error=str(error)))
        return refused

    def _sample(self, logits: torch.Tensor, rows: list[int]) -> tuple[list[int], Any]:
        active = [processor for processor in self.processors if processor.is_active]
        for processor in active:  # host work (bitmasks) while the device runs the model
            processor.begin_step(rows)
        batch = self.batch.sampling_batch(rows, self.device)
        for processor in active:
            logits = processor.apply(logits, batch.rows)
        result = self.sampler.sample(logits, batch)
        tokens: list[int] = result.token_ids.tolist()  # the step's one device-to-host sync
        if result.logprobs is None or result.logprob_token_ids is None:
            return tokens, None
        values, ids = result.logprobs.tolist(), result.logprob_token_ids.tolist()
        logprobs = []
        for index, row in enumerate(rows):
            wanted = self.batch.num_logprobs[row]
            top = tuple(zip(ids[index][1 : 1 + wanted], values[index][1 : 1 + wanted], strict=True))
            logprobs.append(
                TokenLogprob(ids[index][0], values[index][0], top) if wanted >= 0 else None
            )
        return tokens, logprobs

    def _finish_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens > params.min_tokens:  # min_tokens: no stop before
            if token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _take_row(self, request: Request) -> None:
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
            self._queue_time_total += request.first_scheduled_time - request.arrival_time
            self._num_scheduled += 1
        row = self.batch.assign(request, self._generators.get(request.request_id))
        for processor in self.processors:
            processor.add(row, request)

    def _release_row(self, request: Request) -> None:
        row = self.batch.release(request)
        for processor in self.processors:
            processor.remove(row)

    def _leave(self, request: Request) -> None:
        """A request is done (finished or aborted): forget it everywhere."""
        if request in self.batch:
            self._release_row(request)
        self.requests.pop(request.request_id, None)
        self._generators.pop(request.request_id, None)
        if self.hook is not None:
            self.hook.brigade_request_finished(request=request)
