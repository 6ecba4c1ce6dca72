"""Prometheus metrics of one server, on a registry of its own (several apps may share a process).

Invariants:
- Per-request histograms and counters are updated once per finished request, from its RequestRecord.
- Gauges and the prefix-cache counters are not stored here: they are read from the AsyncEngine's
  latest EngineStats snapshot at scrape time, so they cannot drift from the engine's own accounting.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixserve.engine.stats import EngineStats
from radixserve.runtime.backend import RequestRecord, ServingBackend

PREFIX = "radixserve:"
_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
# Finer around the 2 s an autoscaler's p95 queue-wait target sits at (docs/scaling.md).
_QUEUE_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class _EngineCollector(Collector):
    def __init__(self, engine: ServingBackend) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        s = self._engine.stats()
        gauges = {
            "num_requests_waiting": ("Requests waiting to be scheduled", s.num_waiting),
            "num_requests_running": ("Requests running (prefill or decode)", s.num_running),
            "kv_pages_used": ("KV pages held privately by running requests", s.in_use_pages),
            "kv_pages_cached": ("KV pages in the prefix cache", s.cached_pages),
            "kv_pages_free": ("KV pages free", s.free_pages),
            "kv_pages_total": ("KV pages in the pool", s.num_pages),
            "pinned_pages": (
                "KV pages held by cache pins (and pins whose prefix is being computed)",
                s.pinned_pages,
            ),
            "pins": ("Cache pins held or pending", s.num_pins),
            "prefix_cache_hit_rate": (
                "Prompt tokens served from the prefix cache / prompt tokens looked up",
                s.prefix_hit_rate,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        yield GaugeMetricFamily(
            "radixserve_queue_depth",
            "Requests accepted and not yet scheduled (the autoscaling signal; scaled out, "
            "Serve's queue included)",
            value=s.num_waiting,
        )
        yield CounterMetricFamily(
            PREFIX + "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            value=s.prefix_query_tokens,
        )
        yield CounterMetricFamily(
            PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache", value=s.prefix_hit_tokens
        )
        yield CounterMetricFamily(PREFIX + "num_preemptions", "Requests preempted", value=s.num_preemptions)
        yield CounterMetricFamily(
            PREFIX + "reused_document_tokens",
            "Prompt tokens placed from document chunks (document reuse)",
            value=s.reused_document_tokens,
        )
        yield CounterMetricFamily(
            PREFIX + "recomputed_document_tokens",
            "Placed document tokens recomputed (document reuse)",
            value=s.recomputed_document_tokens,
        )
        yield from _tier_metrics(s.tiers)
        yield from _spec_metrics(s)


def _spec_metrics(s: EngineStats) -> Iterator[Metric]:
    """Speculative decoding: drafted and accepted tokens by draft source, and the mean accepted length."""
    for name, doc, values in (
        ("spec_draft_tokens", "Tokens drafted for speculative decoding", s.spec_drafted),
        ("spec_accepted_tokens", "Drafted tokens the model accepted", s.spec_accepted),
    ):
        family = CounterMetricFamily(PREFIX + name, doc, labels=["source"])
        for source, value in sorted(values.items()):
            family.add_metric([source], value)
        yield family
    yield CounterMetricFamily(
        PREFIX + "spec_verifications", "Request-steps that verified drafts", value=s.spec_verify_steps
    )
    yield GaugeMetricFamily(
        PREFIX + "spec_mean_accepted_length",
        "Tokens per verifying request-step: 1 + accepted drafts (0 before any)",
        value=s.spec_mean_accepted_length,
    )


# Per-tier figures of EngineStats.tiers that only grow (counters); the rest are levels (gauges).
_TIER_COUNTERS = {
    "hits",
    "pages_in",
    "bytes_in",
    "bytes_out",
    "evicted",
    "rejected",
    "load_s",
    "backup_s",
    "loads",
    "failed_loads",
    "dropped_writes",
    "recomputed_pages",  # a lower tier's pages computed instead, as loading them was slower
}


def _tier_metrics(tiers: dict[str, dict[str, float]]) -> Iterator[Metric]:
    """One family per figure, labelled by tier (device, host, disk)."""
    names = sorted({k for figures in tiers.values() for k in figures})
    for name in names:
        kind = CounterMetricFamily if name in _TIER_COUNTERS else GaugeMetricFamily
        family = kind(f"{PREFIX}kv_tier_{name}", f"KV cache tier figure {name!r}", labels=["tier"])
        for tier, figures in tiers.items():
            if name in figures:
                family.add_metric([tier], figures[name])
        yield family


class ServerMetrics:
    def __init__(self, engine: ServingBackend) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive output tokens",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean time per output token after the first",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Arrival to last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Arrival to first scheduled",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        # The autoscaling signal (docs/scaling.md): the same observations, in buckets around its target.
        self.queue_wait = Histogram(
            "radixserve_queue_wait_seconds",
            "Arrival to first scheduled, for autoscaling (scaled out: arrival at the ingress)",
            buckets=_QUEUE_WAIT_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter(
            PREFIX + "cached_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.cached_by_tier = Counter(
            PREFIX + "cached_tokens_by_tier",
            "Prompt tokens served from the prefix cache, by the tier they were in at admission",
            ["tier"],
            registry=r,
        )
        self.cache_writes = Counter(
            PREFIX + "cache_write_tokens", "Prompt tokens requests newly added to the cache", registry=r
        )
        self.success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason of the first sample",
            ["finished_reason"],
            registry=r,
        )
        r.register(_EngineCollector(engine))

    def observe(self, rec: RequestRecord) -> None:
        self.prompt_tokens.inc(rec.prompt_tokens)
        self.generation_tokens.inc(rec.output_tokens)
        self.cached_tokens.inc(rec.cached_tokens)
        for tier, n in rec.cached_tokens_by_tier.items():
            self.cached_by_tier.labels(tier=tier).inc(n)
        self.cache_writes.inc(rec.cache_write_tokens)
        self.success.labels(finished_reason=rec.finish_reason).inc()
        self.e2e.observe(rec.finish_time - rec.arrival_time)
        if rec.queue_time is not None:
            self.queue.observe(rec.queue_time)
            self.queue_wait.observe(rec.queue_time)
        if rec.ttft is not None:
            self.ttft.observe(rec.ttft)
        for gap in rec.token_gaps:
            self.itl.observe(gap)
        if rec.token_gaps:
            self.tpot.observe(sum(rec.token_gaps) / len(rec.token_gaps))

    def render(self) -> bytes:
        return generate_latest(self.registry)
