"""Plugins that fail on purpose, for the fault-isolation tests.

A request is "poisoned" by its priority: the ``faulty`` sampler's processor fails for the rows
of requests whose priority is in :data:`POISON` (in the lifecycle method it maps to, once
the request has ``fail_after_tokens`` output tokens; ``nan_logits`` makes the row's logits NaN
instead of raising) and never returns from ``apply`` for requests with priority :data:`HANG`
(a hung step, from the same token on) and sleeps ``slow_step_s`` once in ``apply`` for a
request with priority :data:`SLOW` (a long step that ends); the ``faulty`` scheduler fails to
add requests with priority ``fail_add_priority``, fails ``peek`` while a request with priority
``fail_peek_priority`` heads its queue, and fails ``schedule`` while a request with
priority ``fail_schedule_priority`` is queued, ``fail_schedule_times`` times at most; the
``brigade_request_finished`` hook raises for every request when ``FAULTY_HOOK`` is set in the
environment, else for requests with priority :data:`HOOK_POISON`.

The same processor is registered as the ``faulty`` logits_processor, for engines that
configure it (``[sampler] logits_processors = ["faulty"]``) next to an unchanged sampler.

In-process tests register this module with ``load_registry(plugins=[faulty_plugins])``; a
server subprocess finds it through the entry point that :func:`install_entry_point` writes.

:class:`FieldBlindSampler` and the misordered samplers below are wrong on purpose too: the
conformance kit must fail them, naming what they get wrong.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from brigade.interfaces import (
    LogitsProcessor,
    Request,
    SampleOutput,
    SamplerParams,
    SamplingBatch,
    SamplingParams,
    SchedulerView,
    hookimpl,
    option,
)
from brigade.plugins.samplers.processors import (
    LogitBiasProcessor,
    MinTokensProcessor,
    PenaltiesProcessor,
)
from brigade.plugins.samplers.standard import StandardSampler, StandardSamplerOptions
from brigade.plugins.schedulers.fcfs import FcfsOptions, FcfsPolicy

POISON = {"add": 21, "begin_step": 22, "apply": 23, "accept": 24, "nan_logits": 25}
"""Priority of a request the faulty processor fails for, by where it fails."""
HOOK_POISON = 17
"""Priority of a request whose finished hook raises."""
HANG = 26
"""Priority of a request whose step never ends (the faulty processor sleeps in ``apply``)."""
SLOW = 27
"""Priority of a request whose step takes ``slow_step_s`` once, then runs on."""


@dataclasses.dataclass(frozen=True)
class FaultySamplerOptions:
    fail_after_tokens: int = option(0, help="output tokens before it fails", ge=0)
    slow_step_s: float = option(0.0, help="how long a SLOW request's step sleeps, once", ge=0)


class FaultyProcessor(LogitsProcessor):
    """Fails for poisoned rows."""

    def __init__(self, fail_after_tokens: int, slow_step_s: float = 0.0) -> None:
        self.fail_after_tokens = fail_after_tokens
        self.slow_step_s = slow_step_s
        self.poisoned: dict[int, tuple[str, Request]] = {}

    def _due(self, row: int, where: str) -> bool:
        mode, request = self.poisoned.get(row, ("", None))
        return (
            mode == where
            and request is not None
            and request.num_output_tokens >= self.fail_after_tokens
        )

    def add(self, row: int, request: Request) -> None:
        modes = {**POISON, "hang": HANG, "slow": SLOW}
        mode = next((m for m, priority in modes.items() if priority == request.priority), None)
        if mode is None:
            return
        if mode == "add":
            raise ValueError(f"poisoned request {request.request_id}")
        self.poisoned[row] = (mode, request)

    def remove(self, row: int) -> None:
        self.poisoned.pop(row, None)

    @property
    def is_active(self) -> bool:
        return bool(self.poisoned)

    def begin_step(self, rows: Sequence[int]) -> None:
        if any(self._due(row, "begin_step") for row in rows):
            raise RuntimeError("poisoned row in begin_step")

    def apply(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        row_list = rows.tolist()
        if any(self._due(row, "apply") for row in row_list):
            logits.mul_(-1.0)  # edits in place first (flips argmaxes): the retry must not see it
            raise ValueError("poisoned row in apply")
        if any(self._due(row, "hang") for row in row_list):
            while True:  # alive, never done (sleeping: a thread-mode watchdog can still run)
                time.sleep(0.05)
        slow = [row for row in row_list if self._due(row, "slow")]
        if slow:
            for row in slow:  # once: the request runs on at its usual pace afterwards
                del self.poisoned[row]
            time.sleep(self.slow_step_s)
        undefined = [index for index, row in enumerate(row_list) if self._due(row, "nan_logits")]
        if undefined:
            logits[undefined] = float("nan")
        return logits

    def accept_batch(self, rows: Sequence[int], token_ids: Sequence[int]) -> None:
        if any(self._due(row, "accept") for row in rows):
            raise ValueError("poisoned row in accept")


def faulty_processor(params: SamplerParams, options: FaultySamplerOptions) -> FaultyProcessor:
    """The ``faulty`` logits_processor component."""
    return FaultyProcessor(options.fail_after_tokens, options.slow_step_s)


class FaultySampler(StandardSampler):
    def __init__(self, params: SamplerParams, options: FaultySamplerOptions) -> None:
        super().__init__(params, StandardSamplerOptions())
        faulty = FaultyProcessor(options.fail_after_tokens, options.slow_step_s)
        self._processors = (*self._processors, faulty)


@dataclasses.dataclass(frozen=True)
class FaultySchedulerOptions:
    fail_add_priority: int = option(-1, help="add() raises for this priority")
    fail_schedule_priority: int = option(-1, help="schedule() raises while one is queued")
    fail_schedule_times: int = option(1000, help="at most this many times", ge=0)
    fail_peek_priority: int = option(-1, help="peek() raises while one is at the queue's head")


class FaultyPolicy(FcfsPolicy):
    """FCFS that refuses to queue one priority and breaks the step while another is queued."""

    def __init__(self, view: SchedulerView, options: FaultySchedulerOptions) -> None:
        super().__init__(view, FcfsOptions())
        self.faults = options
        self.num_failures = 0

    def enqueue(self, request: Request, *, preempted: bool) -> None:
        if request.priority == self.faults.fail_add_priority:
            raise RuntimeError("this scheduler refuses the request")
        super().enqueue(request, preempted=preempted)

    def peek(self) -> Request | None:
        head = super().peek()
        if head is not None and head.priority == self.faults.fail_peek_priority:
            raise KeyError(f"no deadline for {head.request_id}")
        return head

    def order_running(self, running: list[Request]) -> None:
        wanted = self.faults.fail_schedule_priority
        if self.num_failures < self.faults.fail_schedule_times and any(
            request.priority == wanted for request in (*running, *self.queue)
        ):
            self.num_failures += 1
            raise RuntimeError("the scheduler broke")


BATCH_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed")
"""Sampling fields that reach the sampler in its ``SamplingBatch``."""
REQUEST_FIELDS = (
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
)
"""Sampling fields that reach the sampler's chain through the request."""


