"""Prometheus metrics of the server, in a registry of each app's own (two apps in one process never
share counters), under vLLM's metric names with this project's prefix
(`dcp_jax:num_requests_running` where vLLM has `vllm:num_requests_running`), so dashboards built for
vLLM read them by changing the prefix; beside them the DCP ones (tp, dcp, the pool's logical
capacity, the host tier).

The engine's stats become metrics by name: level stats as gauges (`STAT_GAUGES`), cumulative ones as
counters advanced by what they grew since the last update (`STAT_COUNTERS`)."""

from __future__ import annotations

try:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
except ImportError as e:  # pragma: no cover - the message names the fix
    raise ImportError(f"the server needs the 'serve' extra: pip install 'dcp_jax[serve]' ({e})") from None

PREFIX = "dcp_jax:"

# (engine stat, metric name after the prefix, help): set from `engine.stats()`
STAT_GAUGES = (
    ("running", "num_requests_running", "Requests holding a decode slot"),
    ("waiting", "num_requests_waiting", "Requests queued in the scheduler"),
    ("reserved", "num_requests_reserved", "Requests whose KV is on the way from a prefill instance (slot and pages held)"),
    ("pages_used", "kv_pages_used", "KV pages in use (per context rank)"),
    ("pages_total", "kv_pages_total", "Usable KV pages (per context rank)"),
    ("kv_capacity_tokens", "kv_capacity_tokens", "Tokens the whole KV pool holds (its logical capacity over dcp)"),
    ("prefix_hit_rate", "prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries"),
    ("cached_blocks", "prefix_cache_blocks", "Blocks in the prefix table"),
    ("host_blocks", "kv_host_blocks", "Blocks held in the host-memory tier (0 without one)"),
    ("host_bytes", "kv_host_bytes", "Bytes the host-memory tier holds in this process"),
    ("mean_acceptance_length", "spec_decode_mean_acceptance_length",
     "Tokens a sequence gains per verify step: 1 + accepted / steps (since the start)"),
)
# (cumulative engine stat, counter name after the prefix (exposed with _total), help)
STAT_COUNTERS = (
    ("preemptions", "num_preemptions", "Requests preempted"),
    ("prefix_query_tokens", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    ("prefix_hit_tokens", "prefix_cache_hits",
     "Prompt tokens found cached (on the device or in the host tier: not computed again)"),
    ("evictions", "prefix_cache_evictions", "Cached blocks evicted from the device pool"),
    ("host_hit_tokens", "kv_host_hit_tokens",
     "Prompt tokens copied back from the host tier (counted in prefix_cache_hits too)"),
    ("host_bytes_to_host", "kv_host_bytes_to_host", "KV bytes copied to the host tier"),
    ("host_bytes_to_device", "kv_host_bytes_to_device", "KV bytes copied back from the host tier"),
    ("host_copy_s", "kv_host_copy_seconds", "Seconds spent dispatching and taking host-tier copies"),
    ("spec_verify_steps", "spec_decode_num_drafts", "Verify steps, one per sequence per step"),
    ("spec_drafted_tokens", "spec_decode_num_draft_tokens", "Draft tokens proposed"),
    ("spec_accepted_tokens", "spec_decode_num_accepted_tokens", "Draft tokens accepted"),
)


class Metrics:
    """Prometheus metrics in a registry of this app's own."""

    def __init__(self, tp: int, dcp: int):
        self.registry = r = CollectorRegistry()
        p = PREFIX
        self.requests = Counter(p + "requests", "HTTP requests answered, by status code", ["status"], registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to the first generated token",
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "Mean time between a request's tokens",
                              buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5), registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between two tokens of a request (a "
                             "request's mean gap, once per gap: tokens reach the host K decode steps at a time)",
                             buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5), registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to the last token of a request",
                             buckets=(.1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        self.finished = Counter(p + "requests_finished", "Requests finished, by finish reason (abort: the client "
                                "went away)", ["reason"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.gauges = [(key, Gauge(p + name, help_, registry=r)) for key, name, help_ in STAT_GAUGES]
        self.counters = [(key, Counter(p + name, help_, registry=r)) for key, name, help_ in STAT_COUNTERS]
        self.usage = Gauge(p + "kv_cache_usage_perc", "Fraction of the KV pool's pages in use (1 = full)", registry=r)
        self.accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by their position in the draft", ["position"],
                                        registry=r)
        self.seen: dict = {}  # the cumulative stats at the last update
        Gauge(p + "tp", "Tensor-parallel size", registry=r).set(tp)
        Gauge(p + "dcp", "Decode-context-parallel size", registry=r).set(dcp)

    def advance(self, counter, key, value) -> None:
        grew = value - self.seen.get(key, 0)
        if grew > 0:
            counter.inc(grew)
        self.seen[key] = value

    def update(self, stats: dict) -> None:
        for key, gauge in self.gauges:
            # (speculation's and the host tier's only when they are on: 0 otherwise)
            if key in stats:
                gauge.set(stats[key])
        for key, counter in self.counters:
            if key in stats:
                self.advance(counter, key, stats[key])
        if stats.get("pages_total"):
            self.usage.set(stats.get("pages_used", 0) / stats["pages_total"])
        for pos, n in enumerate(stats.get("spec_accepted_per_pos", ())):
            self.advance(self.accepted_per_pos.labels(str(pos)), ("per_pos", pos), n)

    def observe(self, arrival: float, first: float | None, end: float, n: int, prompt: int) -> None:
        """A finished request: its tokens, TTFT, mean gap between tokens, and end-to-end time."""
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(n)
        self.e2e.observe(end - arrival)
        if first is not None:
            self.ttft.observe(first - arrival)
            if n > 1:
                gap = (end - first) / (n - 1)
                self.tpot.observe(gap)
                for _ in range(n - 1):
                    self.itl.observe(gap)
