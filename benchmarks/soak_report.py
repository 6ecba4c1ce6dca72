"""The soak's report (benchmarks/soak.py): its pass criteria (``verdict``) and its Markdown (``report``)."""

from __future__ import annotations

from typing import Any

from benchmarks.common import markdown_table
from benchmarks.soak_outcomes import OUTCOMES


def verdict(doc: dict[str, Any]) -> dict[str, bool]:
    """The soak's pass criteria, each on its own."""
    o, pages = doc["summary"]["outcomes"], doc["pages"]
    return {
        "no_lost": o["lost"] == 0,
        "no_wrong": o["wrong"] == 0,
        "no_5xx_beyond_restarts": o["error_5xx"] == 0,
        "no_4xx_to_valid_requests": o["error_4xx"] == 0,
        "pages_balanced": pages["balanced"],
        "no_leaked_pages": pages["leaked"] == 0,
        "every_fault_recovered": all(
            f.get("recovery_s") is not None for f in doc["faults"] if "skipped" not in f
        ),
        "final_probes_ok": doc["probes"]["final_round_ok"],
    }


def report(name: str, doc: dict[str, Any]) -> str:
    s, m = doc["summary"], doc.get("machine", {})
    cap = doc["capacity"]
    own = doc["disk_tier"]["own_tmpfs"]
    disk = "its own tmpfs" if own else "a plain folder (a full disk cannot be made: its bound only)"
    lines = [
        f"# {name}",
        "",
        f"Model `{doc['model']}`, topology `{doc['config']['topology']}`; hang detection: "
        f"{doc['hang_detection']}; disk tier on {disk}.",
        f"Capacity {cap['answered_per_s']:.2f} answers/s (ramp: "
        + ", ".join(f"c={r['concurrency']}: {r['answered_per_s']:.2f}" for r in cap["ramp"])
        + f"); offered {doc['offered_rate_per_s']:.2f} req/s for {doc['duration_s']:.0f} s; "
        f"{doc['skipped_arrivals']} arrivals skipped at the client's in-flight cap. {doc['negatives']}.",
        "",
        "## Outcomes",
        "",
        *markdown_table(["kind", *OUTCOMES], [[k, *c.values()] for k, c in s["by_kind"].items()]),
        "| **all** | " + " | ".join(str(v) for v in s["outcomes"].values()) + " |",
        "",
        "## Faults",
        "",
        *markdown_table(
            ["fault", "at s", "recovery s", "what"],
            [
                [f["name"], round(f["at_s"], 1), f.get("recovery_s"), f.get("skipped") or f.get("result")]
                for f in doc["faults"]
            ],
        ),
        "",
        "## Checks",
        "",
        *markdown_table(["check", "passed"], list(doc["passed"].items())),
        "",
        f"Pages at idle: {doc['pages']}",
        "",
        "RSS MB start -> end: "
        + ", ".join(f"{p['role']}:{p['rss_mb']}" for p in doc["rss_mb"]["start"])
        + " -> "
        + ", ".join(f"{p['role']}:{p['rss_mb']}" for p in doc["rss_mb"]["end"]),
        "",
    ]
    for outcome, reasons in s["reasons"].items():
        lines += [f"**{outcome}**:", *(f"- {n} x {why}" for why, n in reasons.items()), ""]
    lines.append(
        f"Measured on {m.get('cpu', '?')} with a 1-minute load average of "
        f"{m.get('load_avg_1m', 0):.1f} (a shared machine: figures are not benchmark figures)."
    )
    return "\n".join(lines) + "\n"