@dataclasses.dataclass(frozen=True)
class FieldBlindOptions:
    field: str = option(
        "temperature",
        help="the field it ignores",
        choices=(*BATCH_FIELDS, *REQUEST_FIELDS, "logits_processors"),
    )


class _FieldBlindStage(LogitsProcessor):
    """``stage``, seeing every request with ``field`` reset to its default."""

    def __init__(self, stage: LogitsProcessor, field: str) -> None:
        self.stage = stage
        self.field = field

    def add(self, row: int, request: Request) -> None:
        default = getattr(SamplingParams(), self.field)
        sampling = dataclasses.replace(request.sampling_params, **{self.field: default})
        self.stage.add(row, dataclasses.replace(request, sampling_params=sampling))

    def remove(self, row: int) -> None:
        self.stage.remove(row)

    @property
    def is_active(self) -> bool:
        return self.stage.is_active

    def apply(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self.stage.apply(logits, rows)

    def accept_batch(self, rows: Sequence[int], token_ids: Sequence[int]) -> None:
        if self.stage.needs_tokens:
            self.stage.accept_batch(rows, token_ids)


class FieldBlindSampler(StandardSampler):
    """The standard sampler, blind to one sampling field (or to the configured processors)."""

    def __init__(self, params: SamplerParams, options: FieldBlindOptions) -> None:
        self.field = options.field
        if self.field == "logits_processors":
            params = dataclasses.replace(params, logits_processors=())
        super().__init__(params, StandardSamplerOptions())
        if self.field in REQUEST_FIELDS:  # its own stages go blind, the configured ones not
            self._processors = tuple(
                stage if stage in params.logits_processors else _FieldBlindStage(stage, self.field)
                for stage in self._processors
            )

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        blind = {
            "temperature": {"temperature": (batch.temperature > 0).float()},  # T is 0 or 1
            "top_k": {"any_top_k": False},
            "top_p": {"any_top_p": False},
            "min_p": {"any_min_p": False},
            "seed": {"generators": {}},
        }.get(self.field, {})
        return super().sample(logits, dataclasses.replace(batch, **blind))


class MinTokensFirstSampler(StandardSampler):
    """Masks min_tokens' stop ids before the configured processors (so they can undo it)."""

    def __init__(self, params: SamplerParams, options: StandardSamplerOptions) -> None:
        super().__init__(params, options)
        self._processors = (
            MinTokensProcessor(params),
            LogitBiasProcessor(params),
            PenaltiesProcessor(params),
            *params.logits_processors,
        )


class ProcessorsFirstSampler(StandardSampler):
    """Runs the configured processors before the request's own bias and penalties."""

    def __init__(self, params: SamplerParams, options: StandardSamplerOptions) -> None:
        super().__init__(params, options)
        self._processors = (
            *params.logits_processors,
            LogitBiasProcessor(params),
            PenaltiesProcessor(params),
            MinTokensProcessor(params),
        )


@hookimpl
def brigade_register(registry: Any) -> None:
    registry.add("sampler", "faulty", FaultySampler, options=FaultySamplerOptions)
    registry.add("logits_processor", "faulty", faulty_processor, options=FaultySamplerOptions)
    registry.add("scheduler", "faulty", FaultyPolicy, options=FaultySchedulerOptions)


@hookimpl
def brigade_request_finished(request: Request) -> None:
    if os.environ.get("FAULTY_HOOK") or request.priority == HOOK_POISON:
        raise RuntimeError(f"the audit hook broke on {request.request_id}")


def install_entry_point(root: Path) -> dict[str, str]:
    """Make this module a ``brigade`` entry point for subprocesses; returns their env."""
    info = root / "faulty_plugins-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: faulty-plugins\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[brigade]\nfaulty = faulty_plugins\n")
    tests = Path(__file__).resolve().parent
    path = os.pathsep.join(p for p in (str(root), str(tests), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}
