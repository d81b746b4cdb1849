"""The host-page pool of swap preemption: where a victim's KV waits until it runs again.

The KV side of ``[scheduler] preemption = "swap"``: the scheduler asks :meth:`swap_out` when it
preempts, :meth:`swap_in` when it readmits, and core copies the planned pages before the
step runs (``SchedulerOutput.swap_out`` then ``swap_in``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["SwapSpace"]


class SwapSpace:
    """Host page ids (see ``Executor.initialize_kv_cache``) and the copies planned this step."""

    def __init__(self, host_pages: Iterable[int]) -> None:
        self._free: list[int] = list(host_pages)
        self._released: list[int] = []
        """Freed by this step's swap-ins: reusable once their copies have run (next step)."""
        self._swapped: dict[str, list[int]] = {}
        self.planned_out: list[tuple[int, int]] = []
        """(device page, host page) copies of this step."""
        self.planned_in: list[tuple[int, int]] = []
        """(host page, device page) copies of this step, made after ``planned_out``."""
        self.num_swapped_out = 0
        self.num_swapped_in = 0

    def begin_step(self) -> None:
        """Start planning a step: last step's copies ran, so their host pages are free."""
        self._free.extend(self._released)
        self._released.clear()
        self.planned_out, self.planned_in = [], []

    def swap_out(self, request_id: str, device_pages: Sequence[int]) -> bool:
        """Plan copying a victim's pages to the host; False (nothing planned) if they do not
        fit, and the victim recomputes instead."""
        if not device_pages or len(device_pages) > len(self._free):
            return False
        host = [self._free.pop() for _ in device_pages]
        self.planned_out.extend(zip(device_pages, host, strict=True))
        self._swapped[request_id] = host
        self.num_swapped_out += 1
        return True

    def swap_in(self, request_id: str, device_pages: Sequence[int]) -> None:
        """Plan copying a swapped request's KV back into the pages it was just given (its
        first pages cover every computed token); a no-op for a request not swapped out."""
        host = self._swapped.pop(request_id, None)
        if host is None:
            return
        self.planned_in.extend(zip(host, device_pages, strict=False))
        self._released.extend(host)
        self.num_swapped_in += 1

    def drop(self, request_id: str) -> None:
        """Forget an aborted request's host copy."""
        self._released.extend(self._swapped.pop(request_id, ()))
