"""What one benchmark run measured, and the arithmetic that turns per-request timestamps into a summary.

Invariants:
- All times are seconds from one monotonic clock (``time.perf_counter``); summaries report milliseconds.
- TTFT runs from the moment the request was sent to the first chunk carrying output text.
- ITL is the gap between consecutive output-carrying chunks of one request (a chunk may hold
  several tokens, as in vLLM's own benchmark); TPOT is ``(e2e - ttft) / (output_tokens - 1)``.
- Percentiles interpolate linearly between order statistics (numpy's default), so p50 of
  ``[1, 2, 3, 4]`` is 2.5.
- Throughput divides by the run's wall span: first send to last finish over every request,
  failed ones included, so errors cannot shorten the span.
- Prefix-hit figures are deltas of server counters over the run, never lifetime totals.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 95, 99)
LATENCIES = ("ttft", "itl", "tpot", "e2e")

# (hits counter, queries counter) per engine that exports them; both count prompt tokens.
PREFIX_COUNTERS = {
    "radixserve": ("radixserve:prefix_cache_hits_total", "radixserve:prefix_cache_queries_total"),
    "vllm": ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
}


@dataclass
class RequestResult:
    """One request as the client saw it."""

    session: int
    turn: int
    kind: str
    sent: float
    finished: float = math.nan
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None
    output_text: str = ""
    error: str | None = None
    scheduled: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.finished - self.sent

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        if not self.chunk_times or self.output_tokens < 2:
            return None
        return (self.finished - self.chunk_times[0]) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation, or None for no values."""
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def latency_stats(values: Sequence[float]) -> dict[str, float | None]:
    """Mean and p50/p95/p99 of ``values`` (seconds) in milliseconds; None where there are no values."""
    out: dict[str, float | None] = {"mean_ms": float(np.mean(values)) * 1000 if values else None}
    for q in PERCENTILES:
        p = percentile(values, q)
        out[f"p{q}_ms"] = None if p is None else p * 1000
    return out


def latency_samples(results: Sequence[RequestResult]) -> dict[str, list[float]]:
    """Every latency sample of the successful requests, in seconds, by metric name."""
    ok = [r for r in results if r.ok]
    return {
        "ttft": [t for r in ok if (t := r.ttft) is not None],
        "itl": [g for r in ok for g in r.itls],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "e2e": [r.e2e for r in ok],
    }


def summarize(
    results: Sequence[RequestResult], prefix: dict[str, float | None] | None = None
) -> dict[str, Any]:
    """The run's summary: counts, throughput, latency percentiles and prefix-cache figures."""
    ok = [r for r in results if r.ok]
    starts = [r.sent for r in results]
    ends = [r.finished for r in results if not math.isnan(r.finished)]
    duration = (max(ends) - min(starts)) if starts and ends else 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    per_second = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    reported = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    summary: dict[str, Any] = {
        "requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "request_throughput": per_second(len(ok)),
        "output_throughput": per_second(out_tokens),
        "total_token_throughput": per_second(out_tokens + prompt_tokens),
        # What the server's usage blocks say was reused; None when the server does not report it.
        "cached_token_fraction": (
            sum(r.cached_tokens or 0 for r in reported) / sum(r.prompt_tokens or 0 for r in reported)
            if reported
            else None
        ),
        "prefix_hit_rate": None,
        "prefix_hit_tokens": None,
        "prefix_query_tokens": None,
    }
    if prefix:
        summary.update(prefix)
    samples = latency_samples(results)
    for name in LATENCIES:
        summary[name] = latency_stats(samples[name])
    summary["error_messages"] = sorted({r.error for r in results if r.error is not None})[:10]
    return summary


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum of the samples of each metric name (labels folded together) in Prometheus text format."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            v = float(m.group(3))
        except ValueError:
            continue
        values[m.group(1)] = values.get(m.group(1), 0.0) + v
    return values


def prefix_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Prefix-cache hit tokens, queried tokens and their ratio over a run, from two /metrics scrapes."""
    for hits_name, queries_name in PREFIX_COUNTERS.values():
        if hits_name in after and queries_name in after:
            hits = after[hits_name] - before.get(hits_name, 0.0)
            queries = after[queries_name] - before.get(queries_name, 0.0)
            return {
                "prefix_hit_tokens": hits,
                "prefix_query_tokens": queries,
                "prefix_hit_rate": hits / queries if queries > 0 else None,
            }
    return {"prefix_hit_tokens": None, "prefix_query_tokens": None, "prefix_hit_rate": None}


WAIT_BUCKET = "radixserve_queue_wait_seconds_bucket"


def scrape(text: str) -> dict[str, float]:
    """/metrics as name -> value, with the queue-wait histogram's buckets as ``WAIT_BUCKET:<le>``."""
    from prometheus_client.parser import text_string_to_metric_families

    values = parse_prometheus(text)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == WAIT_BUCKET:
                values[f"{WAIT_BUCKET}:{sample.labels['le']}"] = sample.value
    return values


def wait_quantile(before: dict[str, float], after: dict[str, float], q: float) -> float | None:
    """histogram_quantile(q) of the queue-wait observations between two scrapes (linear within a
    bucket, as Prometheus computes it)."""
    bounds = sorted(
        (float(k.split(":", 1)[1]), after[k] - before.get(k, 0.0))
        for k in after
        if k.startswith(WAIT_BUCKET + ":")
    )
    if not bounds or bounds[-1][1] <= 0:
        return None
    rank, lower, below = q * bounds[-1][1], 0.0, 0.0
    for upper, count in bounds:
        if count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-9)
        lower, below = upper, count
    return lower
