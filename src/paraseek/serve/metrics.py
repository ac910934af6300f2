"""Prometheus metrics of the server (names as vLLM's, under paraseek_): queue and cache state read from the engine
at scrape time, token and request counters, and latency histograms observed as requests finish."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)


class ServerMetrics:
    def __init__(self, stats):
        """`stats` returns the engine's counters (Engine.stats()), called at each scrape."""
        self.registry = r = CollectorRegistry()
        self._stats = stats

        def gauge(name: str, doc: str, key: str) -> None:
            Gauge(name, doc, registry=r).set_function(lambda: float(self._stats().get(key, 0)))

        gauge("paraseek_requests_running", "Requests being decoded or prefilled.", "running")
        gauge("paraseek_requests_waiting", "Requests waiting for KV blocks or a sequence slot.", "waiting")
        gauge("paraseek_kv_blocks_used", "KV-cache blocks held by requests.", "kv_blocks_used")
        gauge("paraseek_kv_blocks_free", "KV-cache blocks free (cached prefixes included: they are reusable).",
              "kv_blocks_free")
        gauge("paraseek_kv_cache_usage_ratio", "Share of the KV cache held by requests.", "kv_usage")
        gauge("paraseek_prefix_cache_hit_rate", "Prefix-cache hits over lookups, since the start.", "prefix_hit_rate")
        r.register(_EngineCounters(self._stats))
        self.requests = Counter("paraseek_requests", "Finished requests by finish reason.", ["finish_reason"],
                                registry=r)
        self.errors = Counter("paraseek_request_errors", "Requests answered with an error, by HTTP status.",
                              ["status"], registry=r)
        self.routed = Counter("paraseek_replica_requests", "Requests sent to each model replica (--dp).", ["replica"],
                              registry=r)
        self.ttft = Histogram("paraseek_time_to_first_token_seconds", "Arrival to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("paraseek_time_per_output_token_seconds", "Mean time between output tokens.",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("paraseek_e2e_request_latency_seconds", "Arrival to the last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)

    def finished(self, finish_reason: str | None, timing: tuple | None) -> None:
        """A request ended: its reason, and (time to first token, end to end, output tokens) if it had a token."""
        self.requests.labels(finish_reason or "abort").inc()
        if timing is None:
            return
        ttft, e2e, n_out = timing
        self.ttft.observe(ttft)
        self.e2e.observe(e2e)
        if n_out > 1:
            self.tpot.observe((e2e - ttft) / (n_out - 1))

class _EngineCounters:
    """The engine's running totals as Prometheus counters (they only grow), read at scrape time."""

    COUNTERS = (
        ("paraseek_prefix_cache_queries", "Full prompt blocks looked up in the prefix cache.", "prefix_cache_queries"),
        ("paraseek_prefix_cache_hits", "Full prompt blocks found in the prefix cache.", "prefix_cache_hits"),
        ("paraseek_preemptions", "Requests preempted (recomputed) because the KV cache was full.", "preemptions"),
        ("paraseek_prompt_tokens", "Prompt tokens admitted.", "prompt_tokens"),
        ("paraseek_generation_tokens", "Tokens generated.", "generated_tokens"),
    )

    def __init__(self, stats):
        self._stats = stats

    def collect(self):
        stats = self._stats()
        for name, doc, key in self.COUNTERS:
            yield CounterMetricFamily(name, doc, value=float(stats.get(key, 0)))

    def describe(self):
        return [CounterMetricFamily(name, doc, value=0) for name, doc, _ in self.COUNTERS]
