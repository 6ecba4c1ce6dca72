"""The soak's report (benchmarks/soak/soak.py): its pass criteria (``verdict``) and its Markdown
(``report``)."""

from __future__ import annotations

from typing import Any

from benchmarks.lib.common import markdown_table
from benchmarks.soak.soak_outcomes import OUTCOMES


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
        # A fault not injected (its target not found, or no time left for it) tested nothing: a soak
        # whose engine kills found no engine (Ray's replicas run theirs at nice 15, taken for
        # standbys) passed without it.
        "every_fault_injected": all("skipped" not in f for f in doc["faults"]),
        "every_fault_recovered": all(
            f.get("recovery_s") is not None for f in doc["faults"] if "skipped" not in f
        ),
        "final_probes_ok": doc["probes"]["final_round_ok"],
        **extra_checks(doc),
    }


RECOVERY_TARGET_S = 15.0  # issue 34: recovery within 15 s of any single fault
RSS_GROWTH_TARGET_PCT = 5.0  # issue 34: RSS growth under 5% from the 2nd minute to the end
HANG_SLACK_S = 3.0  # the watchdog's tick (<= 1 s), its confirming yields, the kill and the 503's way back


def extra_checks(doc: dict[str, Any]) -> dict[str, bool]:
    """The issue's targets that apply to this run: recovery time (a run with faults), RSS growth (a run
    of 5 minutes or more), and the hung engine's requests failed within the deadline (a stop-engine
    fault where the server detects hangs)."""
    out: dict[str, bool] = {}
    faults = [f for f in doc["faults"] if "skipped" not in f]
    if faults:
        out["recovery_within_15s"] = all(
            f.get("recovery_s") is not None and f["recovery_s"] <= RECOVERY_TARGET_S for f in faults
        )
    growth = doc.get("rss_growth")
    if growth is not None and doc["duration_s"] >= 300:
        out["rss_growth_under_5pct"] = (growth["total_growth_pct"] or 0.0) < RSS_GROWTH_TARGET_PCT
        # The same, each process on its own past its 2nd minute: the totals above compare a process
        # a fault restarted with the one it replaced.
        own = doc.get("process_rss_growth") or []
        if own:
            out["process_rss_growth_under_5pct"] = all(
                (p["growth_pct"] or 0.0) < RSS_GROWTH_TARGET_PCT for p in own
            )
    deadline = doc.get("hang_timeout_s")
    stops = [f for f in faults if f["name"] == "stop-engine"]
    if stops and deadline:
        out["hang_failed_within_deadline"] = all(
            f.get("hang_error_s") is not None and f["hang_error_s"] <= deadline + HANG_SLACK_S for f in stops
        )
    return out


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
            ["fault", "at s", "recovery s", "hang's first 503 s", "engine start-up s", "standby back s"]
            + ["every replica serving again s", "what"],
            [
                [
                    f["name"],
                    round(f["at_s"], 1),
                    f.get("recovery_s"),
                    f.get("hang_error_s", ""),
                    _startup(f),
                    _standby_back(f),
                    _replicas_back(f),
                    f.get("skipped") or f.get("result"),
                ]
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
        rss_line(doc.get("rss_growth")),
        "",
        process_rss_line(doc.get("process_rss_growth") or []),
        "",
    ]
    for outcome, reasons in s["reasons"].items():
        lines += [f"**{outcome}**:", *(f"- {n} x {why}" for why, n in reasons.items()), ""]
    lines.append(
        f"Measured on {m.get('cpu', '?')} with a 1-minute load average of "
        f"{m.get('load_avg_1m', 0):.1f} (a shared machine: figures are not benchmark figures)."
    )
    return "\n".join(lines) + "\n"


def rss_line(growth: dict[str, Any] | None) -> str:
    if growth is None:
        return "RSS growth: not measured (fewer than two samples after the 2nd minute)."
    by_role = ", ".join(
        f"{role} {growth['mb_from'].get(role, 0):.0f} -> {growth['mb_to'].get(role, 0):.0f} MB ({pct:+.1f}%)"
        if pct is not None
        else f"{role} (new)"
        for role, pct in growth["growth_pct"].items()
    )
    return (
        f"RSS from {growth['from_s']:.0f} s to {growth['to_s']:.0f} s, by role: {by_role}; "
        f"all processes {growth['total_growth_pct']:+.1f}%."
    )


def process_rss_line(own: list[dict[str, Any]]) -> str:
    if not own:
        return "RSS by process: no process lived a minute past its own 2nd minute."
    each = "; ".join(
        f"{p['role']} {p['pid']} {p['mb_from']:.0f} -> {p['mb_to']:.0f} MB "
        f"({p['from_s']:.0f}-{p['to_s']:.0f} s, {p['growth_pct']:+.1f}%)"
        for p in own
    )
    return f"RSS by process, from its 2nd minute (of the run, or of its life) to its last sample: {each}."


def _standby_back(f: dict[str, Any]) -> str:
    """When a warm standby was ready again after the fault (the next fault waits for it), and whether a
    process fault found none ready (it waited ``--recover-timeout-s``: the restart was a cold start)."""
    cold = "none ready at the fault: " if f.get("standby_ready") is False else ""
    if "standby_ready_s" not in f:
        return cold.rstrip(": ")
    back = f["standby_ready_s"]
    return cold + ("not within the wait" if back is None else str(back))


def _replicas_back(f: dict[str, Any]) -> str:
    """With replicas: when every replica's engine served again after a fault that stopped one (a 503
    before then is a restart's; a probe may have recovered sooner, on the other replica)."""
    if "replicas_back_s" not in f:
        return ""
    back = f["replicas_back_s"]
    return "not before the next fault or the end" if back is None else str(back)


def _startup(fault: dict[str, Any]) -> str:
    """The latest engine process's start-up after ``fault`` (load + compile), as /health said."""
    phases = fault.get("engine_startup_s")
    if not phases:
        return ""
    restarts = fault.get("engine_restarts")
    return " + ".join(f"{k} {v:g}" for k, v in phases.items()) + f" (restarts: {restarts})"
