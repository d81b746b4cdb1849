"""The engine core: requests in, one step at a time, updates out.

A step (:meth:`EngineCore.step`) reads schedule -> prepare -> execute -> sample -> process:
the scheduler's plan (``brigade.scheduling``), the persistent batch's executor input
(``brigade.persistent_batch``), the forward pass, the sampling stage
(``brigade.sampling_stage``) and the step output processor (``brigade.step_output``), which
owns what becomes of the sampled tokens. Speculative decoding plugs in as one object
(``brigade.speculative.Speculation``, None when off) and embeddings through the pooler
(``brigade.pooling``). This module owns the requests' lifecycle: admission, queueing, rows,
failures and departures.

Token ids in, token ids out; text, stop strings and HTTP live in the frontend (``LLM``, the
server), outside the step loop.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from brigade.admission import Admission, check_request
from brigade.assemble import ModelPath, build_executor, load_draft_model, open_model
from brigade.config import EngineConfig, check_config
from brigade.engine_stations import build_stations
from brigade.errors import (
    ConfigError,
    EngineDeadError,
    RequestError,
    RequestFailedError,
    describe,
)
from brigade.grammar import SAMPLING_PATIENCE_S
from brigade.hooks import notify_request_finished
from brigade.interfaces import (
    DraftModel,
    Executor,
    ExtraValue,
    PoolingParams,
    Request,
    RequestStatus,
    SamplingParams,
    ScheduledRequest,
    SchedulerOutput,
    freeze_extra,
)
from brigade.persistent_batch import StepPlan
from brigade.pooling import Pooler
from brigade.registry import Registry
from brigade.sampling_stage import SampledTokens, TokenLogprob
from brigade.speculative import SpeculativeStats
from brigade.step_output import StepOutputProcessor, StepUpdate
from brigade.step_tokens import without

__all__ = ["EngineCore", "EngineStats", "StepUpdate", "TokenLogprob"]

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.01
"""With nothing to run but requests waiting for their grammar, a step waits this long for one."""


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
    speculative: SpeculativeStats | None = None
    """Speculative decoding's counters; None when it is off."""
    taken_at: float = 0.0
    """When the engine took this snapshot (``time.time()``, one clock for every process of a
    machine): of two snapshots of one engine, the later one is its current state."""

    @property
    def prefix_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


class _FatalStepError(Exception):
    """A step failed past the point where it could be retried (state already advanced)."""


