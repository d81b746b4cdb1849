"""Plugins that fail on purpose, for the fault-isolation tests.

A request is "poisoned" by its priority: the ``faulty`` sampler's processor fails for the rows
of requests whose priority is in :data:`POISON` (in the lifecycle method it maps to, once
the request has ``fail_after_tokens`` output tokens; ``nan_logits`` makes the row's logits NaN
instead of raising); the ``faulty`` scheduler fails to
add requests with priority ``fail_add_priority`` and fails ``schedule`` while a request with
priority ``fail_schedule_priority`` is queued, ``fail_schedule_times`` times at most; the
``brigade_request_finished`` hook raises for every request when ``FAULTY_HOOK`` is set in the
environment, else for requests with priority :data:`HOOK_POISON`.

In-process tests register this module with ``load_registry(plugins=[faulty_plugins])``; a
server subprocess finds it through the entry point that :func:`install_entry_point` writes.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from brigade.interfaces import (
    KVManager,
    LogitsProcessor,
    Request,
    SamplerParams,
    SchedulerOutput,
    SchedulerParams,
    hookimpl,
    option,
)
from brigade.plugins.samplers.standard import StandardSampler, StandardSamplerOptions
from brigade.scheduling import BatchScheduler

POISON = {"add": 21, "begin_step": 22, "apply": 23, "accept": 24, "nan_logits": 25}
"""Priority of a request the faulty processor fails for, by where it fails."""
HOOK_POISON = 17
"""Priority of a request whose finished hook raises."""


@dataclasses.dataclass(frozen=True)
class FaultySamplerOptions:
    fail_after_tokens: int = option(0, help="output tokens before it fails", ge=0)


class FaultyProcessor(LogitsProcessor):
    """Fails for poisoned rows."""

    def __init__(self, fail_after_tokens: int) -> None:
        self.fail_after_tokens = fail_after_tokens
        self.poisoned: dict[int, tuple[str, Request]] = {}

    def _due(self, row: int, where: str) -> bool:
        mode, request = self.poisoned.get(row, ("", None))
        return (
            mode == where
            and request is not None
            and request.num_output_tokens >= self.fail_after_tokens
        )

    def add(self, row: int, request: Request) -> None:
        mode = next((m for m, priority in POISON.items() if priority == request.priority), None)
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
        undefined = [index for index, row in enumerate(row_list) if self._due(row, "nan_logits")]
        if undefined:
            logits[undefined] = float("nan")
        return logits

    def accept_batch(self, rows: Sequence[int], token_ids: Sequence[int]) -> None:
        if any(self._due(row, "accept") for row in rows):
            raise ValueError("poisoned row in accept")


class FaultySampler(StandardSampler):
    def __init__(self, params: SamplerParams, options: FaultySamplerOptions) -> None:
        super().__init__(params, StandardSamplerOptions())
        faulty = FaultyProcessor(options.fail_after_tokens)
        self._processors = (*self._processors, faulty)


@dataclasses.dataclass(frozen=True)
class FaultySchedulerOptions:
    fail_add_priority: int = option(-1, help="add() raises for this priority")
    fail_schedule_priority: int = option(-1, help="schedule() raises while one is queued")
    fail_schedule_times: int = option(1000, help="at most this many times", ge=0)


class FaultyScheduler(BatchScheduler):
    def __init__(
        self, params: SchedulerParams, kv: KVManager, options: FaultySchedulerOptions
    ) -> None:
        super().__init__(params, kv)
        self.options = options
        self.num_failures = 0

    def add(self, request: Request) -> None:
        if request.priority == self.options.fail_add_priority:
            raise RuntimeError("this scheduler refuses the request")
        super().add(request)

    def schedule(self) -> SchedulerOutput:
        wanted = self.options.fail_schedule_priority
        queued = [*self.running, *self.waiting]
        if self.num_failures < self.options.fail_schedule_times and any(
            request.priority == wanted for request in queued
        ):
            self.num_failures += 1
            raise RuntimeError("the scheduler broke")
        return super().schedule()


@hookimpl
def brigade_register(registry: Any) -> None:
    registry.add("sampler", "faulty", FaultySampler, options=FaultySamplerOptions)
    registry.add("scheduler", "faulty", FaultyScheduler, options=FaultySchedulerOptions)


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
