"""Prometheus metrics of the server, under two sets of names: vLLM's (`vllm:...`, labelled with `model_name` and
`engine`, so that dashboards, alerts and autoscalers written for vLLM work unchanged) and paraseek's own
(`paraseek_...`, unlabelled, kept for existing scrapes). Queue and cache state are read from the engine at scrape
time; token and request counters grow; latency histograms are observed as requests finish (the inter-token gaps as
tokens arrive)."""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)
# vLLM's buckets (vllm/v1/metrics/loggers.py), so that their dashboards' quantiles mean the same
_VLLM_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
              80.0, 160.0, 640.0, 2560.0)
_VLLM_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_VLLM_REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                 960.0, 1920.0, 7680.0)
LABELS = ("model_name", "engine")


def _1_2_5_buckets(most: int) -> tuple[int, ...]:
    out, e = [], 0
    while True:
        for m in (1, 2, 5):
            if m * 10**e > most:
                return tuple(out)
            out.append(m * 10**e)
        e += 1


class ServerMetrics:
    def __init__(self, stats, model_name: str = "", block_size: int = 16, max_model_len: int = 32768):
        """`stats` returns the engine's counters (Engine.stats()), called at each scrape."""
        self.registry = r = CollectorRegistry()
        self._stats = stats
        self.labels = (model_name, "0")

        def gauge(name: str, doc: str, key: str) -> None:
            Gauge(name, doc, registry=r).set_function(lambda: float(self._stats().get(key, 0)))

        gauge("paraseek_requests_running", "Requests being decoded or prefilled.", "running")
        gauge("paraseek_requests_waiting", "Requests waiting for KV blocks or a sequence slot.", "waiting")
        gauge("paraseek_kv_blocks_used", "KV-cache blocks held by requests.", "kv_blocks_used")
        gauge("paraseek_kv_blocks_free", "KV-cache blocks free (cached prefixes included: they are reusable).",
              "kv_blocks_free")
        gauge("paraseek_kv_cache_usage_ratio", "Share of the KV cache held by requests.", "kv_usage")
        gauge("paraseek_prefix_cache_hit_rate", "Prefix-cache hits over lookups, since the start.", "prefix_hit_rate")
        r.register(_EngineState(self._stats, self.labels, block_size))
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

        def vllm(name: str, doc: str, buckets, extra=()):
            return Histogram(name, doc, list(LABELS) + list(extra), buckets=buckets, registry=r)

        self.v_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                 list(LABELS) + ["finished_reason"], registry=r)
        self.v_ttft = vllm("vllm:time_to_first_token_seconds", "Time to first token in seconds.", _VLLM_TTFT)
        self.v_itl = vllm("vllm:inter_token_latency_seconds", "Time between consecutive output tokens in seconds.",
                          _VLLM_ITL)
        self.v_tpot_token = vllm("vllm:time_per_output_token_seconds",
                                 "Time per output token in seconds (each gap; vLLM's older name of "
                                 "inter_token_latency).", _VLLM_ITL)
        self.v_tpot = vllm("vllm:request_time_per_output_token_seconds",
                           "Mean time per output token of each request in seconds.", _VLLM_ITL)
        self.v_e2e = vllm("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                          _VLLM_REQUEST)
        self.v_queue = vllm("vllm:request_queue_time_seconds", "Time a request spent waiting before its first "
                            "scheduling, in seconds.", _VLLM_REQUEST)
        self.v_prefill = vllm("vllm:request_prefill_time_seconds", "First scheduling to first token, in seconds.",
                              _VLLM_REQUEST)
        self.v_decode = vllm("vllm:request_decode_time_seconds", "First token to last token, in seconds.",
                             _VLLM_REQUEST)
        self.v_inference = vllm("vllm:request_inference_time_seconds", "First scheduling to last token, in "
                                "seconds.", _VLLM_REQUEST)
        self.v_prompt = vllm("vllm:request_prompt_tokens", "Prompt tokens of each finished request.",
                             _1_2_5_buckets(max_model_len))
        self.v_generation = vllm("vllm:request_generation_tokens", "Generated tokens of each finished request.",
                                 _1_2_5_buckets(max_model_len))
        self.v_max_tokens = vllm("vllm:request_params_max_tokens", "The max_tokens of each finished request.",
                                 _1_2_5_buckets(max_model_len))
        self._last_token: dict[str, float] = {}
        self._lock = threading.Lock()

    def token(self, request_id: str, now: float | None = None) -> None:
        """A request's token arrived: the gap since its previous one is an inter-token latency."""
        now = time.perf_counter() if now is None else now
        with self._lock:
            last = self._last_token.get(request_id)
            self._last_token[request_id] = now
        if last is not None:
            self.v_itl.labels(*self.labels).observe(now - last)
            self.v_tpot_token.labels(*self.labels).observe(now - last)

    def finished(self, finish_reason: str | None, timing, request_id: str | None = None) -> None:
        """A request ended: its reason, and its Timing (serve.loop) if it had a token."""
        if request_id is not None:
            with self._lock:
                self._last_token.pop(request_id, None)
        reason = finish_reason or "abort"
        self.requests.labels(reason).inc()
        self.v_success.labels(*self.labels, reason).inc()
        if timing is None:
            return
        lb = self.labels
        self.ttft.observe(timing.ttft)
        self.e2e.observe(timing.e2e)
        self.v_ttft.labels(*lb).observe(timing.ttft)
        self.v_e2e.labels(*lb).observe(timing.e2e)
        self.v_decode.labels(*lb).observe(timing.decode)
        self.v_prompt.labels(*lb).observe(timing.n_prompt)
        self.v_generation.labels(*lb).observe(timing.n_out)
        self.v_max_tokens.labels(*lb).observe(timing.max_tokens)
        if timing.queue is not None:
            self.v_queue.labels(*lb).observe(timing.queue)
            self.v_prefill.labels(*lb).observe(timing.prefill)
            self.v_inference.labels(*lb).observe(timing.prefill + timing.decode)
        if timing.n_out > 1:
            self.tpot.observe(timing.decode / (timing.n_out - 1))
            self.v_tpot.labels(*lb).observe(timing.decode / (timing.n_out - 1))


class _EngineState:
    """The engine's state and running totals, read at scrape time: paraseek's counters in blocks and tokens, and
    vLLM's gauges and counters (its prefix-cache counters count tokens: blocks x block size)."""

    COUNTERS = (
        ("paraseek_prefix_cache_queries", "Full prompt blocks looked up in the prefix cache.", "prefix_cache_queries"),
        ("paraseek_prefix_cache_hits", "Full prompt blocks found in the prefix cache.", "prefix_cache_hits"),
        ("paraseek_preemptions", "Requests preempted (recomputed) because the KV cache was full.", "preemptions"),
        ("paraseek_prompt_tokens", "Prompt tokens admitted.", "prompt_tokens"),
        ("paraseek_generation_tokens", "Tokens generated.", "generated_tokens"),
    )
    # (name, doc, stats key, multiplied by the block size)
    VLLM_COUNTERS = (
        ("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", "prefix_cache_queries", True),
        ("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", "prefix_cache_hits", True),
        ("vllm:num_preemptions", "Cumulative number of preemptions.", "preemptions", False),
        ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens", False),
        ("vllm:generation_tokens", "Number of generation tokens processed.", "generated_tokens", False),
    )
    # Speculative decoding (infer/spec.py), vLLM's names and meanings (vllm/v1/spec_decode/metrics.py):
    # verification steps that had drafts, drafts proposed, drafts accepted, and accepted by draft position.
    VLLM_SPEC_COUNTERS = (
        ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_num_drafts"),
        ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_num_draft_tokens"),
        ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "spec_num_accepted_tokens"),
    )
    VLLM_GAUGES = (
        ("vllm:num_requests_running", "Number of requests in model execution batches.", "running"),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "waiting"),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_usage"),
        ("vllm:gpu_cache_usage_perc", "KV-cache usage (vLLM's older name of kv_cache_usage_perc).", "kv_usage"),
    )

    def __init__(self, stats, labels: tuple[str, str], block_size: int):
        self._stats, self._labels, self._block_size = stats, list(labels), block_size

    def collect(self):
        stats = self._stats()
        for name, doc, key in self.COUNTERS:
            yield CounterMetricFamily(name, doc, value=float(stats.get(key, 0)))
        for name, doc, key, in_blocks in self.VLLM_COUNTERS:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(self._labels, float(stats.get(key, 0)) * (self._block_size if in_blocks else 1))
            yield c
        for name, doc, key in self.VLLM_GAUGES:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(self._labels, float(stats.get(key, 0)))
            yield g
        if "spec_num_drafts" in stats:  # a speculative engine
            for name, doc, key in self.VLLM_SPEC_COUNTERS:
                c = CounterMetricFamily(name, doc, labels=LABELS)
                c.add_metric(self._labels, float(stats[key]))
                yield c
            c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted tokens per draft position.", labels=list(LABELS) + ["position"])
            for pos, n in enumerate(stats["spec_accepted_per_pos"]):
                c.add_metric(self._labels + [str(pos)], float(n))
            yield c
        if "max_loras" in stats:  # vLLM's: the adapters of the running and waiting requests, valued at the time
            g = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                                  labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            g.add_metric([str(stats["max_loras"]), ",".join(stats["lora_waiting"]), ",".join(stats["lora_running"])],
                         time.time())
            yield g

    def describe(self):
        return ([CounterMetricFamily(name, doc, value=0) for name, doc, _ in self.COUNTERS]
                + [CounterMetricFamily(name, doc, labels=LABELS) for name, doc, _, _ in self.VLLM_COUNTERS]
                + [GaugeMetricFamily(name, doc, labels=LABELS) for name, doc, _ in self.VLLM_GAUGES])
