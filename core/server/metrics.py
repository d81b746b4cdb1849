"""Prometheus metrics served at ``/metrics``.

Every server owns a private :class:`prometheus_client.CollectorRegistry`, so several servers (or
tests) in one process never clash over metric names, and nothing lands in the global default
registry. Names carry the ``brigade:`` prefix and a ``model_name`` label, or vLLM's ``vllm:``
names with its ``model_name`` and ``engine`` labels (``[server] metrics_names``), or both.

Labelled children are bound once in the constructor, so an ``observe_*`` call only updates
pre-bound objects (no label lookup, no allocation) and is cheap enough to run once per token.

With several front-end processes (``[server] api_server_count`` > 1) each observes the
requests it serves and a scrape lands on any of them, so each is started with
:data:`MULTIPROCESS_ENV` naming the server's private metrics directory (prometheus_client's
multiprocess mode, which a process picks when it first imports prometheus_client) and
:meth:`ServerMetrics.render` serves the sum of what they all wrote there. The engine's figures,
which every front end receives alike, are counted once (:meth:`ServerMetrics.observe_engine`).

Speculative decoding's counters (``spec_decode_*``, vLLM v1's names) exist only on a server
that speculates, as in vLLM: a dashboard can tell "off" (no series) from "on, nothing drafted
yet" (0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from brigade.interfaces import STRUCTURED_OUTPUT_KINDS

if TYPE_CHECKING:
    from brigade.engine import EngineStats
    from brigade.speculative import SpeculativeStats

__all__ = ["FINISH_REASONS", "METRIC_NAMES", "MULTIPROCESS_ENV", "ServerMetrics", "forget_process"]

FINISH_REASONS = ("stop", "length", "abort", "error")
"""Values of the ``finished_reason`` label (the terminal ``RequestStatus`` values, and
"error" for a request that failed on its own)."""

# Buckets in seconds, spanning what an operator wants to tell apart: TTFT from a warm prefix
# hit (a few ms) to a long prompt behind a full queue (a minute); inter-token latency from a
# small model's decode step to a stalled step; end-to-end and queue time up to long generations.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
INTER_TOKEN_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
E2E_BUCKETS = (
    0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
)  # fmt: skip
GRAMMAR_BUCKETS = (
    0.0001, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
QUEUE_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
    80.0, 160.0, 320.0, 640.0,
)  # fmt: skip


TOKEN_BUCKETS = (
    1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000,
)  # fmt: skip
"""Per-request prompt and generation lengths, in tokens."""
METRIC_NAMES = ("brigade", "vllm", "both")
"""``[server] metrics_names``: Brigade's names, vLLM's, or both side by side."""
VLLM_ENGINE = "0"
"""The ``engine`` label vLLM puts on every series (one engine per server here)."""
MULTIPROCESS_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"
"""Where prometheus_client's multiprocess mode keeps every process's series; it must be in a
process's environment before prometheus_client is imported there."""
GAUGE_MODE: Final = "livemostrecent"
"""How front ends' gauges combine in multiprocess mode. They hold the engine's state, which
every front end receives alike, a moment apart, and sets as each snapshot arrives
(:meth:`ServerMetrics.observe_engine_gauges`), stamped with the time the engine took it: the
value stamped last is the engine's newest state any front end has seen (summing would count the
engine once per front end; the time of setting would let a front end whose snapshot is a step
behind undo a newer one). "live": a front end that exits takes its gauges along
(:func:`forget_process`). A process of its own ignores it."""
ENGINE_TOTALS = ("prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total")
"""The counters fed from the engine's running totals (:meth:`ServerMetrics.observe_engine`),
besides speculation's (:data:`SPECULATIVE_TOTALS`)."""
SPECULATIVE_TOTALS = (
    "spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total",
)
"""Speculation's counters fed from ``SpeculativeStats`` (``num_verifications``, ``num_drafts``,
``num_accepted``), then the per-position ones, labelled ``position``: accepted tokens
(vLLM's) and draft tokens (Brigade's; with adaptive draft lengths, position j's acceptance rate
is accepted[j] / draft_tokens[j], not accepted[j] / drafts)."""


