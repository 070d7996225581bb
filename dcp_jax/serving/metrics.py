"""Prometheus metrics of the server, in a registry of each app's own (two apps in one process never
share counters); the engine's stats become gauges by name."""

from __future__ import annotations

try:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
except ImportError as e:  # pragma: no cover - the message names the fix
    raise ImportError(f"the server needs the 'serve' extra: pip install 'dcp_jax[serve]' ({e})") from None

# (engine stat, metric name after "dcp_jax_", help)
STAT_GAUGES = (
    ("running", "num_requests_running", "Requests holding a decode slot"),
    ("waiting", "num_requests_waiting", "Requests queued in the scheduler"),
    ("reserved", "num_requests_reserved", "Requests whose KV is on the way from a prefill instance (slot and pages held)"),
    ("preemptions", "num_preemptions", "Preemptions since the start (cumulative)"),
    ("pages_used", "kv_pages_used", "KV pages in use (per context rank)"),
    ("pages_total", "kv_pages_total", "Usable KV pages (per context rank)"),
    ("kv_capacity_tokens", "kv_capacity_tokens", "Tokens the whole KV pool holds"),
    ("prefix_query_tokens", "prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache (cumulative)"),
    ("prefix_hit_tokens", "prefix_cache_hit_tokens", "Prompt tokens found cached (cumulative)"),
    ("prefix_hit_rate", "prefix_cache_hit_rate", "prefix_cache_hit_tokens / query tokens"),
    ("cached_blocks", "prefix_cache_blocks", "Blocks in the prefix table"),
    ("evictions", "prefix_cache_evictions", "Cached blocks evicted (cumulative)"),
    ("host_blocks", "kv_host_blocks", "Blocks held in the host-memory tier (0 without one)"),
    ("host_bytes", "kv_host_bytes", "Bytes the host-memory tier holds in this process"),
    ("host_hit_tokens", "kv_host_hit_tokens", "Prompt tokens copied back from the host tier (cumulative)"),
    ("host_bytes_to_host", "kv_host_bytes_to_host", "KV bytes copied to the host tier (cumulative)"),
    ("host_bytes_to_device", "kv_host_bytes_to_device", "KV bytes copied back from the host tier (cumulative)"),
    ("host_copy_s", "kv_host_copy_seconds", "Seconds spent dispatching and taking host-tier copies (cumulative)"),
    ("spec_drafted_tokens", "spec_decode_drafted_tokens",
     "Draft tokens proposed (cumulative; 0 without speculative decoding)"),
    ("spec_accepted_tokens", "spec_decode_accepted_tokens", "Draft tokens accepted (cumulative)"),
    ("mean_acceptance_length", "spec_decode_mean_acceptance_length",
     "Tokens a sequence gains per verify step: 1 + accepted / steps (cumulative)"),
)


class Metrics:
    """Prometheus metrics in a registry of this app's own."""

    def __init__(self, tp: int, dcp: int):
        self.registry = r = CollectorRegistry()
        p = "dcp_jax_"
        self.requests = Counter(p + "requests", "HTTP requests answered, by status code", ["status"], registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to the first generated token",
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "Mean time between a request's tokens",
                              buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5), registry=r)
        self.finished = Counter(p + "requests_finished", "Requests finished, by finish reason (abort: the client "
                                "went away)", ["reason"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        # one gauge per engine stat, set from `engine.stats()` (the cumulative ones are running totals)
        self.gauges = [(key, Gauge(p + name, help_, registry=r)) for key, name, help_ in STAT_GAUGES]
        Gauge(p + "tp", "Tensor-parallel size", registry=r).set(tp)
        Gauge(p + "dcp", "Decode-context-parallel size", registry=r).set(dcp)

    def update(self, stats: dict) -> None:
        for key, gauge in self.gauges:
            if key in stats:  # (speculation's only when it is on: 0 otherwise)
                gauge.set(stats[key])
