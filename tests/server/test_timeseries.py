"""server/pages/timeseries.py: the dashboard's samples, from EngineStats snapshots and finished requests."""

from __future__ import annotations

import time

import pytest

from radixserve.engine.stats import EngineStats
from radixserve.runtime.backend import RequestRecord
from radixserve.server.pages.timeseries import TimeSeries, percentile


def _record(ttft: float, gaps: list[float]) -> RequestRecord:
    now = time.monotonic()
    return RequestRecord(
        request_id="r",
        prompt_tokens=10,
        cached_tokens=0,
        output_tokens=len(gaps) + 1,
        finish_reason="stop",
        arrival_time=now - ttft,
        scheduled_time=now - ttft,
        first_token_time=now,
        finish_time=now,
        token_gaps=gaps,
    )


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    values = [float(i) for i in range(1, 101)]
    assert percentile(values, 0.95) == 95.0 and percentile(values, 0.5) == 50.0


def test_hit_rate_is_per_interval_and_latencies_come_from_finished_requests() -> None:
    series = TimeSeries()
    first = series.sample(
        EngineStats(prefix_query_tokens=100, prefix_hit_tokens=50, num_pages=8, free_pages=8)
    )
    assert first.hit_rate == 0.5 and first.ttft_p50 is None
    series.observe(_record(0.2, [0.01, 0.03]))
    series.observe(_record(0.4, [0.02]))
    stats = EngineStats(
        prefix_query_tokens=200, prefix_hit_tokens=140, num_pages=8, free_pages=6, cached_pages=2
    )
    second = series.sample(stats)
    assert second.hit_rate == 0.9  # (140 - 50) / (200 - 100): this interval alone
    assert second.ttft_p50 == pytest.approx(0.2) and second.ttft_p95 == pytest.approx(0.4)
    assert second.itl_p50 == 0.02 and second.itl_p95 == 0.03
    assert (second.pages_free, second.pages_cached, second.pages_in_use) == (6, 2, 0)
    assert series.sample(stats).hit_rate is None  # no lookups since
    out = series.series(stats)
    assert len(out.samples) == 3 and out.prefix_hit_rate == 0.7 and out.num_pages == 8
