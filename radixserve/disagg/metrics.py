"""The KV transfer's Prometheus metrics, one set per coordinator, served on the server's /metrics."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "radixserve:kv_transfer_"
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class TransferMetrics(Collector):
    """Counters only grow. The histogram is per chunk: from the prefill engine reading its pages to
    the decode engine having verified and written them."""

    def __init__(self) -> None:
        self.transfers = 0  # requests whose pages all arrived
        self.pages = 0
        self.bytes = 0
        self.tokens = 0
        self.failed = 0  # prefills that failed (an engine died, a chunk was refused, a timeout)
        self.retries = 0
        self._counts = [0] * len(LATENCY_BUCKETS)
        self._sum = 0.0
        self._n = 0

    def received(self, pages: int, nbytes: int, tokens: int, chunk_seconds: Sequence[float]) -> None:
        self.transfers += 1
        self.pages += pages
        self.bytes += nbytes
        self.tokens += tokens
        for s in chunk_seconds:
            self._sum += s
            self._n += 1
            for i, bound in enumerate(LATENCY_BUCKETS):
                if s <= bound:
                    self._counts[i] += 1

    def collect(self) -> Iterator[Metric]:
        for name, doc, value in (
            ("requests", "Requests whose prompt KV was moved from a prefill engine", self.transfers),
            ("pages", "KV pages moved from prefill to decode engines", self.pages),
            ("bytes", "Bytes of KV pages moved from prefill to decode engines", self.bytes),
            ("tokens", "Prompt tokens whose KV was moved rather than found or computed", self.tokens),
            ("failures", "Prefills whose pages did not arrive (engine death, refusal, timeout)", self.failed),
            ("retries", "Prefills sent again to another prefill engine", self.retries),
        ):
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        h = HistogramMetricFamily(
            PREFIX + "chunk_seconds", "Per chunk: prefill engine reads the pages -> decode engine wrote them"
        )
        cumulative = list(self._counts)
        h.add_metric(
            [], [(str(b), c) for b, c in zip(LATENCY_BUCKETS, cumulative)] + [("+Inf", self._n)], self._sum
        )
        yield h
