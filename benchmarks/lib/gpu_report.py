"""The Markdown of ``benchmarks/step/gpu_decode.py``'s parts: one report a part, from its payload."""

from __future__ import annotations

from typing import Any

from benchmarks.lib.common import cell, markdown_table


# -- the report -------------------------------------------------------------------------------------
def gb(x: float | None) -> float | None:
    return None if x is None else x / 1e9


def capture_cells(captures: list[dict[str, Any]]) -> str:
    return "; ".join(
        f"{c['seconds']:.2f} s, {c['pool_mib']:.0f} MiB at {c['buckets']}" for c in captures
    ) or ("none logged (no CUDA graphs here)")


def graphs_report(payload: dict[str, Any]) -> list[str]:
    rows = [
        [r["shape"], f"{r['identical']:.0%}", capture_cells(r["captures"]["on"])] for r in payload["results"]
    ]
    return [
        "Greedy tokens with CUDA graphs on and off, float32, random weights of real shapes.",
        "",
        *markdown_table(["shape", "identical sequences", "capture (graphs on)"], rows),
    ]


def decode_report(payload: dict[str, Any]) -> list[str]:
    peak, args = payload["hbm"], payload["args"]
    rows = [
        [r["shape"] if i == 0 else "", x["batch"], "on" if x["overlap"] else "off", x["tok_s"], x["step_ms"]]
        + [x["step_bytes"] / 2**20, x["pct_of_copy_peak"], x["pct_of_nominal"]]
        for r in payload["results"]
        for i, x in enumerate(r["rows"])
    ]
    header = ["shape", "B", "overlap", "tok/s", "ms/step", "MiB/step", "% of copy peak", "% of nominal"]
    return [
        f"{payload['dtype']}, CUDA graphs on; prompts of {args['prompt_len']} tokens, {args['new_tokens']} "
        "new tokens each; the decode steps only. HBM byte limit: the weights + each row's K/V at its mean "
        "context, over the step's time, against a device-to-device copy measured here "
        f"({cell(gb(peak['copy_bytes_per_s']))} GB/s; nominal {cell(gb(peak['nominal_bytes_per_s']))} GB/s "
        f"for {peak['device']}).",
        "",
        *markdown_table(header, rows),
        "",
        *(f"- {r['shape']}: capture {capture_cells(r['captures'])}" for r in payload["results"]),
    ]


def tier_report(payload: dict[str, Any]) -> list[str]:
    link = payload["link"]
    rows = [
        [r["shape"], h["ttft_ms"], h["cached_tokens"], gb(h["load_bytes_per_s"]), h["pct_of_pinned_copy"]]
        + [f"{h['would_load_pages']} of {h['prefix_pages']}"]
        for r in payload["results"]
        for h in r["hits"]
    ]
    header = ["shape", "host-hit TTFT ms", "cached tokens", "load GB/s", "% of pinned copy", "would load"]
    recompute = [
        f"- {r['shape']}: the same prefixes computed in full (decode part): "
        + ", ".join(f"{t:.1f}" for t in r["recompute_ttft_ms"])
        + " ms TTFT"
        for r in payload["results"]
        if r.get("recompute_ttft_ms")
    ]
    return [
        f"A {payload['args']['tier_prefix']}-token prefix served from the host tier into HBM, its device "
        "copy evicted first. Host-to-device copies measured here: pinned "
        f"{cell(gb(link['pinned_bytes_per_s']))} GB/s, pageable {cell(gb(link['pageable_bytes_per_s']))} "
        f"GB/s ({link['nominal']}).",
        "",
        *markdown_table(header, rows),
        "",
        *(recompute or ["- recompute: the decode part did not run"]),
    ]


def http_report(payload: dict[str, Any]) -> list[str]:
    rows = [
        [r["shape"], r["concurrency"], r["requests"], r["errors"], r["ttft_ms"]["p50_ms"]]
        + [r["ttft_ms"]["p95_ms"], r["itl_ms"]["p50_ms"], r["itl_ms"]["p95_ms"], r["engine_step_ms"]]
        + [r["itl_p50_over_step"], capture_cells(r["captures"])]
        for r in payload["results"]
    ]
    header = ["shape", "concurrent", "requests", "errors", "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms"]
    header += ["ITL p95 ms", "engine step ms (decode part)", "ITL p50 / step", "server's capture"]
    return [
        "`radixserve serve` on 127.0.0.1, streamed chat completions (SSE, httpx), closed loop; the "
        "engine's step at that batch from the decode part's JSON of this run ('-': it did not run).",
        "",
        *markdown_table(header, rows),
    ]


REPORTS = {"graphs": graphs_report, "decode": decode_report, "tier": tier_report, "http": http_report}


def report(part: str, payload: dict[str, Any]) -> str:
    title = f"# issue 56 on {payload['device']}: {part} (benchmarks/step/gpu_decode.py, measured in this run)"
    return "\n".join([title, "", *REPORTS[part](payload)]) + "\n"
