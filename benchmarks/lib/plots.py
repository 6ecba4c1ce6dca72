"""PNG plots of benchmark results, the one place the benchmarks draw: latency CDFs and throughput
against request rate (of the run dicts that ``loadgen.run_benchmark`` returns, grouped by engine
name), per-case bars, overlaid bars, a series beside its percentile bars, and a timeline.

Plots are written with matplotlib's Agg backend (no display needed); each function returns the
paths it wrote, and writes nothing when there is nothing to show.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402

_CDF_METRICS = (
    ("ttft_ms", "TTFT"),
    ("itl_ms", "inter-token latency"),
    ("tpot_ms", "TPOT"),
    ("e2e_ms", "end-to-end"),
)


def _save(fig: Any, path: Path) -> list[Path]:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def _samples(run: dict[str, Any], key: str) -> list[float]:
    rows = [r for r in run["requests"] if r["error"] is None]
    if key == "itl_ms":
        return [g for r in rows for g in r["itl_ms"] if g is not None]
    return [r[key] for r in rows if r[key] is not None]


def plot_cdfs(groups: Mapping[str, Sequence[dict[str, Any]]], path: Path, title: str) -> list[Path]:
    """One panel per latency metric, one empirical-CDF line per (group, run)."""
    if not any(groups.values()):
        return []
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (key, name) in zip(axes.flat, _CDF_METRICS, strict=True):
        for group, runs in groups.items():
            for run in runs:
                xs = np.sort(np.asarray(_samples(run, key)))
                if len(xs) == 0:
                    continue
                label = group if len(runs) == 1 else f"{group} {run['meta']['label']}"
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label, drawstyle="steps-post")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels of a log axis overlap
        ax.set_xlabel(f"{name} (ms, log scale)")
        ax.set_ylabel("fraction of samples")
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def plot_rate_sweep(groups: Mapping[str, Sequence[dict[str, Any]]], path: Path, title: str) -> list[Path]:
    """Output throughput and TTFT p50 against offered request rate, one line per group with 2+ rates."""
    series = {}
    for group, runs in groups.items():
        pts = sorted((r["meta"]["request_rate"], r["summary"]) for r in runs if r["meta"].get("request_rate"))
        if len({rate for rate, _ in pts}) >= 2:
            series[group] = pts
    if not series:
        return []
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for group, pts in series.items():
        rates = [rate for rate, _ in pts]
        left.plot(rates, [s["output_throughput"] for _, s in pts], marker="o", label=group)
        right.plot(rates, [s["ttft"]["p50_ms"] or np.nan for _, s in pts], marker="o", label=group)
    left.set_xlabel("offered request rate (req/s)")
    left.set_ylabel("output tokens/s")
    right.set_xlabel("offered request rate (req/s)")
    right.set_ylabel("TTFT p50 (ms)")
    right.set_yscale("log")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def plot_bars(
    values: Mapping[str, Mapping[str, float | None]], path: Path, ylabel: str, title: str
) -> list[Path]:
    """Grouped bars: ``values[case][engine]``; missing or None values leave a gap."""
    cases = list(values)
    engines = list(dict.fromkeys(e for case in values.values() for e in case))
    if not cases or not engines:
        return []
    width = 0.8 / len(engines)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.4 * len(cases) * len(engines) / 2), 4.5))
    for i, engine in enumerate(engines):
        ys = [values[c].get(engine) for c in cases]
        xs = np.arange(len(cases)) + (i - (len(engines) - 1) / 2) * width
        ax.bar(xs, [np.nan if y is None else y for y in ys], width, label=engine)
    ax.set_xticks(np.arange(len(cases)), cases, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    return _save(fig, path)


def plot_runs(groups: Mapping[str, Sequence[dict[str, Any]]], out_dir: Path, stem: str) -> list[Path]:
    """The CDF plot and, when some group swept the rate, the throughput-vs-rate plot."""
    out = plot_cdfs(groups, out_dir / f"{stem}-latency-cdf.png", f"{stem}: latency CDFs")
    return out + plot_rate_sweep(
        groups, out_dir / f"{stem}-throughput-vs-rate.png", f"{stem}: throughput vs rate"
    )


def plot_overlaid_bars(
    labels: Sequence[str], layers: Mapping[str, Sequence[float]], path: Path, ylabel: str, title: str
) -> list[Path]:
    """One bar per label for each layer, drawn over the layer before (a part in front of its whole)."""
    if not labels or not layers:
        return []
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, values in layers.items():
        ax.bar(list(labels), list(values), label=name)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    return _save(fig, path)


def plot_series_and_percentiles(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    path: Path,
    xlabel: str,
    ylabel: str,
    title: str,
    percentiles: Sequence[int] = (50, 95),
) -> list[Path]:
    """Left: each group's (x, y) points as a line on a log y axis; right: each group's percentiles of
    its y values as bars, labelled with their values."""
    if not any(ys for _, ys in series.values()):
        return []
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(series)
    for i, (name, (xs, ys)) in enumerate(series.items()):
        left.plot(list(xs), list(ys), marker="o", label=name)
        values = [float(np.percentile(ys, q)) if len(ys) else 0.0 for q in percentiles]
        offset = (i - (len(series) - 1) / 2) * width
        bars = right.bar([j + offset for j in range(len(percentiles))], values, width, label=name)
        right.bar_label(bars, fmt="%.0f", fontsize=8)
    left.set_xlabel(xlabel)
    left.set_ylabel(ylabel)
    left.set_yscale("log")
    left.grid(True, which="both", alpha=0.3)
    left.legend()
    right.set_xticks(range(len(percentiles)), [f"p{q}" for q in percentiles])
    right.set_ylabel(ylabel)
    right.legend()
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def plot_timeline(
    runs: Mapping[str, Mapping[str, Any]], shaded: tuple[float, float], path: Path, title: str
) -> list[Path]:
    """Top: each run's replicas (steps) and queue depth over time; bottom: each request's TTFT at the
    time it was sent. ``runs[label]`` has ``series`` ({t, replicas, depth}) and ``requests`` ({sent_s,
    ttft_s}); ``shaded`` marks a window (a burst) on both."""
    if not runs:
        return []
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for label, run in runs.items():
        t = [s["t"] for s in run["series"]]
        top.step(t, [s["replicas"] for s in run["series"]], where="post", label=f"{label}: replicas")
        top.plot(t, [s["depth"] for s in run["series"]], alpha=0.5, label=f"{label}: queue depth")
        ok = [r for r in run["requests"] if r["ttft_s"] is not None]
        bottom.scatter([r["sent_s"] for r in ok], [r["ttft_s"] for r in ok], s=8, label=label)
    for ax in (top, bottom):
        ax.axvspan(*shaded, color="grey", alpha=0.12)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    top.set_ylabel("replicas / waiting requests")
    bottom.set_ylabel("TTFT (s)")
    bottom.set_xlabel("time (s); shaded: the 5x burst")
    top.set_title(title)
    return _save(fig, path)


def plot_soak(
    series: Mapping[str, Sequence[float]], faults: Sequence[Mapping[str, Any]], path: Path, title: str
) -> list[Path]:
    """A soak's timeline: top, answers and output tokens per second; bottom, failures and 429s per
    second; each fault a vertical line from its injection (labelled) and a shaded span to its recovery.
    ``series`` has ``t``, ``ok``, ``tokens``, ``failed``, ``shed`` (soak/soak_outcomes.py's ``timeline``)."""
    if not series.get("t"):
        return []
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    t = list(series["t"])
    top.plot(t, list(series["ok"]), label="ok answers/s", color="tab:green")
    tokens = top.twinx()
    tokens.plot(t, list(series["tokens"]), label="output tokens/s", color="tab:blue", alpha=0.4)
    tokens.set_ylabel("output tokens/s")
    bottom.plot(t, list(series["failed"]), label="failed/s (lost, wrong, 5xx, 503)", color="tab:red")
    bottom.plot(t, list(series["shed"]), label="429 shed/s", color="tab:orange", alpha=0.7)
    for f in faults:
        end = f.get("recovered_at_s")
        for ax in (top, bottom):
            ax.axvline(f["at_s"], color="black", lw=0.8, ls="--")
            if end is not None:
                ax.axvspan(f["at_s"], end, color="grey", alpha=0.15)
        top.annotate(
            f["name"],
            (f["at_s"], 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=7,
        )
    top.set_ylabel("answers/s")
    bottom.set_ylabel("requests/s")
    bottom.set_xlabel("time (s); dashed: a fault injected, shaded: until the first correct probe after it")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    tokens.legend(fontsize=8, loc="upper right")
    top.set_title(title)
    return _save(fig, path)
