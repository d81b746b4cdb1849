"""First come, first served: the base mechanics with their default ordering."""

from __future__ import annotations

import dataclasses

from brigade.interfaces import KVManager, SchedulerParams
from brigade.scheduling import BatchScheduler

__all__ = ["FcfsOptions", "FcfsScheduler"]


@dataclasses.dataclass(frozen=True)
class FcfsOptions:
    """FCFS takes no options of its own (limits live in the ``[scheduler]`` table)."""


class FcfsScheduler(BatchScheduler):
    """Admits in arrival order; preempts the latest-admitted request when pages run out."""

    def __init__(self, params: SchedulerParams, kv: KVManager, options: FcfsOptions) -> None:
        super().__init__(params, kv)
        self.options = options