class EngineCore:
    """Owns the scheduler, KV manager, executor, sampler and the persistent batch.

    ``clock`` is the engine clock, seconds as a float: every request's ``arrival_time`` and
    ``first_scheduled_time`` (so queue times) come from it, and the scheduler reads it as
    ``SchedulerParams.clock``. The simulator passes its virtual clock; by default it is
    ``time.monotonic``.
    """

    def __init__(
        self,
        config: EngineConfig,
        registry: Registry,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        started = time.perf_counter()
        replicas = config["router"].settings.data_parallel_size
        if replicas > 1:
            raise ConfigError(
                f"{config.source}: [router] data_parallel_size = {replicas}: one engine (and "
                "LLM) is one replica; brigade serve and brigade generate run the replicas, each "
                'in its own process, and brigade bench with [executor] plugin = "simulated" '
                "simulates them: set it to 1 here"
            )
        self.config = config
        self.clock = clock
        """The engine clock (read it, do not replace it: the scheduler holds it too)."""
        self.hook = registry.hook
        self.checkpoint = open_model(config)
        # Cross-station rules and the model's config and tokenizer, before loading weights.
        check_config(config, registry, self.checkpoint)
        model = build_executor(config, registry, self.checkpoint)
        self.executor, self.model_dir = model.executor, model.model_dir
        self.draft_executors: list[Executor] = []
        """The executors of models loaded for the proposer (``ProposerParams.load_model``)."""
        try:
            self._build_stations(config, registry, model)
        except BaseException:
            # Executors may hold processes (tensor-parallel ranks) and devices: release them.
            for executor in (self.executor, *self.draft_executors):
                with contextlib.suppress(Exception):
                    executor.shutdown()
            raise
        self.pooler = Pooler()
        self._pending: list[StepUpdate] = []
        """Updates made outside a step's own rows (refused or failed requests), for its output."""
        self.dead: str | None = None
        """Why the engine can no longer step (None while it can)."""
        self.requests: dict[str, Request] = {}
        self._generators: dict[str, torch.Generator] = {}
        self.num_steps = 0
        self._forward_s = 0.0
        """The latest forward pass's duration (how long a step may wait for late masks)."""
        self._queue_time_total = 0.0
        self._num_scheduled = 0
        self.outputs = self._output_processor()
        """What becomes of each step's sampled tokens (``brigade.step_output``)."""
        torch.manual_seed(config["model"].settings.seed)
        self.load_time_s = time.perf_counter() - started
        """Seconds from the start of construction until the engine could run (weights, KV)."""
        if self.hook is not None:
            self.hook.brigade_engine_started(components=config.components)

    def _build_stations(self, config: EngineConfig, registry: Registry, model: ModelPath) -> None:
        """Everything around the loaded model (``brigade.engine_stations``)."""
        stations = build_stations(
            config,
            registry,
            model,
            clock=self.clock,
            load_model=functools.partial(self._load_draft_model, registry, model),
        )
        self.vocab_size = stations.vocab_size
        self.eos_token_ids = stations.eos_token_ids
        self.sampling_defaults = stations.sampling_defaults
        """Sampling parameters that requests leaving them unset get (the model's advice)."""
        self.max_model_len = stations.max_model_len
        self.kv = stations.kv
        self.scheduler = stations.scheduler
        self.device = stations.device
        self.sampler_name, self.sampler = stations.sampler_name, stations.sampler
        self._executor_returns_token_ids = stations.returns_token_ids
        self.processors = stations.processors
        self.grammar = stations.grammar
        """The structured-output station (None when the executor returns no logits)."""
        self.batch = stations.batch
        self.sampling = stations.sampling
        self.speculation = stations.speculation
        """Speculative decoding (``[speculative] plugin``); None when it is off."""

    def _output_processor(self) -> StepOutputProcessor:
        """The step output processor, over this engine's stations and requests."""
        return StepOutputProcessor(
            batch=self.batch,
            sampling=self.sampling,
            grammar=self.grammar,
            scheduler=self.scheduler,
            kv=self.kv,
            speculation=self.speculation,
            pooler=self.pooler,
            max_model_len=self.max_model_len,
            requests=self.requests,
            fail=self._fail,
            leave=self._leave,
            take_pending=self._take_pending,
        )

    def _load_draft_model(
        self, registry: Registry, served: ModelPath, path: str, **options: Any
    ) -> DraftModel:
        """``ProposerParams.load_model``: see ``brigade.assemble.load_draft_model``."""
        draft = load_draft_model(self.config, registry, served, path, **options)
        self.draft_executors.append(draft.executor)
        return draft

    def modelled_time_s(self) -> float:
        """Seconds every forward pass so far would have taken on the modelled hardware: the
        served model's and the models loaded for the proposer (executors with ``models_time``;
        the simulator's virtual clock advances by this)."""
        return self.executor.modelled_time_s() + sum(
            executor.modelled_time_s()
            for executor in self.draft_executors
            if type(executor).models_time
        )

    # -- requests -----------------------------------------------------------------------

    def admit(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        pooling: PoolingParams | None = None,
    ) -> Admission:
        """Check that the engine can serve this request and start compiling its grammar.

        The one admission of a prompt, whatever front end it comes from: it raises
        ``RequestError`` naming the field (``param``) when the request cannot be served, and
        a request it admits is never refused later for its prompt or its sampling
        parameters. Thread-safe (read-only but for the grammar compile, which runs on the
        grammar stage's pool), so the server admits on its event loop. Await or wait for
        ``grammar`` before answering to report an invalid grammar as the request's error.
        ``pooling`` makes it an embedding request (nothing is generated; ``params`` only need
        to be valid), which needs an executor with ``returns_hidden_states``.
        """
        check_request(
            prompt_token_ids, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len
        )
        if pooling is None:
            return Admission(list(prompt_token_ids), params, self._start_grammar(params))
        if not type(self.executor).returns_hidden_states:
            raise RequestError(
                f"embeddings are not available: the executor {self.config.plugin('executor')!r} "
                "returns no hidden states",
                param="input",
            )
        if params.structured_output is not None:
            raise RequestError(
                "an embedding request generates no text to constrain", param="structured_output"
            )
        return Admission(list(prompt_token_ids), params, None, pooling=pooling)

    def _start_grammar(self, params: SamplingParams) -> concurrent.futures.Future[Any] | None:
        if params.structured_output is None:
            return None
        if self.grammar is None:
            raise RequestError(
                "structured output is not available: this executor returns token ids, not logits",
                param="structured_output",
            )
        return self.grammar.prepare(params)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        admission: Admission | None = None,
        extra: Mapping[str, ExtraValue] | None = None,
    ) -> Request:
        """Queue a request; it runs from the next step on.

        ``admission`` is what :meth:`admit` returned for this prompt (for ``params``, or for
        the parameters of the prompt whose fan-out child this is): the request is then not
        checked again. Without it the request is admitted here (``RequestError`` when it
        cannot be served). ``extra`` is per-request data for plugins (``Request.extra``): str
        keys, JSON values. Its arrival time is on the engine clock.
        """
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in the engine")
        try:
            extra_data = freeze_extra(extra)
        except ValueError as exc:
            raise RequestError(str(exc), param="extra") from None
        if admission is None:
            admission = self.admit(prompt_token_ids, params)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=self.clock(),
            priority=priority,
            extra=extra_data,
            pooling=admission.pooling,
        )
        compiling = False
        if admission.grammar is not None:
            assert self.grammar is not None  # admit() refuses grammars without the station
            try:
                compiling = self.grammar.hold(request, admission.grammar)
            except ValueError as exc:
                raise RequestError(str(exc), param="structured_output") from None
        if params.seed is not None:
            generator = torch.Generator(self.device)
            generator.manual_seed(params.seed)
            self._generators[request_id] = generator
        self.requests[request_id] = request
        if not compiling:  # else queued once its grammar is compiled (_queue_compiled)
            error = self._queue(request)
            if error is not None:
                self._forget(request)
                raise RequestFailedError(error)
        return request

    def _queue(self, request: Request) -> str | None:
        """Hand ``request`` to the scheduler; why not, when the scheduler refuses it."""
        try:
            self.scheduler.add(request)
        except Exception as exc:
            try:  # it may hold the request half-added
                self.scheduler.abort(request.request_id)
            except Exception:
                logger.exception("the scheduler failed to drop request %s", request.request_id)
            return (
                f"the scheduler {self.config.plugin('scheduler')!r} failed to queue this "
                f"request: {describe(exc)}"
            )
        return None

    def abort_request(self, request_id: str) -> Request | None:
        """Stop a request wherever it is and free its pages; None if it is not here."""
        try:
            request = self.scheduler.abort(request_id)
        except Exception as exc:  # it is forgotten here all the same: nobody waits for it
            logger.error("the scheduler failed to abort request %s: %s", request_id, describe(exc))
            request = self.requests.get(request_id)
            if request is not None:
                request.status = RequestStatus.FINISHED_ABORTED
        if request is None:
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.WAITING_FOR_GRAMMAR:
                return None
            request.status = RequestStatus.FINISHED_ABORTED
        self._leave(request)
        return request

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._num_compiling() > 0

    def _num_compiling(self) -> int:
        return self.grammar.num_waiting if self.grammar is not None else 0

    def warm_up(self) -> None:
        """One-time set-up a server does before it takes requests, so that the first request
        needing it does not take it from the step loop (the grammar backend's)."""
        if self.grammar is not None:
            self.grammar.warm_up()

    def stats(self) -> EngineStats:
        """Scheduler and KV counters plus queue time, for policy comparisons."""
        scheduler, kv = self.scheduler.stats(), self.kv.stats()
        return EngineStats(
            num_steps=self.num_steps,
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting + self._num_compiling(),
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_free_pages=kv.num_free_pages,
            num_pages=kv.num_pages,
            mean_queue_time_s=self._queue_time_total / max(1, self._num_scheduled),
            speculative=None if self.speculation is None else self.speculation.stats(),
            taken_at=time.time(),
        )

    # -- the step -----------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepUpdate]:
        """Run one engine step; returns an update per request that got a token or finished.

        A failure that one request explains (a logits processor or the sampler raising for
        its row, an undefined sampling distribution, a processor refusing the request) fails
        that request alone: its update is finished and carries ``error``, and the others get
        the tokens they would have had alone. Any other failure (the scheduler, the forward
        pass) is retried once. When the retry fails too, or a failure leaves the step half
        done, the engine is dead: this call and every later one raise ``EngineDeadError``,
        and :attr:`dead` says why.
        """
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        try:
            return self._step()
        except _FatalStepError as fatal:
            raise self._die(str(fatal), fatal.__cause__) from fatal.__cause__
        except Exception as exc:
            logger.error("engine step failed; retrying it once: %s", describe(exc), exc_info=exc)
        try:
            return self._step()
        except Exception as exc:
            cause = exc.__cause__ if isinstance(exc, _FatalStepError) else exc
            reason = str(exc) if isinstance(exc, _FatalStepError) else describe(exc)
            raise self._die(f"the engine step failed twice in a row: {reason}", cause) from cause

    def _step(self) -> list[StepUpdate]:
        """schedule -> prepare -> execute -> sample -> process."""
        output = self._schedule()
        if output is None:
            return self._take_pending()
        plan = self.batch.prepare(output.scheduled, self.kv)
        if self.grammar is not None and self.grammar.is_active:
            self.grammar.settle(self._forward_s)  # quick masks finish before, not during, it
        started = time.perf_counter()
        result, hidden = self._execute(plan)
        self._forward_s = time.perf_counter() - started
        self.num_steps += 1
        sampled = self._sample(result, plan)
        try:  # tokens are being handed out: a retry would hand them out twice
            return self.outputs.process(output, plan, sampled, hidden)
        except Exception as exc:
            raise _FatalStepError(f"recording the step's tokens failed: {describe(exc)}") from exc

    def _schedule(self) -> SchedulerOutput | None:
        """The step's plan, every request in it holding a batch row; None when nothing runs
        (after a short wait when only grammars are compiling)."""
        if self._num_compiling():
            self._queue_compiled()
        if self.speculation is not None:
            self.speculation.propose(self.scheduler.running)
        output = self.scheduler.schedule()
        for request, exc in self.scheduler.take_refused():
            self._refuse_for_policy(request, exc)
        self._preempt(output.preempted)
        self._copy_swapped_pages(output)
        refused = self._seat(output.scheduled)
        if refused:
            output = without(output, refused)
        if not output.is_empty:
            return output
        if self.grammar is not None and not refused:  # only grammars compiling: no spin
            self.grammar.wait(GRAMMAR_WAIT_S)
        return None

    def _preempt(self, preempted: Sequence[Request]) -> None:
        """``preempted`` lost their pages: their drafts and batch rows go too."""
        if self.speculation is not None:
            self.speculation.retract(preempted)
        for request in preempted:
            if request in self.batch:
                self._release_row(request)

    def _seat(self, scheduled: Sequence[ScheduledRequest]) -> list[Request]:
        """Give every scheduled request a batch row; fail and return those that cannot
        have one."""
        refused = []
        for item in scheduled:
            if item.request not in self.batch:
                error = self._take_row(item.request)
                if error is not None:
                    self._fail(item.request, error)
                    refused.append(item.request)
        return refused

    def _execute(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward pass: the sampled rows' logits (or token ids), and the hidden states
        of the pooled rows when the plan has any (else None)."""
        if plan.model_input.hidden_indices is not None:
            return self.executor.execute_with_hidden_states(plan.model_input)
        return self.executor.execute(plan.model_input), None

    def _refuse_for_policy(self, request: Request, exc: Exception) -> None:
        """The scheduling policy raised because of this waiting request: fail it alone (the
        client's fault when the policy says so with ``RequestError``)."""
        reason = (
            f"the scheduler {self.config.plugin('scheduler')!r} failed for this request: "
            f"{describe(exc)}"
        )
        if isinstance(exc, RequestError):
            self._fail(request, str(exc), invalid=True, param=exc.param)
        else:
            self._fail(request, reason)

    def _copy_swapped_pages(self, output: SchedulerOutput) -> None:
        for copies in (output.swap_out, output.swap_in):  # out first: ins may reuse its pages
            if copies:
                sources, targets = zip(*copies, strict=True)
                try:
                    self.executor.copy_pages(sources, targets)
                except Exception as exc:  # the scheduler already counts these pages as moved
                    raise _FatalStepError(
                        f"copying swapped KV pages failed: {describe(exc)}"
                    ) from exc

    def _sample(self, result: torch.Tensor, plan: StepPlan) -> SampledTokens:
        """One token per logits row of the step (several per request verifying drafts)."""
        if not plan.sampled:
            return SampledTokens([], None, {})
        if self._executor_returns_token_ids:  # no logits: no processors, no sampler
            return SampledTokens(result.tolist(), None, {})
        # Recomputing reruns the same forward pass, which rewrites the same KV entries.
        return self.sampling.sample(
            result,
            plan.logits_rows,
            lambda: self.executor.execute(plan.model_input),
            () if self.speculation is None else self.speculation.draft_rows(plan),
            patience_s=SAMPLING_PATIENCE_S,
        )

    def _queue_compiled(self) -> None:
        """Queue the requests whose grammar is compiled; refuse those whose is invalid."""
        assert self.grammar is not None
        ready, refused = self.grammar.take_ready()
        for request in ready:
            error = self._queue(request)
            if error is not None:
                self._fail(request, error)
        for request, error in refused:
            logger.warning("request %s refused: %s", request.request_id, error)
            request.status = RequestStatus.FINISHED_ABORTED
            self._leave(request)
            self._pending.append(
                StepUpdate(
                    request,
                    [],
                    None,
                    True,
                    error=error,
                    invalid=True,
                    error_param="structured_output",
                )
            )

    def _take_pending(self) -> list[StepUpdate]:
        pending, self._pending = self._pending, []
        return pending

    def _fail(
        self, request: Request, error: str, *, invalid: bool = False, param: str | None = None
    ) -> None:
        """End ``request`` alone with ``error``; its update leaves with this step's.
        ``invalid``: the request itself is at fault (``param`` names the field)."""
        logger.error("request %s failed: %s", request.request_id, error)
        try:
            self.scheduler.abort(request.request_id)
            self.kv.free(request)  # a no-op when the scheduler freed it
        except Exception as exc:
            logger.error("dropping failed request %s: %s", request.request_id, describe(exc))
        request.status = RequestStatus.FINISHED_ABORTED
        self._leave(request)
        self._pending.append(
            StepUpdate(request, [], None, True, error=error, invalid=invalid, error_param=param)
        )

    def _die(self, reason: str, cause: BaseException | None) -> EngineDeadError:
        self.dead = reason
        logger.critical("the engine is dead: %s", reason, exc_info=cause)
        return EngineDeadError(reason)

    def _take_row(self, request: Request) -> str | None:
        """Give ``request`` a batch row; the reason when it cannot have one."""
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock()
            self._queue_time_total += request.first_scheduled_time - request.arrival_time
            self._num_scheduled += 1
        try:
            row = self.batch.assign(request, self._generators.get(request.request_id))
        except Exception as exc:
            return f"its sampling parameters could not be stored: {describe(exc)}"
        return self.sampling.add(row, request)

    def _release_row(self, request: Request) -> None:
        row = self.batch.release(request)
        self.sampling.remove(row, request)

    def _leave(self, request: Request) -> None:
        """A request is done (finished, aborted or failed): forget it everywhere."""
        if request in self.batch:
            self._release_row(request)
        if self.speculation is not None:
            self.speculation.remove(request)
        self._forget(request)
        if self.hook is not None:
            notify_request_finished(self.hook, request)
        if request.pooling is not None:
            self.pooler.drop(request)

    def _forget(self, request: Request) -> None:
        self.requests.pop(request.request_id, None)
        self._generators.pop(request.request_id, None)
        if self.grammar is not None:
            self.grammar.drop(request)
