"""The dashboard's time series: the server's figures sampled every few seconds over the last minutes.

Each sample is taken in the API server from the same sources as /metrics: the engine's latest
``EngineStats`` (queue, pages, prefix-cache counters, tiers) and the ``RequestRecord`` of each finished
request (TTFT, inter-token latency). Rates are over the interval since the previous sample; latency
percentiles over the requests that finished in the last ``LATENCY_WINDOW_S`` seconds, so one slow request
does not vanish from the chart at the next tick.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field

import msgspec

from radixserve.engine.stats import EngineStats
from radixserve.runtime.backend import RequestRecord

SAMPLE_S = 2.0
WINDOW_S = 600.0  # ten minutes of samples are kept
LATENCY_WINDOW_S = 30.0


class Sample(msgspec.Struct):
    time: float  # seconds since the epoch, for the browser's clock
    hit_rate: float | None  # hit tokens / looked-up tokens in the interval; None: no lookups
    ttft_p50: float | None  # seconds
    ttft_p95: float | None
    itl_p50: float | None
    itl_p95: float | None
    waiting: int
    running: int
    pages_free: int
    pages_cached: int
    pages_in_use: int
    tiers: dict[str, dict[str, float]]  # per tier: occupancy (used/capacity bytes) and traffic counters


class Series(msgspec.Struct):
    """``GET /v1/server/timeseries``: the samples, oldest first, and the figures as of now."""

    sample_s: float
    samples: list[Sample]
    now: Sample
    num_pages: int
    prefix_hit_rate: float  # since the engine process started: /metrics' radixserve:prefix_cache_hit_rate
    prefix_hit_tokens: int
    prefix_query_tokens: int


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class TimeSeries:
    """Fed ``observe`` per finished request and ``sample`` every SAMPLE_S seconds (the app's task)."""

    samples: collections.deque[Sample] = field(
        default_factory=lambda: collections.deque(maxlen=int(WINDOW_S / SAMPLE_S))
    )
    _finished: collections.deque[tuple[float, float | None, list[float]]] = field(
        default_factory=collections.deque
    )
    _last: EngineStats | None = None

    def observe(self, rec: RequestRecord) -> None:
        self._finished.append((rec.finish_time, rec.ttft, list(rec.token_gaps)))

    def sample(self, stats: EngineStats) -> Sample:
        """Record a sample now (and return it)."""
        s = self.current(stats)
        self._last = stats
        self.samples.append(s)
        return s

    def current(self, stats: EngineStats) -> Sample:
        """The figures as of now, without recording them."""
        now = time.monotonic()
        while self._finished and self._finished[0][0] < now - LATENCY_WINDOW_S:
            self._finished.popleft()
        ttfts = [t for _, t, _ in self._finished if t is not None]
        gaps = [g for _, _, gs in self._finished for g in gs]
        last = self._last or EngineStats()
        queries = stats.prefix_query_tokens - last.prefix_query_tokens
        hits = stats.prefix_hit_tokens - last.prefix_hit_tokens
        return Sample(
            time=time.time(),
            hit_rate=hits / queries if queries > 0 else None,
            ttft_p50=percentile(ttfts, 0.5),
            ttft_p95=percentile(ttfts, 0.95),
            itl_p50=percentile(gaps, 0.5),
            itl_p95=percentile(gaps, 0.95),
            waiting=stats.num_waiting,
            running=stats.num_running,
            pages_free=stats.free_pages,
            pages_cached=stats.cached_pages,
            pages_in_use=stats.in_use_pages,
            tiers=stats.tiers,
        )

    def series(self, stats: EngineStats) -> Series:
        return Series(
            SAMPLE_S,
            list(self.samples),
            self.current(stats),
            stats.num_pages,
            stats.prefix_hit_rate,
            stats.prefix_hit_tokens,
            stats.prefix_query_tokens,
        )
