"""Prometheus metrics served at ``/metrics``.

Every server owns a private :class:`prometheus_client.CollectorRegistry`, so several servers (or
tests) in one process never clash over metric names, and nothing lands in the global default
registry. All names carry the ``brigade:`` prefix and a ``model_name`` label.

Labelled children are bound once in the constructor, so an ``observe_*`` call only updates
pre-bound objects (no label lookup, no allocation) and is cheap enough to run once per token.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from brigade.interfaces import STRUCTURED_OUTPUT_KINDS

__all__ = ["FINISH_REASONS", "ServerMetrics"]

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


class ServerMetrics:
    """The serving metrics of one model, in a registry of their own.

    Request-level figures come from the server as requests progress (:meth:`observe_first_token`,
    :meth:`observe_inter_token`, :meth:`observe_finished`); engine-level figures from a periodic
    :meth:`observe_engine` with the engine's ``SchedulerStats`` and ``KVStats``.
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        label = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, label, registry=registry, buckets=buckets).labels(
                model_name
            )

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, label, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, label, registry=registry).labels(model_name)

        self._ttft = histogram(
            "brigade:time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            TTFT_BUCKETS,
        )
        self._inter_token = histogram(
            "brigade:inter_token_latency_seconds",
            "Time between consecutive generated tokens of one request.",
            INTER_TOKEN_BUCKETS,
        )
        self._e2e = histogram(
            "brigade:e2e_request_latency_seconds",
            "Time from arrival to the end of a request, however it finished.",
            E2E_BUCKETS,
        )
        self._queue_time = histogram(
            "brigade:request_queue_time_seconds",
            "Time a request waited before its first scheduled step.",
            QUEUE_BUCKETS,
        )
        self._num_running = gauge("brigade:num_requests_running", "Requests being run.")
        self._num_waiting = gauge("brigade:num_requests_waiting", "Requests waiting to run.")
        self._kv_usage = gauge(
            "brigade:kv_cache_usage_perc", "Fraction of KV pages in use (1 means full)."
        )
        self._prompt_tokens = counter("brigade:prompt_tokens_total", "Prompt tokens processed.")
        self._generation_tokens = counter(
            "brigade:generation_tokens_total", "Tokens generated (returned to clients)."
        )
        self._prefix_queries = counter(
            "brigade:prefix_cache_queries_total", "Tokens looked up in the prefix cache."
        )
        self._prefix_hits = counter(
            "brigade:prefix_cache_hits_total", "Of the tokens looked up, those found cached."
        )
        self._preemptions = counter(
            "brigade:num_preemptions_total", "Requests preempted to free KV pages."
        )
        success = Counter(
            "brigade:request_success_total",
            "Requests finished, by finish reason.",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self._success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        structured = Counter(
            "brigade:structured_output_requests_total",
            "Requests with a grammar (response_format or tool calls), by grammar kind.",
            ["model_name", "kind"],
            registry=registry,
        )
        self._structured = {
            kind: structured.labels(model_name, kind) for kind in STRUCTURED_OUTPUT_KINDS
        }
        self._grammar_wait = histogram(
            "brigade:grammar_wait_seconds",
            "Time a request waited for its compiled grammar (near 0 on a cache hit).",
            GRAMMAR_BUCKETS,
        )
        self._grammar_errors = counter(
            "brigade:grammar_errors_total",
            "Requests refused because their schema, regex or grammar was invalid.",
        )
        # Previous cumulative engine totals; the counters advance by the difference.
        self._last_prefix_queries = 0
        self._last_prefix_hits = 0
        self._last_preemptions = 0

    def observe_first_token(self, ttft_s: float, queue_time_s: float) -> None:
        """Record a request's time to first token and the time it spent queued before it."""
        self._ttft.observe(ttft_s)
        self._queue_time.observe(queue_time_s)

    def observe_inter_token(self, seconds: float) -> None:
        """Record the gap between two consecutive tokens of one request."""
        self._inter_token.observe(seconds)

    def observe_finished(
        self, prompt_tokens: int, generation_tokens: int, e2e_s: float, finish_reason: str
    ) -> None:
        """Record a finished request: its token counts, its latency and why it finished.

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

    def observe_grammar(self, kind: str, wait_s: float, *, valid: bool) -> None:
        """Record a request's grammar: its kind, the wait for its compilation, and whether it
        compiled (an invalid one is refused with a 400)."""
        counter = self._structured.get(kind)
        if counter is None:
            raise ValueError(
                f"unknown grammar kind {kind!r}; expected one of {STRUCTURED_OUTPUT_KINDS}"
            )
        counter.inc()
        self._grammar_wait.observe(wait_s)
        if not valid:
            self._grammar_errors.inc()

    def set_components(self, components: dict[str, str]) -> None:
        """Publish which plugin runs each station (``brigade:engine_info``, value 1), so
        dashboards can compare policies side by side."""
        names = sorted(components)
        info = Gauge(
            "brigade:engine_info",
            "The plugin of each station (value is always 1).",
            ["model_name", *names],
            registry=self.registry,
        )
        info.labels(self.model_name, *(components[n] for n in names)).set(1)

    def observe_engine(
        self,
        num_running: int,
        num_waiting: int,
        kv_usage: float,
        prefix_cache_queries: int,
        prefix_cache_hits: int,
        num_preemptions: int,
    ) -> None:
        """Record a snapshot of the engine.

        ``num_running``, ``num_waiting`` and ``kv_usage`` (clamped to 0..1) set gauges. The last
        three are the engine's cumulative totals (``KVStats``, ``SchedulerStats``); each counter
        advances by the increase since the previous call. A total lower than the previous one
        means the engine was replaced (its totals restarted): that call adds nothing and the new
        total becomes the baseline, so a counter never goes backwards. What the new engine counted
        before its first snapshot is lost, which keeps a stray low value from being counted twice.
        """
        self._num_running.set(num_running)
        self._num_waiting.set(num_waiting)
        self._kv_usage.set(min(max(kv_usage, 0.0), 1.0))
        if prefix_cache_queries > self._last_prefix_queries:
            self._prefix_queries.inc(prefix_cache_queries - self._last_prefix_queries)
        if prefix_cache_hits > self._last_prefix_hits:
            self._prefix_hits.inc(prefix_cache_hits - self._last_prefix_hits)
        if num_preemptions > self._last_preemptions:
            self._preemptions.inc(num_preemptions - self._last_preemptions)
        self._last_prefix_queries = prefix_cache_queries
        self._last_prefix_hits = prefix_cache_hits
        self._last_preemptions = num_preemptions

    def render(self) -> tuple[bytes, str]:
        """The exposition body of this registry and its HTTP content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
