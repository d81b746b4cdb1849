"""Data parallel serving: several engine replicas behind the router station.

``ReplicatedEngine`` looks to the HTTP handlers like one engine (the ``RequestStreams``
seam: ``admit``, ``generate``, ``abort``, ``check_capacity``, ``info``, ``snapshot``,
``dead``...) over N of them, each an ``EngineClient`` of its own engine process. Each new
request goes to the replica the router picks from every live replica's load as of its latest
step; the router hears when the request ends. A replica that dies is taken out of rotation:
its in-flight requests end with its error, the others keep serving, and only when every
replica has died does the whole engine count as dead (``on_dead``), so the server exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence

import structlog

from brigade.admission import Admission
from brigade.engine import EngineStats, StepUpdate
from brigade.interfaces import (
    EMPTY_EXTRA,
    ExtraValue,
    PoolingParams,
    ReplicaLoad,
    Router,
    SamplingParams,
)
from brigade.server.errors import EngineOverloadedError, EngineUnavailableError
from brigade.server.request_streams import RequestStreams
from brigade.speculative import SpeculativeStats

__all__ = ["ReplicatedEngine", "combined_stats"]

log = structlog.get_logger("brigade.server")


class ReplicatedEngine:
    """N engine replicas that answer as one; the router places each request.

    ``replicas[i]`` is replica ``i`` (the router's ``ReplicaLoad.index``). Every replica
    serves the same config, so the first one's ``info`` stands for all.
    """

    def __init__(
        self,
        replicas: Sequence[RequestStreams],
        router: Router,
        *,
        on_dead: Callable[[str], None] | None = None,
    ) -> None:
        if not replicas:
            raise ValueError("a replicated engine needs at least one replica")
        self.replicas = list(replicas)
        self.router = router
        self.on_dead = on_dead
        self.info = replicas[0].info
        self._placed: dict[str, int] = {}
        """Request id -> the replica it runs on, from routing to its end."""
        self._deaths: dict[int, str] = {}
        self.dead: str | None = None
        self.on_snapshot: Callable[[EngineStats], None] | None = None
        """Called with the replicas' combined :attr:`snapshot` whenever one of them has a new
        one (``RequestStreams.on_snapshot``)."""
        for index, replica in enumerate(self.replicas):
            replica.on_dead = self._replica_died_callback(index)
            replica.on_snapshot = self._replica_snapshot
            if replica.dead is not None:
                self._replica_died(index, replica.dead)

    # -- what the handlers call ------------------------------------------------------------

    def admit(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        pooling: PoolingParams | None = None,
    ) -> Admission:
        """The checks every replica would make (they serve one config): a live one's."""
        live = self._live() or self.replicas
        return live[0].admit(prompt_token_ids, params, pooling=pooling)

    async def start(self) -> None:
        for replica in self.replicas:
            await replica.start()

    def _replica_snapshot(self, _: EngineStats) -> None:
        if self.on_snapshot is not None:
            self.on_snapshot(self.snapshot)

    @property
    def snapshot(self) -> EngineStats:
        """Every replica's counters added up: the live ones' gauges (requests, pages; a dead
        one's are gone), and every one's running totals (steps, prefix-cache lookups,
        preemptions, speculation's counters), so that they never go back."""
        live = combined_stats([r.snapshot for r in self._live()])
        dead = [r.snapshot for i, r in enumerate(self.replicas) if not self._in_rotation(i)]
        if not dead:
            return live
        return dataclasses.replace(
            live,
            **{name: getattr(live, name) + sum(getattr(s, name) for s in dead) for name in _TOTALS},
            speculative=SpeculativeStats.combine(
                [live.speculative, *(s.speculative for s in dead)]
            ),
        )

    @property
    def num_unstarted(self) -> int:
        return sum(r.num_unstarted for r in self.replicas)

    @property
    def num_in_flight(self) -> int:
        return sum(r.num_in_flight for r in self.replicas)

    @property
    def num_live(self) -> int:
        """Replicas in rotation."""
        return sum(self._in_rotation(index) for index in range(len(self.replicas)))

    @property
    def num_engines(self) -> int:
        """Replicas started, dead ones included."""
        return len(self.replicas)

    @property
    def num_engines_alive(self) -> int:
        """Replicas in rotation (:attr:`num_live`)."""
        return self.num_live

    @property
    def no_progress_s(self) -> float:
        """The slowest live replica's: a request routed to it waits that long."""
        return max((r.no_progress_s for r in self._live()), default=0.0)

    def check_capacity(self, num_requests: int = 1) -> None:
        """Raise unless some live replica can queue ``num_requests`` more now."""
        if self.dead is not None:
            raise EngineUnavailableError(
                f"every engine replica has failed ({self.dead}); this server is restarting"
            )
        error: EngineOverloadedError | None = None
        for replica in self._live():
            try:
                replica.check_capacity(num_requests)
            except EngineOverloadedError as exc:
                error = exc
            else:
                return
        if error is not None:
            raise error

    async def generate(
        self,
        request_id: str,
        admission: Admission,
        params: SamplingParams,
        *,
        priority: int = 0,
        check_queue: bool = True,
        extra: Mapping[str, ExtraValue] = EMPTY_EXTRA,
    ) -> AsyncGenerator[StepUpdate, None]:
        """Route the request, then stream it from its replica (``AsyncEngine.generate``)."""
        self.check_capacity(1 if check_queue else 0)
        index = self._route(request_id, admission.prompt_token_ids)
        self._placed[request_id] = index
        try:
            stream = self.replicas[index].generate(
                request_id,
                admission,
                params,
                priority=priority,
                check_queue=check_queue,
                extra=extra,
            )
            async with contextlib.aclosing(stream):  # leaving early aborts it there, now
                async for update in stream:
                    yield update
        finally:
            self._placed.pop(request_id, None)
            self.router.finished(request_id, index)

    def abort(self, request_id: str) -> None:
        index = self._placed.get(request_id)
        if index is not None:
            self.replicas[index].abort(request_id)

    def abort_all(self) -> None:
        for replica in self._live():
            replica.abort_all()

    def fail_all(self, error: BaseException) -> None:
        for replica in self.replicas:
            replica.fail_all(error)

    def shutdown(self, timeout: float = 5.0) -> None:
        for replica in self.replicas:
            replica.shutdown(timeout)

    # -- routing and failures -----------------------------------------------------------

    def _in_rotation(self, index: int) -> bool:
        """Alive as far as this front end knows: a replica's ``dead`` is set before its
        ``on_dead`` callback runs (on its own thread), so both are read."""
        return index not in self._deaths and self.replicas[index].dead is None

    def _live(self) -> list[RequestStreams]:
        return [r for i, r in enumerate(self.replicas) if self._in_rotation(i)]

    def _route(self, request_id: str, prompt_token_ids: Sequence[int]) -> int:
        loads = []
        for index, replica in enumerate(self.replicas):
            if not self._in_rotation(index):
                continue
            stats = replica.snapshot
            used = 1.0 - stats.num_free_pages / stats.num_pages if stats.num_pages else 0.0
            # Requests sent since its latest step are not in the snapshot yet: count them as
            # waiting, or a burst would all go to the replica that looked idle.
            waiting = max(stats.num_waiting, replica.num_unstarted)
            loads.append(ReplicaLoad(index, stats.num_running, waiting, used))
        if not loads:
            raise EngineUnavailableError("every engine replica has failed")
        chosen = self.router.route(request_id, prompt_token_ids, loads)
        if chosen not in {load.index for load in loads}:
            raise RuntimeError(
                f"the router {type(self.router).__name__} chose replica {chosen!r}, which is "
                f"not one of the live replicas {[load.index for load in loads]}"
            )
        return chosen

    def _replica_died_callback(self, index: int) -> Callable[[str], None]:
        return lambda reason: self._replica_died(index, reason)

    def _replica_died(self, index: int, reason: str) -> None:
        """Called on the dying replica's thread: take it out of rotation (its own streams
        already got its error); the last one to die takes the whole engine down."""
        if index in self._deaths:
            return
        self._deaths[index] = reason
        log.error(
            "engine_replica_failed",
            replica=index,
            reason=reason,
            replicas_in_rotation=self.num_live,
            replicas=len(self.replicas),
        )
        if self.num_live == 0 and self.dead is None:  # once, whichever death comes last
            self.dead = f"replica {index}: {reason}"
            if self.on_dead is not None:
                self.on_dead(self.dead)


_TOTALS = ("num_steps", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits")
"""``EngineStats`` fields that only grow (the others are gauges; ``speculative`` holds totals
too, combined by ``SpeculativeStats.combine``)."""


def combined_stats(snapshots: Sequence[EngineStats]) -> EngineStats:
    """Counters of several replicas as one engine's (queue time: weighted by steps; taken at
    the oldest snapshot's time: every replica's part is at least that recent)."""
    if not snapshots:
        return EngineStats(0, 0, 0, 0, 0, 0, 0, 0, 0.0)
    total = {
        field.name: sum(getattr(s, field.name) for s in snapshots)
        for field in dataclasses.fields(EngineStats)
        if field.name not in ("mean_queue_time_s", "speculative", "taken_at")
    }
    steps = sum(s.num_steps for s in snapshots)
    queue_time = (
        sum(s.mean_queue_time_s * s.num_steps for s in snapshots) / steps
        if steps
        else sum(s.mean_queue_time_s for s in snapshots) / len(snapshots)
    )
    return EngineStats(
        **total,
        mean_queue_time_s=queue_time,
        speculative=SpeculativeStats.combine([s.speculative for s in snapshots]),
        taken_at=min(s.taken_at for s in snapshots),
    )