class _Series:
    """One metric under every configured name (``brigade:x`` and/or ``vllm:x``), bound to its
    labels: an update is one call per name, no label lookup."""

    def __init__(self, children: list[Any]) -> None:
        self.children = children

    def observe(self, value: float) -> None:
        for child in self.children:
            child.observe(value)

    def inc(self, value: float = 1.0) -> None:
        for child in self.children:
            child.inc(value)

    def set_at(self, value: float, timestamp: float) -> None:
        """Set a gauge as of ``timestamp`` (what a ``mostrecent`` multiprocess gauge compares;
        ``Gauge.set`` stamps the time of the call, and offers no other way)."""
        for child in self.children:
            child._value.set(float(value), timestamp=timestamp)


@dataclasses.dataclass(frozen=True, slots=True)
class _EngineTotal:
    """A counter that follows one of the engine's running totals, and how its sample reads in
    a multiprocess collection: name without prefix, labels beyond the naming's own."""

    series: _Series
    sample: str
    labels: tuple[tuple[str, str], ...] = ()


class ServerMetrics:
    """The serving metrics of one model, in a registry of their own.

    Request-level figures come from the server as requests progress (:meth:`observe_first_token`,
    :meth:`observe_inter_token`, :meth:`observe_finished`); engine-level figures from a periodic
    :meth:`observe_engine` with the engine's ``SchedulerStats`` and ``KVStats``.

    ``names`` picks the names: ``brigade`` (``brigade:*``, label ``model_name``), ``vllm``
    (vLLM's ``vllm:*`` names with its ``model_name`` and ``engine`` labels, so dashboards built
    for vLLM work unchanged) or ``both``.

    ``speculative_positions``: the most draft tokens one request verifies in one step
    (``[speculative] num_speculative_tokens``) on a server that speculates, which adds the
    ``spec_decode_*`` counters (one ``position`` label value per draft position); 0 (off)
    leaves them out.

    ``multiprocess_dir``: this process is one of several front ends of one server, all started
    with :data:`MULTIPROCESS_ENV` set to this directory (one ``ServerMetrics`` per process).
    :meth:`render` then answers for the whole server: counters and histograms summed over the
    front ends, gauges as last set by any live one (:data:`GAUGE_MODE`). Without it the series
    are this object's alone, and several servers in one process never clash.

    ``num_engines`` and ``num_frontends``: the processes the server started, all alive at
    first (:meth:`observe_processes` follows them from then on).
    """

    def __init__(
        self,
        model_name: str,
        *,
        names: str = "brigade",
        speculative_positions: int = 0,
        multiprocess_dir: str | None = None,
        num_engines: int = 1,
        num_frontends: int = 1,
    ) -> None:
        if names not in METRIC_NAMES:
            raise ValueError(f"metric names {names!r}: expected one of {METRIC_NAMES}")
        if multiprocess_dir is not None and os.environ.get(MULTIPROCESS_ENV) != multiprocess_dir:
            raise RuntimeError(
                f"metrics shared in {multiprocess_dir}: start this process with "
                f"{MULTIPROCESS_ENV}={multiprocess_dir} (prometheus_client reads it on import)"
            )
        self.model_name = model_name
        self.multiprocess_dir = multiprocess_dir
        self.registry = CollectorRegistry(auto_describe=True)
        """This process's series (only this process's, with ``multiprocess_dir``)."""
        self._exposed = self.registry
        """What :meth:`render` serves."""
        if multiprocess_dir is not None:
            # A registry of its own: the series above are in the directory already, and
            # registering them here as well would serve them twice.
            self._exposed = CollectorRegistry()
            MultiProcessCollector(self._exposed, path=multiprocess_dir)
        self._flavours: list[tuple[str, list[str], list[str]]] = []
        """(prefix, label names, label values) of each configured naming."""
        if names in ("brigade", "both"):
            self._flavours.append(("brigade:", ["model_name"], [model_name]))
        if names in ("vllm", "both"):
            self._flavours.append(("vllm:", ["model_name", "engine"], [model_name, VLLM_ENGINE]))
        # Registered in the order /metrics lists them.
        self._register_latency_histograms()
        self._register_length_histograms()
        self._register_engine_gauges(vllm_names=names in ("vllm", "both"))
        self._register_process_gauges(num_engines, num_frontends)
        self._register_counters()
        self._register_grammar_metrics()
        self.speculative_positions = speculative_positions
        self._engine_totals = self._engine_total_counters(speculative_positions)
        """The counters of :data:`ENGINE_TOTALS`, then of :data:`SPECULATIVE_TOTALS`, in the
        order of the totals :meth:`observe_engine` reads."""
        self._last_totals: Sequence[float] = [0] * len(self._engine_totals)
        """The engine's totals at the previous :meth:`observe_engine` (one process)."""

    def _series(self, kind: Any, name: str, doc: str, **kwargs: Any) -> _Series:
        """Metric ``name`` under every configured naming, bound to the naming's labels."""
        return _Series(
            [
                kind(prefix + name, doc, labels, registry=self.registry, **kwargs).labels(*values)
                for prefix, labels, values in self._flavours
            ]
        )

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> _Series:
        return self._series(Histogram, name, doc, buckets=buckets)

    def _gauge(self, name: str, doc: str) -> _Series:
        return self._series(Gauge, name, doc, multiprocess_mode=GAUGE_MODE)

    def _counter(self, name: str, doc: str) -> _Series:
        return self._series(Counter, name, doc)

    def _counter_by_label(
        self, name: str, doc: str, label: str, values: Sequence[str]
    ) -> dict[str, _Series]:
        """Counter ``name`` with one more label, one bound series per value of it."""
        families = [
            (Counter(prefix + name, doc, [*labels, label], registry=self.registry), base)
            for prefix, labels, base in self._flavours
        ]
        return {v: _Series([f.labels(*base, v) for f, base in families]) for v in values}

    def _register_latency_histograms(self) -> None:
        """Per-request latencies, and the phases they split into."""
        self._ttft = self._histogram(
            "time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            TTFT_BUCKETS,
        )
        self._inter_token = self._histogram(
            "inter_token_latency_seconds",
            "Time between consecutive generated tokens of one request.",
            INTER_TOKEN_BUCKETS,
        )
        self._tpot = self._histogram(
            "time_per_output_token_seconds",
            "Time per output token after the first (vLLM's name; the same gaps as "
            "inter_token_latency_seconds).",
            INTER_TOKEN_BUCKETS,
        )
        self._e2e = self._histogram(
            "e2e_request_latency_seconds",
            "Time from arrival to the end of a request, however it finished.",
            E2E_BUCKETS,
        )
        self._queue_time = self._histogram(
            "request_queue_time_seconds",
            "Time a request waited before its first scheduled step.",
            QUEUE_BUCKETS,
        )
        self._prefill_time = self._histogram(
            "request_prefill_time_seconds",
            "Time from a request's first scheduled step to its first token.",
            E2E_BUCKETS,
        )
        self._decode_time = self._histogram(
            "request_decode_time_seconds",
            "Time from a request's first token to its end.",
            E2E_BUCKETS,
        )

    def _register_length_histograms(self) -> None:
        """Per-request prompt and generation lengths."""
        self._request_prompt = self._histogram(
            "request_prompt_tokens", "Prompt tokens of each finished request.", TOKEN_BUCKETS
        )
        self._request_generation = self._histogram(
            "request_generation_tokens",
            "Tokens generated by each finished request.",
            TOKEN_BUCKETS,
        )
        self._request_max_generation = self._histogram(
            "request_max_num_generation_tokens",
            "Most tokens generated by one choice of each finished request (one choice each).",
            TOKEN_BUCKETS,
        )

    def _register_engine_gauges(self, *, vllm_names: bool) -> None:
        """The engine's state (:meth:`observe_engine_gauges`); with vLLM's names also its older
        name of the KV usage, which has no Brigade counterpart."""
        self._num_running = self._gauge("num_requests_running", "Requests being run.")
        self._num_waiting = self._gauge("num_requests_waiting", "Requests waiting to run.")
        self._kv_usage = self._gauge(
            "kv_cache_usage_perc", "Fraction of KV pages in use (1 means full)."
        )
        self._gpu_cache_usage = _Series([])
        if vllm_names:
            gpu_cache_usage = Gauge(
                "vllm:gpu_cache_usage_perc",
                "Fraction of KV pages in use (vLLM's older name of kv_cache_usage_perc).",
                ["model_name", "engine"],
                registry=self.registry,
                multiprocess_mode=GAUGE_MODE,
            )
            self._gpu_cache_usage = _Series([gpu_cache_usage.labels(self.model_name, VLLM_ENGINE)])

    def _register_process_gauges(self, num_engines: int, num_frontends: int) -> None:
        """The server's processes (:meth:`observe_processes`), all alive at first."""
        self._engines_alive = self._gauge("engines_alive", "Engine processes (replicas) serving.")
        self._engines_configured = self._gauge(
            "engines_configured", "Engine processes (replicas) the server started."
        )
        self._frontends_alive = self._gauge("frontends_alive", "HTTP front-end processes serving.")
        self._frontends_configured = self._gauge(
            "frontends_configured", "HTTP front-end processes the server started."
        )
        self.observe_processes(
            engines_alive=num_engines,
            engines_total=num_engines,
            frontends_alive=num_frontends,
            frontends_total=num_frontends,
        )

    def _register_counters(self) -> None:
        """Tokens processed, the engine's totals (:data:`ENGINE_TOTALS`) and requests finished."""
        self._prompt_tokens = self._counter("prompt_tokens_total", "Prompt tokens processed.")
        self._generation_tokens = self._counter(
            "generation_tokens_total", "Tokens generated (returned to clients)."
        )
        self._prefix_queries = self._counter(
            "prefix_cache_queries_total", "Tokens looked up in the prefix cache."
        )
        self._prefix_hits = self._counter(
            "prefix_cache_hits_total", "Of the tokens looked up, those found cached."
        )
        self._preemptions = self._counter(
            "num_preemptions_total", "Requests preempted to free KV pages."
        )
        self._success = self._counter_by_label(
            "request_success_total",
            "Requests finished, by finish reason.",
            "finished_reason",
            FINISH_REASONS,
        )

    def _register_grammar_metrics(self) -> None:
        """Structured output (:meth:`observe_grammar`)."""
        self._structured = self._counter_by_label(
            "structured_output_requests_total",
            "Requests with a grammar (response_format or tool calls), by grammar kind.",
            "kind",
            STRUCTURED_OUTPUT_KINDS,
        )
        self._grammar_wait = self._histogram(
            "grammar_wait_seconds",
            "Time a request waited for its compiled grammar (near 0 on a cache hit).",
            GRAMMAR_BUCKETS,
        )
        self._grammar_errors = self._counter(
            "grammar_errors_total",
            "Requests refused because their schema, regex or grammar was invalid.",
        )

    def _engine_total_counters(self, speculative_positions: int) -> list[_EngineTotal]:
        """The counters :meth:`observe_engine` advances: :data:`ENGINE_TOTALS` (registered
        by :meth:`_register_counters`), then, on a server that speculates, speculation's."""
        engine_totals = [
            _EngineTotal(series, name)
            for series, name in zip(
                (self._prefix_queries, self._prefix_hits, self._preemptions),
                ENGINE_TOTALS,
                strict=True,
            )
        ]
        if speculative_positions:
            engine_totals += self._speculative_counters(speculative_positions)
        return engine_totals

    def _speculative_counters(self, speculative_positions: int) -> list[_EngineTotal]:
        """Speculation's counters: :data:`SPECULATIVE_TOTALS`, then the per-position ones."""
        engine_totals: list[_EngineTotal] = []
        for name, doc in zip(
            SPECULATIVE_TOTALS,
            (
                "Request-steps that verified at least one draft token.",
                "Draft tokens verified.",
                "Draft tokens accepted.",
            ),
            strict=True,
        ):
            engine_totals.append(_EngineTotal(self._counter(name, doc), name))
        positions = [str(position) for position in range(speculative_positions)]
        for name, doc in (
            (
                "spec_decode_num_accepted_tokens_per_pos_total",
                "Draft tokens accepted, by position in their step's drafts (0: the first).",
            ),
            (
                "spec_decode_num_draft_tokens_per_pos_total",
                "Draft tokens verified, by position in their step's drafts (0: the first).",
            ),
        ):
            series = self._counter_by_label(name, doc, "position", positions)
            engine_totals += [_EngineTotal(series[p], name, (("position", p),)) for p in positions]
        return engine_totals

    def observe_first_token(self, ttft_s: float, queue_time_s: float) -> None:
        """Record a request's time to first token and the time it spent queued before it."""
        self._ttft.observe(ttft_s)
        self._queue_time.observe(queue_time_s)

    def observe_inter_token(self, seconds: float) -> None:
        """Record the gap between two consecutive tokens of one request."""
        self._inter_token.observe(seconds)
        self._tpot.observe(seconds)

    def observe_finished(
        self,
        prompt_tokens: int,
        generation_tokens: int,
        e2e_s: float,
        finish_reason: str,
        *,
        prefill_s: float | None = None,
        decode_s: float | None = None,
    ) -> None:
        """Record a finished request: its token counts, its latency and why it finished;
        ``prefill_s`` (first scheduled step to first token) and ``decode_s`` (first token to
        the end) when it got a token.

        ``finish_reason`` is one of :data:`FINISH_REASONS`; anything else raises ``ValueError``
        (a label value outside a fixed set would grow the series without bound).
        """
        success = self._success.get(finish_reason)
        if success is None:
            raise ValueError(
                f"unknown finish_reason {finish_reason!r}; expected one of {FINISH_REASONS}"
            )
        success.inc()
        self._prompt_tokens.inc(prompt_tokens)
        self._generation_tokens.inc(generation_tokens)
        self._e2e.observe(e2e_s)
        self._request_prompt.observe(prompt_tokens)
        self._request_generation.observe(generation_tokens)
        self._request_max_generation.observe(generation_tokens)
        if prefill_s is not None:
            self._prefill_time.observe(max(0.0, prefill_s))
        if decode_s is not None:
            self._decode_time.observe(max(0.0, decode_s))

    def observe_grammar(self, kind: str, wait_s: float | None, *, valid: bool) -> None:
        """Record a request's grammar: its kind, the wait for its compilation (None: not
        measured, the grammar compiled in the engine process), and whether it compiled (an
        invalid one is refused with a 400)."""
        counter = self._structured.get(kind)
        if counter is None:
            raise ValueError(
                f"unknown grammar kind {kind!r}; expected one of {STRUCTURED_OUTPUT_KINDS}"
            )
        counter.inc()
        if wait_s is not None:
            self._grammar_wait.observe(wait_s)
        if not valid:
            self._grammar_errors.inc()

    def set_components(self, components: dict[str, str]) -> None:
        """Publish which plugin runs each station (``<prefix>engine_info``, value 1), so
        dashboards can compare policies side by side."""
        names = sorted(components)
        for prefix, labels, values in self._flavours:
            info = Gauge(
                prefix + "engine_info",
                "The plugin of each station (value is always 1).",
                [*labels, *names],
                registry=self.registry,
                multiprocess_mode=GAUGE_MODE,
            )
            info.labels(*values, *(components[n] for n in names)).set(1)

    def observe_engine(
        self,
        num_running: int,
        num_waiting: int,
        kv_usage: float,
        prefix_cache_queries: int,
        prefix_cache_hits: int,
        num_preemptions: int,
        *,
        speculative: SpeculativeStats | None = None,
        taken_at: float | None = None,
    ) -> None:
        """Record a snapshot of the engine.

        ``num_running``, ``num_waiting`` and ``kv_usage`` set gauges
        (:meth:`observe_engine_gauges`, as of ``taken_at``). The
        next three, and ``speculative`` (``EngineStats.speculative``; read only with
        ``speculative_positions``, and None leaves speculation's counters as they are), are the
        engine's cumulative totals; each counter advances by the increase since the previous
        call. A total lower than the previous one means the engine was replaced (its totals
        restarted): that call adds nothing and the new total becomes the baseline, so a counter
        never goes backwards. What the new engine counted before its first snapshot is lost,
        which keeps a stray low value from being counted twice.

        With ``multiprocess_dir`` the previous total is what all front ends have counted
        together, so the server's counter is the highest total any of them has reported, however
        many they are. A lower total is then a snapshot a moment older than one already counted
        (in process mode the engine's totals never restart), and adds nothing.
        """
        self.observe_engine_gauges(num_running, num_waiting, kv_usage, taken_at=taken_at)
        totals = [prefix_cache_queries, prefix_cache_hits, num_preemptions]
        if speculative is not None and self.speculative_positions:
            totals += _speculative_totals(speculative, self.speculative_positions)
        directory = self.multiprocess_dir
        if directory is None:
            self._advance_engine_totals(totals, self._last_totals)
            self._last_totals = [*totals, *self._last_totals[len(totals) :]]
            return
        # Locked: two front ends scraped at once would both add the same increase.
        with _locked(Path(directory) / "engine-totals.lock"):
            self._advance_engine_totals(totals, self._counted_by_all(directory))

    def observe_engine_gauges(
        self, num_running: int, num_waiting: int, kv_usage: float, taken_at: float | None
    ) -> None:
        """Set the engine's gauges: requests running and waiting, and the fraction of KV pages
        in use (clamped to 0..1), as of ``taken_at`` (``EngineStats.taken_at``; None: now).

        With ``multiprocess_dir`` the server's value is the one with the latest ``taken_at``
        among the front ends (:data:`GAUGE_MODE`), so each front end calls this as every
        snapshot arrives, and one whose latest snapshot is older never hides a newer one."""
        stamp = time.time() if taken_at is None else taken_at
        self._num_running.set_at(num_running, stamp)
        self._num_waiting.set_at(num_waiting, stamp)
        usage = min(max(kv_usage, 0.0), 1.0)
        self._kv_usage.set_at(usage, stamp)
        self._gpu_cache_usage.set_at(usage, stamp)

    def observe_processes(
        self, *, engines_alive: int, engines_total: int, frontends_alive: int, frontends_total: int
    ) -> None:
        """Set the process gauges: engines and front ends serving, and how many the server
        started (fewer alive than started: the server is degraded; ``brigade.server.health``).
        With ``multiprocess_dir`` the server's value is the one set last, by any front end."""
        stamp = time.time()
        self._engines_alive.set_at(engines_alive, stamp)
        self._engines_configured.set_at(engines_total, stamp)
        self._frontends_alive.set_at(frontends_alive, stamp)
        self._frontends_configured.set_at(frontends_total, stamp)

    def observe_snapshot(self, stats: EngineStats) -> None:
        """:meth:`observe_engine` with an ``EngineStats``."""
        self.observe_engine(
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_usage=_kv_usage(stats),
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            num_preemptions=stats.num_preemptions,
            speculative=stats.speculative,
            taken_at=stats.taken_at or None,
        )

    def observe_snapshot_gauges(self, stats: EngineStats) -> None:
        """:meth:`observe_engine_gauges` with an ``EngineStats`` (as a front end of several
        receives one)."""
        self.observe_engine_gauges(
            stats.num_running,
            stats.num_waiting,
            _kv_usage(stats),
            taken_at=stats.taken_at or None,
        )

    def _advance_engine_totals(self, totals: Sequence[int], counted: Sequence[float]) -> None:
        """Advance the first ``len(totals)`` engine counters (all but speculation's when the
        snapshot has none)."""
        for engine_total, total, seen in zip(self._engine_totals, totals, counted, strict=False):
            if total > seen:
                engine_total.series.inc(total - seen)

    def _counted_by_all(self, directory: str) -> list[float]:
        """The engine counters as counted by every front end together (under the first
        naming; the others advance alike)."""
        prefix, labels, values = self._flavours[0]
        ours = tuple(zip(labels, values, strict=True))
        counted = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in MultiProcessCollector(None, path=directory).collect()
            if family.type == "counter"
            for sample in family.samples
        }
        return [
            counted.get((prefix + total.sample, tuple(sorted((*ours, *total.labels)))), 0.0)
            for total in self._engine_totals
        ]

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its HTTP content type: this registry's series, or with
        ``multiprocess_dir`` the whole server's."""
        return generate_latest(self._exposed), CONTENT_TYPE_LATEST


def _kv_usage(stats: EngineStats) -> float:
    return 1.0 - stats.num_free_pages / max(1, stats.num_pages)


def _speculative_totals(stats: SpeculativeStats, positions: int) -> list[int]:
    """``stats`` in the order of :data:`SPECULATIVE_TOTALS` and the per-position counters,
    each per-position tuple cut or padded to ``positions``."""

    def by_position(counts: Sequence[int]) -> list[int]:
        return [*counts[:positions], *[0] * (positions - len(counts))]

    return [
        stats.num_verifications,
        stats.num_drafts,
        stats.num_accepted,
        *by_position(stats.accepted_by_position),
        *by_position(stats.drafts_by_position),
    ]


def forget_process(multiprocess_dir: str, pid: int) -> None:
    """Drop the gauges of front end ``pid``, which has exited; what it counted (counters,
    histograms) stays in the server's totals."""
    mark_process_dead(pid, multiprocess_dir)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created if missing) among processes."""
    with path.open("a") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        yield  # closing the file releases the lock
