"""The router's Prometheus metrics, one set per process (the routers live in the ingress process).

``router_metrics()`` is a Collector: scale/app.py registers it on the ingress's /metrics registry.
Counters only grow; a replica that is forgotten keeps its counts but loses its gauges.
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from radixserve.scale.policy import REASONS

PREFIX = "radixserve:router_"
_PAGE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class RouterMetrics(Collector):
    def __init__(self) -> None:
        self.decisions: Counter[str] = Counter()
        self.routed_to: Counter[str] = Counter()
        self.forgotten = 0
        self.retries = 0
        self.imbalance = 0
        self._score_counts = [0] * len(_PAGE_BUCKETS)
        self._score_sum = 0
        self._score_n = 0
        self.replica_pages: dict[str, int] = {}

    def decided(self, reason: str, cached_pages: int, imbalance: int) -> None:
        self.decisions[reason] += 1
        self.imbalance = imbalance
        self._score_sum += cached_pages
        self._score_n += 1
        for i, bound in enumerate(_PAGE_BUCKETS):
            if cached_pages <= bound:
                self._score_counts[i] += 1

    def routed(self, replica: str) -> None:
        self.routed_to[replica] += 1

    def forget(self, replica: str) -> None:
        self.forgotten += 1
        self.replica_pages.pop(replica, None)

    def collect(self) -> Iterator[Metric]:
        c = CounterMetricFamily(PREFIX + "decisions", "Routing decisions by reason", labels=["reason"])
        for reason in REASONS:
            c.add_metric([reason], self.decisions[reason])
        yield c
        r = CounterMetricFamily(PREFIX + "requests", "Requests routed to each replica", labels=["replica"])
        for replica, n in sorted(self.routed_to.items()):
            r.add_metric([replica], n)
        yield r
        yield CounterMetricFamily(
            PREFIX + "retries",
            "Requests sent again after their replica died before they started",
            value=self.retries,
        )
        yield CounterMetricFamily(
            PREFIX + "replicas_forgotten", "Replicas dropped (died or left)", value=self.forgotten
        )
        yield GaugeMetricFamily(
            PREFIX + "imbalance",
            "Ongoing-request gap between busiest and idlest replica",
            value=self.imbalance,
        )
        h = HistogramMetricFamily(
            PREFIX + "cached_prefix_pages", "Cached prefix of the chosen replica (pages)"
        )
        buckets = [(str(b), n) for b, n in zip(_PAGE_BUCKETS, self._score_counts)] + [("+Inf", self._score_n)]
        h.add_metric([], buckets, self._score_sum)
        yield h
        g = GaugeMetricFamily(
            PREFIX + "replica_cached_pages", "Pages each replica's index holds", labels=["replica"]
        )
        for replica, pages in sorted(self.replica_pages.items()):
            g.add_metric([replica], pages)
        yield g


ROUTER_METRICS = RouterMetrics()


def router_metrics() -> RouterMetrics:
    """This process's ``RouterMetrics``. Ray may hand a router a by-value copy of this module (its
    globals are then not the imported module's), so callers look the one instance up by module name."""
    module = importlib.import_module(__name__)
    return module.ROUTER_METRICS  # type: ignore[no-any-return]
