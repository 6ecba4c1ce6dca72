"""The benchmark's arithmetic on synthetic timestamps with known answers (no server, no model)."""

from __future__ import annotations

from pathlib import Path

import pytest

# benchmarks/ is a top-level folder of the repository, not part of the installed package.
from benchmarks.lib.loadgen import check_loopback, poisson_arrivals
from benchmarks.lib.metrics import RequestResult, parse_prometheus, percentile, prefix_delta, summarize
from benchmarks.soak.soak_server import server_tracebacks


def test_percentile_interpolates_linearly() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([float(x) for x in range(101)], 95) == pytest.approx(95.0)
    assert percentile([float(x) for x in range(101)], 99) == pytest.approx(99.0)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_per_request_latencies() -> None:
    r = RequestResult(0, 0, "x", sent=10.0, finished=12.5, chunk_times=[11.0, 11.5, 12.5], output_tokens=3)
    assert r.ttft == pytest.approx(1.0)
    assert r.itls == pytest.approx([0.5, 1.0])
    assert r.tpot == pytest.approx(0.75)  # (12.5 - 11.0) / (3 - 1)
    assert r.e2e == pytest.approx(2.5)
    single = RequestResult(0, 0, "x", sent=0.0, finished=1.0, chunk_times=[1.0], output_tokens=1)
    assert single.tpot is None and single.itls == []


def _results() -> list[RequestResult]:
    a = RequestResult(
        0,
        0,
        "x",
        sent=0.0,
        finished=2.0,
        chunk_times=[1.0, 1.5, 2.0],
        output_tokens=3,
        prompt_tokens=100,
        cached_tokens=40,
    )
    b = RequestResult(
        1,
        0,
        "x",
        sent=1.0,
        finished=5.0,
        chunk_times=[2.0, 3.0, 4.0, 5.0],
        output_tokens=4,
        prompt_tokens=100,
        cached_tokens=60,
    )
    failed = RequestResult(2, 0, "x", sent=0.5, finished=6.0, error="HTTP 500: boom")
    return [a, b, failed]


def test_summary_counts_and_throughput() -> None:
    s = summarize(_results())
    assert (s["requests"], s["completed"], s["errors"]) == (3, 2, 1)
    assert s["duration_s"] == pytest.approx(6.0)  # first send (0.0) to last finish (6.0), failures included
    assert s["request_throughput"] == pytest.approx(2 / 6)
    assert s["output_throughput"] == pytest.approx(7 / 6)
    assert s["total_token_throughput"] == pytest.approx(207 / 6)
    assert s["cached_token_fraction"] == pytest.approx(0.5)
    assert s["error_messages"] == ["HTTP 500: boom"]


def test_summary_latency_percentiles_in_ms() -> None:
    s = summarize(_results())
    # TTFTs 1.0 and 1.0 s; E2Es 2.0 and 4.0 s; ITLs 0.5, 0.5, 1, 1, 1 s; TPOTs 0.5 and 1.0 s.
    assert s["ttft"]["p50_ms"] == pytest.approx(1000.0)
    assert s["e2e"]["p50_ms"] == pytest.approx(3000.0)
    assert s["e2e"]["p99_ms"] == pytest.approx(3980.0)  # 2000 + 0.99 * 2000
    assert s["itl"]["p50_ms"] == pytest.approx(1000.0)
    assert s["itl"]["mean_ms"] == pytest.approx(800.0)
    assert s["tpot"]["p95_ms"] == pytest.approx(975.0)  # 500 + 0.95 * 500


def test_summary_of_nothing() -> None:
    s = summarize([])
    assert s["completed"] == 0 and s["request_throughput"] == 0.0
    assert s["ttft"]["p50_ms"] is None and s["ttft"]["mean_ms"] is None


PROM_BEFORE = """# HELP radixserve:prefix_cache_hits_total Prompt tokens found
# TYPE radixserve:prefix_cache_hits_total counter
radixserve:prefix_cache_hits_total 100.0
radixserve:prefix_cache_queries_total 400.0
radixserve:request_success_total{finished_reason="length"} 3.0
radixserve:request_success_total{finished_reason="stop"} 2.0
"""
PROM_AFTER = PROM_BEFORE.replace(" 100.0", " 400.0").replace(
    " 400.0\nradixserve:request", " 1000.0\nradixserve:request"
)


def test_prometheus_parsing_and_prefix_delta() -> None:
    before, after = parse_prometheus(PROM_BEFORE), parse_prometheus(PROM_AFTER)
    assert before["radixserve:request_success_total"] == 5.0  # label sets folded together
    assert after["radixserve:prefix_cache_hits_total"] == 400.0
    d = prefix_delta(before, after)
    assert d == {"prefix_hit_tokens": 300.0, "prefix_query_tokens": 600.0, "prefix_hit_rate": 0.5}
    vllm = parse_prometheus(
        'vllm:prefix_cache_hits_total{model_name="m"} 5\nvllm:prefix_cache_queries_total{model_name="m"} 20\n'
    )
    assert prefix_delta({}, vllm)["prefix_hit_rate"] == 0.25
    assert prefix_delta({}, {"other": 1.0})["prefix_hit_rate"] is None


