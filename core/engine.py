"""The engine core: one step = schedule, build the batch, execute, sample, account.

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
    SchedulerOutput,
    freeze_extra,
)
from brigade.persistent_batch import StepPlan
from brigade.pooling import Pooler
from brigade.registry import Registry
from brigade.sampling_stage import DraftRows, SampledTokens, TokenLogprob
from brigade.speculative import SpeculativeStats, Verified
from brigade.step_tokens import (
    accepted_plan,
    asked,
    held_back,
    record_tokens,
    verify_drafts,
    without,
)

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


@dataclasses.dataclass(frozen=True, slots=True)
class StepUpdate:
    """What one step did for one request."""

    request: Request
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finished: bool
    error: str | None = None
    """Why the request ended without an answer: refused after it was queued (its grammar
    failed to compile; ``invalid``) or failed on its own while it ran (a plugin raised for it,
    its sampling distribution was undefined). Other requests are not affected."""
    invalid: bool = False
    """True when the request itself is at fault (it cannot succeed as sent)."""
    error_param: str | None = None
    """The request field an ``invalid`` error is about (``structured_output``), if known."""
    embedding: list[float] | None = None
    """An embedding request's vector, on its last update (``Request.pooling``)."""


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
        if self._num_compiling():
            self._queue_compiled()
        if self.speculation is not None:
            self.speculation.propose(self.scheduler.running)
        output = self.scheduler.schedule()
        for request, exc in self.scheduler.take_refused():
            self._refuse_for_policy(request, exc)
        for request in output.preempted:
            request.draft_token_ids = []
            if request in self.batch:
                self._release_row(request)
        self._copy_swapped_pages(output)
        refused = []
        for item in output.scheduled:
            if item.request not in self.batch:
                error = self._take_row(item.request)
                if error is not None:
                    self._fail(item.request, error)
                    refused.append(item.request)
        if refused:
            output = without(output, refused)
        if output.is_empty:
            if self.grammar is not None and not refused:  # only grammars compiling: no spin
                self.grammar.wait(GRAMMAR_WAIT_S)
            return self._take_pending()
        plan = self.batch.prepare(output.scheduled, self.kv)
        hidden: torch.Tensor | None = None
        if self.grammar is not None and self.grammar.is_active:
            self.grammar.settle(self._forward_s)  # quick masks finish before, not during, it
        started = time.perf_counter()
        if plan.model_input.hidden_indices is not None:
            result, hidden = self.executor.execute_with_hidden_states(plan.model_input)
        else:
            result = self.executor.execute(plan.model_input)
        self._forward_s = time.perf_counter() - started
        self.num_steps += 1
        sampled = self._sample(result, plan, SAMPLING_PATIENCE_S)
        try:  # tokens are being handed out: a retry would hand them out twice
            return self._account(output, plan, sampled, hidden)
        except Exception as exc:
            raise _FatalStepError(f"recording the step's tokens failed: {describe(exc)}") from exc

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

    def _sample(self, result: torch.Tensor, plan: StepPlan, patience_s: float) -> SampledTokens:
        if not plan.sampled:
            return SampledTokens([], None, {})
        if self._executor_returns_token_ids:  # no logits: no processors, no sampler
            return SampledTokens(result.tolist(), None, {})
        drafts: list[DraftRows] = []
        if plan.draft_counts:
            for request, row, count, offset in zip(
                plan.sampled, plan.sampled_rows, plan.draft_counts, plan.logits_offsets, strict=True
            ):
                if count:
                    drafts.append(DraftRows(request, row, offset, request.draft_token_ids[:count]))
        # Recomputing reruns the same forward pass, which rewrites the same KV entries.
        return self.sampling.sample(
            result,
            plan.logits_rows,
            lambda: self.executor.execute(plan.model_input),
            drafts,
            patience_s=patience_s,
        )

    def _account(
        self,
        output: SchedulerOutput,
        plan: StepPlan,
        sampled: SampledTokens,
        hidden: torch.Tensor | None,
    ) -> list[StepUpdate]:
        """Append the sampled tokens, pool the embeddings, finish requests, tell the scheduler
        and the KV manager."""
        requests, rows = plan.sampled, plan.sampled_rows
        verified: list[Verified] | None = None
        if plan.draft_counts:
            tokens, logprobs, failures, verified = verify_drafts(plan, sampled)
        else:
            tokens = [[token] for token in sampled.token_ids]
            logprobs = None if sampled.logprobs is None else [[lp] for lp in sampled.logprobs]
            failures = sampled.failures
        failed = {requests[index]: error for index, error in failures.items()}
        invalid: set[Request] = set()
        """Failed requests that caused their failure (their grammar overran its budget)."""
        updates: list[StepUpdate] = []
        finished: list[Request] = []
        if plan.pooled:
            self._pool(plan, hidden, updates, finished, failed)
        late = self._skipped_requests(plan, sampled)
        for request, error in self._grammar_ended():
            late.add(request)
            if error is None:  # its grammar ended with its previous token
                request.status = RequestStatus.FINISHED_STOPPED
                finished.append(request)
                updates.append(StepUpdate(request, [], None, True))
            else:
                failed[request] = error
                invalid.add(request)
        if failed or late:  # rare: take the failed and skipped rows out of the step
            keep = [
                i
                for i, request in enumerate(requests)
                if i not in failures and request not in failed and request not in late
            ]
            requests = tuple(requests[i] for i in keep)
            rows, tokens = [rows[i] for i in keep], [tokens[i] for i in keep]
            logprobs = None if logprobs is None else [logprobs[i] for i in keep]
            verified = None if verified is None else [verified[i] for i in keep]
        if requests:
            rejected, complete = record_tokens(
                self.batch, self.sampling, self.grammar, requests, rows, tokens
            )
            for request, error in self._grammar_ended():  # failed accepting several tokens
                if error is not None:
                    rejected[requests.index(request)] = error
                    invalid.add(request)
            for index, (request, new) in enumerate(zip(requests, tokens, strict=True)):
                if index in rejected:
                    failed[request] = rejected[index]
                    continue
                complete_after = complete.get(index)
                if complete_after is not None:
                    new = new[:complete_after]
                status = None
                emitted = 0
                for token in new:  # several with accepted drafts; a stop ends them
                    request.output_token_ids.append(token)
                    emitted += 1
                    status = self._finish_status(request, token)
                    if status is not None:
                        break
                if status is None and complete_after is not None:
                    status = RequestStatus.FINISHED_STOPPED
                if status is not None:
                    request.status = status
                    finished.append(request)
                updates.append(
                    StepUpdate(
                        request,
                        new if emitted == len(new) else new[:emitted],
                        asked(logprobs[index][:emitted]) if logprobs is not None else None,
                        status is not None,
                    )
                )
        if verified is not None:
            assert self.speculation is not None
            output = accepted_plan(self.speculation, output, requests, verified, failed)
        if late:
            output = held_back(output, late)
        for request, error in failed.items():
            if request in invalid:
                self._fail(request, error, invalid=True, param="structured_output")
            else:
                self._fail(request, error)
        if failed:
            output = without(output, failed)
        self.scheduler.update(output, finished)
        for item in output.scheduled:
            self.kv.commit(item.request)
        for request in finished:
            self.kv.free(request)
            self._leave(request)
        pending = self._take_pending()
        if not pending:
            return updates
        pending.extend(updates)
        return pending

    def _skipped_requests(self, plan: StepPlan, sampled: SampledTokens) -> set[Request]:
        """The sampled requests whose logits row the sampling stage skipped (a late mask)."""
        if not sampled.skipped:
            return set()
        return {
            request
            for request, offset in zip(plan.sampled, plan.logits_offsets, strict=True)
            if offset in sampled.skipped
        }

    def _grammar_ended(self) -> list[tuple[Request, str | None]]:
        """Requests whose grammar ended (None) or failed (why) since the last call, among
        those still in the engine."""
        if self.grammar is None:
            return []
        return [
            (request, error)
            for request, error in self.grammar.take_ended()
            if self.requests.get(request.request_id) is request
        ]

    def _pool(
        self,
        plan: StepPlan,
        hidden: torch.Tensor | None,
        updates: list[StepUpdate],
        finished: list[Request],
        failed: dict[Request, str],
    ) -> None:
        """Hand each embedding request its hidden rows; finish those whose prompt ended."""
        offset = 0
        for chunk in plan.pooled:
            rows = offset
            offset += chunk.num_rows
            request = chunk.request
            error = self.pooler.check(chunk)
            if error is not None:
                failed[request] = error
                continue
            if not chunk.num_rows:
                continue
            assert hidden is not None  # the plan had hidden rows
            vector = self.pooler.add(chunk, hidden[rows : rows + chunk.num_rows])
            if vector is not None:
                request.status = RequestStatus.FINISHED_STOPPED
                finished.append(request)
                updates.append(StepUpdate(request, [], None, True, embedding=vector))

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
