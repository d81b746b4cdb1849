"""One constrained request's matcher, driven off the engine's step thread, within a budget.

A grammar matcher's work per token is not bounded by the grammar's size: an ambiguous grammar
such as the regex ``(.{0,100}){0,100}zz`` makes every mask, and every accepted token, several
times dearer than the last. So core never calls a matcher on the step thread: each call runs
as a job of the request's :class:`GrammarLane` on a shared thread pool (XGrammar releases the
GIL while it works), one job at a time per request, and the step thread waits for a job only
within a bound. A job that runs longer than the mask budget fails its request alone; its
matcher is abandoned, never touched again (the thread finishes the call on its own: nothing
can interrupt native code), so every other request keeps its pace.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from brigade.errors import describe
from brigade.interfaces import GrammarMatcher, Request

__all__ = ["GrammarLane", "LanePool", "over_budget"]


def over_budget(budget_s: float) -> str:
    """The error of a request whose grammar work overran the budget (its client's fault)."""
    return (
        f"structured output: computing this request's grammar mask took longer than [grammar] "
        f"mask_budget_ms = {budget_s * 1000:g}: the grammar is too ambiguous to enforce token "
        "by token (e.g. nested repetitions such as (.{0,100}){0,100}); simplify it"
    )


class GrammarLane:
    """One request's matcher, its private mask row and the job running on it.

    Only the lane's job touches the matcher; the step thread reads the results once
    :attr:`busy` is False. ``mask`` is private (``[1, ceil(vocab / 32)]``) so that a job
    abandoned past the budget can still write into it harmlessly.
    """

    __slots__ = (
        "_job",
        "_started",
        "ended",
        "failure",
        "mask",
        "mask_ready",
        "matcher",
        "over_budget",
        "rejected",
        "request",
        "terminated",
    )

    def __init__(self, request: Request, matcher: GrammarMatcher, num_words: int) -> None:
        self.request = request
        self.matcher = matcher
        self.mask = torch.full((1, num_words), -1, dtype=torch.int32)
        self.mask_ready = False
        """``mask`` holds what the matcher allows next (valid until the next job)."""
        self.terminated = False
        """The grammar ended with the last accepted token: only a stop token may follow."""
        self.rejected = False
        """The grammar refused a token it was given (only possible if a stage ignored it)."""
        self.ended = False
        """The request's own tokens (not drafts being tried) ended its grammar, or one was
        refused: the request is over."""
        self.failure: str | None = None
        """Why the lane can go no further (over budget, or the backend raised)."""
        self.over_budget = False
        """The failure is a job that ran past the budget."""
        self._job: concurrent.futures.Future[None] | None = None
        self._started: float | None = None

    @property
    def busy(self) -> bool:
        """A job is queued or running (results are not to be read yet)."""
        return self._job is not None and not self._job.done()

    @property
    def usable(self) -> bool:
        """Neither failed nor over: its matcher may be called."""
        return self.failure is None and not self.ended

    def deadline(self, budget_s: float, now: float) -> float:
        """When the running job overruns the budget (a queued one has not started: later)."""
        started = self._started
        return (now if started is None else started) + budget_s

    def fail(self, reason: str) -> None:
        """Abandon the lane: its job may go on running, nobody reads it any more."""
        if self.failure is None:
            self.failure = reason
        self.mask_ready = False

    def fail_over_budget(self, budget_s: float) -> None:
        if self.failure is None:
            self.over_budget = True
        self.fail(over_budget(budget_s))

    # -- jobs (each a sequence of matcher calls) ------------------------------------------

    def submit(self, pool: LanePool, work: Callable[[], None]) -> None:
        """Run ``work`` as the lane's next job (the previous one is done)."""
        self.mask_ready = False
        self._started = None
        self._job = pool.submit(self._run, work)

    def advance(self, pool: LanePool, tokens: Sequence[int], *, final: bool) -> None:
        """Accept ``tokens``, see whether the grammar ended, then fill the next mask.

        ``final``: the tokens are the request's own, taken without waiting; a refused token
        or an ended grammar then ends the request (:attr:`ended`). Otherwise (a caller that
        waits for the answer, or drafts being tried) only :attr:`rejected` and
        :attr:`terminated` say so, and an ended grammar's mask allows only stop tokens."""
        tokens = list(tokens)
        self.terminated = self.rejected = False

        def work() -> None:
            matcher = self.matcher
            for token in tokens:
                if not matcher.accept(token):
                    self.rejected = True
                    self.ended = final
                    return
            self.terminated = matcher.is_terminated()
            if self.terminated and final:
                self.ended = True
            else:
                self._fill()

        self.submit(pool, work)

    def replay(self, pool: LanePool, tokens: Sequence[int]) -> None:
        """A new matcher catches up with tokens already emitted, then fills its first mask."""
        tokens = list(tokens)

        def work() -> None:
            for token in tokens:
                if not self.matcher.accept(token):
                    raise RuntimeError(f"emitted token {token} does not match its grammar")
            self._fill()

        self.submit(pool, work)

    def refill(self, pool: LanePool) -> None:
        self.submit(pool, self._fill)

    def rollback(self, pool: LanePool, num_tokens: int) -> None:
        def work() -> None:
            self.matcher.rollback(num_tokens)

        self.terminated = self.rejected = False
        self.submit(pool, work)

    def _fill(self) -> None:
        self.matcher.fill_bitmask(self.mask, 0)
        self.mask_ready = True

    def _run(self, work: Callable[[], None]) -> None:
        self._started = time.monotonic()
        try:
            work()
        except Exception as exc:  # reported as the request's failure, read by the step
            self.fail(f"the grammar backend failed for this request: {describe(exc)}")


class LanePool:
    """The threads that run every lane's jobs, and the budget they are held to."""

    def __init__(self, budget_s: float, num_threads: int) -> None:
        self.budget_s = budget_s
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=num_threads, thread_name_prefix="brigade-grammar-mask"
        )

    def submit(
        self, fn: Callable[[Callable[[], None]], None], work: Callable[[], None]
    ) -> concurrent.futures.Future[None]:
        return self._pool.submit(fn, work)

    def settle(self, lanes: Iterable[GrammarLane], patience_s: float | None) -> None:
        """Wait until no lane among ``lanes`` is busy, for at most ``patience_s`` seconds
        (None: as long as the budget allows); a lane whose job runs past the budget
        meanwhile is failed. With ``patience_s`` None a lane still busy at the end (its job
        never started: the threads were taken) is failed too."""
        busy = [lane for lane in lanes if lane.busy and lane.failure is None]
        start = time.monotonic()
        limit = start + (self.budget_s if patience_s is None else patience_s)
        while busy:
            now = time.monotonic()
            still = []
            for lane in busy:
                if not lane.busy:
                    continue
                if now >= lane.deadline(self.budget_s, start):
                    lane.fail_over_budget(self.budget_s)
                else:
                    still.append(lane)
            busy = still
            if not busy:
                return
            if now >= limit:
                break
            wake = min(min(lane.deadline(self.budget_s, start) for lane in busy), limit)
            jobs = [lane._job for lane in busy if lane._job is not None]
            concurrent.futures.wait(
                jobs, timeout=max(wake - now, 0.0), return_when=concurrent.futures.FIRST_COMPLETED
            )
        if patience_s is None:
            for lane in busy:
                if lane.busy:
                    lane.fail_over_budget(self.budget_s)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