def test_poisson_arrivals_reproducible_with_the_right_mean() -> None:
    a = poisson_arrivals(4.0, 4000, seed=1)
    assert a == poisson_arrivals(4.0, 4000, seed=1)
    assert all(x < y for x, y in zip(a, a[1:], strict=False))
    assert a[-1] / len(a) == pytest.approx(0.25, rel=0.1)


def test_burst_multiplies_the_rate_inside_its_window() -> None:
    a = poisson_arrivals(2.0, 400, seed=3, burst=(20.0, 20.0, 5.0))
    inside = sum(20.0 <= t < 40.0 for t in a)
    before = sum(t < 20.0 for t in a)
    assert inside > 3 * before  # expected 200 vs 40


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "https://0.0.0.0:80"])
def test_non_loopback_targets_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match="refusing"):
        check_loopback(url)


def test_loopback_targets_are_accepted() -> None:
    check_loopback("http://127.0.0.1:8000")
    check_loopback("http://localhost:1234/")


def test_rss_growth_is_judged_per_process_past_its_own_second_minute() -> None:
    """An engine killed at 100 s and replaced: the totals compare the young process with the old one
    (+56%), each process on its own grew 0% and 4%; a process too young to judge is left out."""
    from benchmarks.soak.soak_outcomes import process_rss_growth, rss_growth

    def sample(t: float, procs: dict[str, tuple[str, float]]) -> dict[str, object]:
        mb: dict[str, float] = {}
        for role, m in procs.values():
            mb[role] = mb.get(role, 0.0) + m
        return {"t_s": t, "mb": mb, "procs": {pid: list(p) for pid, p in procs.items()}}

    samples = [sample(0.0, {"1": ("server", 400.0), "2": ("engine", 2000.0)})]
    samples += [sample(t, {"1": ("server", 400.0), "2": ("engine", 2000.0)}) for t in (15.0, 60.0, 90.0)]
    samples += [sample(t, {"1": ("server", 400.0), "3": ("engine", 1000.0)}) for t in (105.0, 120.0, 200.0)]
    samples += [sample(t, {"1": ("server", 400.0), "3": ("engine", 1500.0)}) for t in (225.0, 300.0)]
    samples += [sample(345.0, {"1": ("server", 400.0), "3": ("engine", 1560.0), "4": ("other", 9.0)})]
    samples += [sample(600.0, {"1": ("server", 400.0), "3": ("engine", 1560.0), "4": ("other", 90.0)})]
    growth = rss_growth(samples, 120.0)
    assert growth is not None and growth["growth_pct"]["engine"] == 56.0
    own = {p["pid"]: p for p in process_rss_growth(samples, 120.0)}
    assert set(own) == {1, 3}  # the old engine died before its window; Ray's helpers are not judged
    assert own[1]["growth_pct"] == 0.0 and (own[1]["from_s"], own[1]["to_s"]) == (120.0, 600.0)
    assert own[3]["from_s"] == 225.0 and own[3]["growth_pct"] == 4.0  # 1500 -> 1560, from 105 + 120 s

    # A warm standby, starting (at nice 19) from 0 to 200 s, takes over at 300 s: its life as an
    # engine counts from there, not its start-up's growth.
    samples = [
        sample(t, {"1": ("server", 400.0), "2": ("engine", 2000.0), "5": ("standby", t * 9.0)})
        for t in (0.0, 150.0, 200.0)
    ]
    samples += [
        sample(t, {"1": ("server", 400.0), "2": ("engine", 2000.0), "5": ("standby", 1800.0)})
        for t in (250.0,)
    ]
    samples += [
        sample(t, {"1": ("server", 400.0), "5": ("engine", 1800.0 + t - 300.0)})
        for t in (300.0, 420.0, 600.0)
    ]
    # The standby's successor is not started in these samples, so the end holds one process fewer:
    # the total leaves standbys out (the serving processes went 2400 -> 2500 MB, +4.17%; with the
    # standby counted the total would read -33%).
    growth = rss_growth(samples, 120.0)
    assert growth is not None and growth["total_growth_pct"] == 4.17
    own = {p["pid"]: p for p in process_rss_growth(samples, 120.0)}
    assert (own[5]["role"], own[5]["from_s"], own[5]["mb_from"], own[5]["mb_to"]) == (
        "engine",
        420.0,
        1920.0,
        2100.0,
    )


def test_a_soak_reports_the_server_logs_tracebacks_most_frequent_first(tmp_path: Path) -> None:
    """A failed soak shows why a process died (its log stays on the machine that ran it); shutdown's
    KeyboardInterrupt is not a failure."""
    frame = '  File "a.py", line 1, in f\n    g()\n'
    index = f"Traceback (most recent call last):\n{frame}IndexError: list index out of range\n"
    key = f"Traceback (most recent call last):\n{frame}KeyError: 3\n"
    stop = f"Traceback (most recent call last):\n{frame}KeyboardInterrupt\n"
    log = tmp_path / "server.log"
    log.write_text(f"ERROR the engine failed\n{key}WARNING x\n{index}{index}{stop}")
    found = server_tracebacks(log)
    assert [(t["count"], t["traceback"].splitlines()[-1]) for t in found] == [
        (2, "IndexError: list index out of range"),
        (1, "KeyError: 3"),
    ]
    assert server_tracebacks(tmp_path / "missing.log") == []
