"""The comparison's report: ratios of radixserve's configs to each peer, issue 21's goals, Markdown.

Pure functions of the per-case results that ``benchmarks.serving.compare`` gathers (``results[case][engine]``
is a ``serve_bench`` run), so tests check them on synthetic figures.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks.lib.loadgen import TABLE_HEADER, table_row

LLAMA_NOTE = "llama-server (Q4_1 4-bit weights)"
ISSUE21_CASES = ("rag", "multiturn", "nosharing")


def display_name(engine: str) -> str:
    return LLAMA_NOTE if engine == "llama-server" else engine


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b and not math.isnan(b) else None


VLLM_DTYPES = ("vllm-cpu", "vllm-cpu-bf16")
VLLM_BEST = "vllm-cpu-best"  # per case, whichever of VLLM_DTYPES ran faster


def ratios(
    results: dict[str, dict[str, dict[str, Any]]], ours_name: str = "radixserve"
) -> list[dict[str, Any]]:
    """``ours_name`` against each other engine, per case: output throughput and TTFT p50 ratios; and
    against vLLM at its best dtype of that case (``VLLM_BEST``, the dtype in ``best``)."""
    rows = []
    for case, by_engine in results.items():
        ours = by_engine.get(ours_name)
        if ours is None:
            continue
        versus = {e: r for e, r in by_engine.items() if e != ours_name}
        vllm = [e for e in VLLM_DTYPES if e in by_engine]
        if vllm:
            best = max(vllm, key=lambda e: by_engine[e]["summary"]["output_throughput"])
            versus[VLLM_BEST] = by_engine[best]
        for engine, run in versus.items():
            row = {
                "ours": ours_name,
                "case": case,
                "versus": engine,
                "throughput_ratio": _ratio(
                    ours["summary"]["output_throughput"], run["summary"]["output_throughput"]
                ),
                "ttft_p50_ratio": _ratio(ours["summary"]["ttft"]["p50_ms"], run["summary"]["ttft"]["p50_ms"]),
            }
            if engine == VLLM_BEST:
                row["best"] = best
            rows.append(row)
    return rows


# (level, ours, case, versus, metric, goal, higher is better): issue 21's goals through HTTP. The
# fast config's accuracy (no worse than vLLM bf16's) is benchmarks/serving/accuracy_bench.py's to show.
EXACT, FAST = "radixserve-exact", "radixserve-fast"
GOALS = [
    ("goal", EXACT, "rag", "vllm-cpu", "throughput_ratio", 2.0, True),
    ("goal", EXACT, "multiturn", "vllm-cpu", "throughput_ratio", 2.0, True),
    ("goal", EXACT, "nosharing", "vllm-cpu", "throughput_ratio", 1.5, True),
    ("goal", EXACT, "multiturn", "vllm-cpu-bf16", "throughput_ratio", 1.0, True),
    *(("goal", FAST, case, VLLM_BEST, "throughput_ratio", 1.3, True) for case in ISSUE21_CASES),
    *(("goal", EXACT, case, "llama-server", "throughput_ratio", 2.0, True) for case in ISSUE21_CASES),
]


def goal_rows(ratio_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = {(r.get("ours", "radixserve"), r["case"], r["versus"]): r for r in ratio_rows}
    out = []
    for level, ours, case, versus, metric, goal, higher in GOALS:
        value = found.get((ours, case, versus), {}).get(metric)
        met = None if value is None else (value >= goal if higher else value <= goal)
        out.append(
            {
                "level": level,
                "ours": ours,
                "case": case,
                "versus": versus,
                "metric": metric,
                "goal": goal,
                "value": value,
                "met": met,
            }
        )
    return out


# Every engine whose weights or arithmetic are not fp32's (``{gguf}``: the GGUF file's name).
ENGINE_NOTES = {
    "radixserve-spec": "--speculative ngram: greedy, token-identical to plain decoding",
    "radixserve-exact": "GGUF-exact on {gguf}: exact arithmetic over its blocks",
    "radixserve-fast": "--preset fast: approximate; its accuracy is accuracy_bench's",
    "radixserve-bf16": "--dtype bfloat16: bf16 weights, products and K/V: approximate",
    "radixserve-int8": "--decode-arithmetic int8 on {gguf}: approximate; accuracy: gguf_int8_bench",
    "radixserve-int8-kv-bf16": "--decode-arithmetic int8 on {gguf}, bf16 K/V: approximate; accuracy: "
    "accuracy_bench",
    "radixserve-bf16-blocks": "bf16 prefill on {gguf}'s blocks, bf16 K/V, exact decode: approximate",
    "vllm-cpu-bf16": "bf16 weights and arithmetic",
    "vllm-cpu-ngram": "vLLM's n-gram speculation, fp32",
    "llama-server": "{gguf}'s blocks, llama.cpp's arithmetic",
}


def render_markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    flags = m.get("cpu_flags", {})
    listed = ", ".join(f for f, on in flags.items() if on) or "none of " + ", ".join(flags)
    lines = [
        "# radixserve vs peers",
        "",
        f"{m['date']} on {m['cpu']} ({m['cpus']} CPUs, {m['platform']}; CPU flags listed: {listed}); model "
        f"{doc['model']}, fp32 for every engine except those noted below. Output length fixed at "
        f"{doc['sizes']['output_tokens']} tokens (EOS ignored), greedy.",
        "",
    ]
    gguf = Path(doc["gguf"]).name if doc.get("gguf") else "the GGUF file"
    lines += [f"- {e}: {note.format(gguf=gguf)}" for e, note in ENGINE_NOTES.items() if e in doc["engines"]]
    for note in doc["skipped"]:
        lines.append(f"- skipped: {note}")
    for case, by_engine in doc["results"].items():
        lines += ["", f"## {case}", "", TABLE_HEADER]
        lines += [table_row(display_name(e), r["meta"], r["summary"]) for e, r in by_engine.items()]
    lines += [
        "",
        "## ratios (throughput: ours/theirs, higher is better; TTFT p50: ours/theirs, lower is better)",
        "",
        f"{VLLM_BEST}: per case, the faster of {' and '.join(VLLM_DTYPES)}.",
        "",
        "| ours | case | versus | throughput ratio | TTFT p50 ratio |",
        "|---|---|---|---|---|",
    ]
    fmt = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    for r in doc["ratios"]:
        versus = display_name(r["versus"]) + (f" ({r['best']})" if "best" in r else "")
        lines.append(
            f"| {r.get('ours', 'radixserve')} | {r['case']} | {versus} | {fmt(r['throughput_ratio'])} | "
            f"{fmt(r['ttft_p50_ratio'])} |"
        )
    lines += [
        "",
        "## goals (issue 21)",
        "",
        "| level | ours | case | versus | metric | target | measured | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for g in doc["goals"]:
        sign = ">=" if g["metric"] == "throughput_ratio" else "<="
        met = "not run" if g["met"] is None else ("yes" if g["met"] else "no")
        lines.append(
            f"| {g['level']} | {g['ours']} | {g['case']} | {display_name(g['versus'])} | {g['metric']} | "
            f"{sign} {g['goal']}x | {fmt(g['value'])} | {met} |"
        )
    if doc["plots"]:  # the writer links each plot below this heading
        lines += ["", "## plots"]
    return "\n".join(lines) + "\n"
