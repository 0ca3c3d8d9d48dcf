"""`GET /metrics`: the engine's state and request latencies in Prometheus' text format.

Gauges and counters are read from the AsyncEngine's stats snapshot at scrape time (so a
scrape never touches the engine); the latency histograms are observed by the engine thread as
each request finishes.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from qserve.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

# stats() key -> (metric name, help); gauges, then monotonically increasing counters
_GAUGES = {
    "running": ("qserve_requests_running", "Requests in the running queue."),
    "waiting": ("qserve_requests_waiting", "Requests waiting to be scheduled."),
    "swapped": ("qserve_requests_swapped", "Requests swapped out to host memory."),
    "kv_blocks_used": ("qserve_kv_blocks_used", "KV cache blocks in use on the device."),
    "kv_blocks_free": ("qserve_kv_blocks_free", "Free KV cache blocks on the device."),
    "kv_blocks_total": ("qserve_kv_blocks_total", "KV cache blocks on the device."),
}
_COUNTERS = {
    "preemptions": ("qserve_preemptions", "Sequences preempted (swap or recompute)."),
    "layerwise_admits": ("qserve_layerwise_admits",
                         "Requests that started their prompt layer by layer (--kv-offload)."),
    "kv_bytes_swapped_out": ("qserve_kv_swapped_out_bytes", "KV bytes swapped out to host."),
    "kv_bytes_swapped_in": ("qserve_kv_swapped_in_bytes", "KV bytes swapped in from host."),
    "kv_bytes_offloaded": ("qserve_kv_offloaded_bytes",
                           "KV bytes layer-wise prefills wrote to host blocks."),
    "kv_bytes_fetched": ("qserve_kv_fetched_bytes",
                         "KV bytes layer-wise prefills read back from host blocks."),
    "prompt_tokens": ("qserve_prompt_tokens", "Prompt tokens of requests added."),
    "prefix_cache_hit_blocks": ("qserve_prefix_cache_hit_blocks",
                                "Prompt KV blocks served from the prefix cache, counted "
                                "once per request, at its first admission."),
    "generated_tokens": ("qserve_generation_tokens", "Tokens generated."),
}
# with speculative decoding only
_SPEC_GAUGES = {
    "spec_acceptance_rate": ("qserve_spec_acceptance_rate",
                             "Draft tokens accepted / draft tokens verified, since start."),
    "spec_mean_accepted_tokens": ("qserve_spec_mean_accepted_tokens",
                                  "Draft tokens accepted per verifying sequence-step."),
}
_SPEC_COUNTERS = {
    "spec_steps": ("qserve_spec_verify_steps", "Sequence-steps that verified draft tokens."),
    "spec_draft_tokens": ("qserve_spec_draft_tokens", "Draft tokens verified."),
    "spec_accepted_tokens": ("qserve_spec_accepted_tokens", "Draft tokens accepted."),
}


class _EngineCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        stats = self.engine.stats
        for key, (name, doc) in _GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=stats.get(key, 0))
        for key, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=stats.get(key, 0))
        if "spec_steps" in stats:
            for key, (name, doc) in _SPEC_GAUGES.items():
                yield GaugeMetricFamily(name, doc, value=stats[key] or 0)
            for key, (name, doc) in _SPEC_COUNTERS.items():
                yield CounterMetricFamily(name, doc, value=stats[key])


class Metrics:
    """One registry per server (not prometheus_client's global one), so apps can coexist."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.ttft = Histogram("qserve_time_to_first_token_seconds",
                              "Time from arrival to the first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("qserve_time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per request.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter("qserve_requests_finished", "Requests finished, by reason.",
                                ["finish_reason"], registry=self.registry)

    def watch(self, engine) -> None:
        """Export `engine.stats` (an AsyncEngine's snapshot) on every scrape."""
        self.registry.register(_EngineCollector(engine))

    def observe(self, out: RequestOutput) -> None:
        """Called on the engine thread with each finished request."""
        m = out.metrics
        reason = out.outputs[0].finish_reason if out.outputs else None
        if out.embedding is not None:
            reason = "embedding"
        self.finished.labels(finish_reason=reason or "abort").inc()
        if m.first_token_time is None or not out.outputs:  # (an embedding: no tokens)
            return
        self.ttft.observe(m.first_token_time - m.arrival_time)
        n = max(c.num_tokens for c in out.outputs)
        if n > 1 and m.finished_time is not None:
            self.tpot.observe((m.finished_time - m.first_token_time) / (n - 1))

    def observe_abort(self) -> None:
        """A request that ended before it finished (its client went away)."""
        self.finished.labels(finish_reason="abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
