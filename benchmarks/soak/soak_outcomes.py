"""The soak's verdicts (benchmarks/soak/soak.py): each request's outcome, each fault's recovery, the
per-second timeline, and the page accounting read from /metrics.

Outcomes (``OUTCOMES``), one per request:
- ``ok``: the answer, whole (a dropped stream: the client's own disconnect after its chunks);
- ``shed_429``: refused with a 429 (queue full, pin budget);
- ``bad_input_4xx``: a bad input refused with a 4xx, as it must be (and a delete of a pin that is gone);
- ``restart_503``: a 503 (a body or a stream's error event) while a process was being restarted: it
  failed or was sent between a fault and the first probe that succeeded after it (plus ``GRACE_S``);
- ``error_4xx``: a 4xx to a valid request; ``error_5xx``: any other 5xx, with its message;
- ``lost``: no answer within the bound, a transport failure, or a stream cut without an error event;
- ``wrong``: a 200 whose content is wrong: a probe that differs from its idle-server baseline, echo
  logprobs of the wrong length, a required tool call missing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from benchmarks.soak.soak_faults import STANDBY
from benchmarks.soak.soak_records import Record

OUTCOMES = ("ok", "shed_429", "bad_input_4xx", "restart_503", "error_4xx", "error_5xx", "lost", "wrong")
GRACE_S = 2.0
UNAVAILABLE = {"service_unavailable_error"}


def fault_windows(faults: Sequence[dict[str, Any]], end: float) -> list[tuple[float, float]]:
    """[injected, recovered + GRACE_S] of each fault (to the run's end when it never recovered). With
    replicas, a probe may be answered by the replica the fault spared while the other restarts its
    engine: the window lasts until every replica's engine serves again (``replicas_back_s``)."""
    out = []
    for f in faults:
        if "skipped" in f:  # not injected: no 503 is excused by it
            continue
        rec = f.get("recovered_at_s")
        stop = end if rec is None else rec
        if "replicas_back_s" in f:
            stop = end if f["replicas_back_s"] is None else max(stop, f["at_s"] + f["replicas_back_s"])
        out.append((f["at_s"], stop + GRACE_S))
    return out


def classify(r: Record, windows: Sequence[tuple[float, float]]) -> str:
    reply = r.reply
    if reply.transport:
        return "lost"
    status, err = reply.status, reply.error or {}
    in_window = any(a <= r.finished <= b or a <= r.sent <= b for a, b in windows)
    unavailable = status == 503 or err.get("type") in UNAVAILABLE
    if unavailable:
        return "restart_503" if in_window else "error_5xx"
    if status == 429 or err.get("type") == "rate_limit_error":
        return "shed_429"
    if status == 200 and reply.error is not None:
        return "error_5xx"  # a stream that ended with an error event other than a 503
    if status == 200:
        if not reply.done:
            return "lost"
        return "wrong" if r.mismatch else "ok"
    if status is not None and 400 <= status < 500:
        return "bad_input_4xx" if r.expect_4xx else "error_4xx"
    return "error_5xx"


def recover(faults: list[dict[str, Any]], probes: Sequence[Record]) -> None:
    """Set each fault's ``recovered_at_s`` and ``recovery_s``: the first probe sent after the fault
    took hold that answered correctly (a hang's probe waits for the hang to end, or for the server to
    replace the process)."""
    ok = sorted((p for p in probes if p.reply.done and not p.mismatch), key=lambda p: p.finished)
    for f in faults:
        if "skipped" in f:  # not injected: nothing to recover from
            continue
        first = next((p for p in ok if p.sent >= f["at_s"]), None)
        f["recovered_at_s"] = None if first is None else round(first.finished, 3)
        f["recovery_s"] = None if first is None else round(first.finished - f["at_s"], 3)


def back(faults: list[dict[str, Any]], states: Sequence[tuple[float, str | None]], key: str) -> None:
    """Set each fault's ``key``: from the fault to the first "ready" in ``states`` after they last
    said otherwise (None: not again before the next fault or the end); a fault that never took it
    away (it stayed "ready") gets none. ``states``: /health's word on the warm standby
    (``standby_ready_s``), or whether every replica's engine serves (``replicas_back_s``)."""
    for i, f in enumerate(faults):
        if "skipped" in f:
            continue
        end = faults[i + 1]["at_s"] if i + 1 < len(faults) else float("inf")
        window = [(t, state) for t, state in states if f["at_s"] <= t < end]
        used = [k for k, (_, state) in enumerate(window) if state != "ready"]
        if used:
            ready = next((t for t, state in window[used[-1] :] if state == "ready"), None)
            f[key] = None if ready is None else round(ready - f["at_s"], 1)


def summarize(records: Sequence[Record], faults: list[dict[str, Any]], end: float) -> dict[str, Any]:
    """Outcome counts overall and by kind, the 5xx and lost messages, and the ok throughput."""
    windows = fault_windows(faults, end)
    outcome = [classify(r, windows) for r in records]
    by_kind: dict[str, Counter[str]] = {}
    for r, o in zip(records, outcome, strict=True):
        by_kind.setdefault(r.kind, Counter())[o] += 1
    reasons: dict[str, Counter[str]] = {o: Counter() for o in ("error_5xx", "error_4xx", "lost", "wrong")}
    for r, o in zip(records, outcome, strict=True):
        if o in reasons:
            err = r.reply.error or {}
            why = (
                r.mismatch or str(err.get("message", "")) or r.reply.transport or "stream cut, no error event"
            )
            reasons[o][f"{r.kind} {r.reply.status}: {why[:140]}"] += 1
    totals = Counter(outcome)
    return {
        "requests": len(records),
        "outcomes": {o: totals.get(o, 0) for o in OUTCOMES},
        "by_kind": {k: {o: c.get(o, 0) for o in OUTCOMES} for k, c in sorted(by_kind.items())},
        "reasons": {o: dict(c.most_common(12)) for o, c in reasons.items() if c},
        "ok_per_s": totals.get("ok", 0) / end if end > 0 else 0.0,
        "per_request": outcome,
    }


def timeline(records: Sequence[Record], outcomes: Sequence[str], end: float) -> dict[str, list[float]]:
    """Per second of the run: ok answers finished, output tokens of those, failures (not ok, not an
    expected 4xx or 429) and 429s."""
    n = int(end) + 1
    ok, tokens, failed, shed = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
    for r, o in zip(records, outcomes, strict=True):
        s = min(n - 1, max(0, int(r.finished)))
        if o == "ok":
            ok[s] += 1
            tokens[s] += r.reply.tokens
        elif o == "shed_429":
            shed[s] += 1
        elif o != "bad_input_4xx":
            failed[s] += 1
    return {"t": [float(i) for i in range(n)], "ok": ok, "tokens": tokens, "failed": failed, "shed": shed}


def rss_growth(samples: Sequence[dict[str, Any]], from_s: float) -> dict[str, Any] | None:
    """Resident memory by role (MB summed over its processes) at the first sample at or after ``from_s``
    and at the last one, and the growth between them in percent (None before there are two such
    samples). A role's processes may have been replaced by a fault in between: the totals are compared.
    The total leaves the warm standbys out: how many there are (one taken by a fault, its successor
    still loading) changes with the faults, not with a leak, and added 1.7 GB to a run's total."""
    later = [x for x in samples if x["t_s"] >= from_s]
    if len(later) < 2:
        return None
    first, last = later[0], later[-1]
    roles = sorted(set(first["mb"]) | set(last["mb"]))
    growth = {
        r: round(100 * (last["mb"].get(r, 0.0) / first["mb"][r] - 1), 2) if first["mb"].get(r) else None
        for r in roles
    }
    total_a, total_b = (sum(mb for r, mb in x["mb"].items() if r != STANDBY) for x in (first, last))
    return {
        "from_s": first["t_s"],
        "to_s": last["t_s"],
        "mb_from": first["mb"],
        "mb_to": last["mb"],
        "growth_pct": growth,
        "total_growth_pct": round(100 * (total_b / total_a - 1), 2) if total_a else None,
    }


def process_rss_growth(
    samples: Sequence[dict[str, Any]], from_s: float, min_span_s: float = 60.0
) -> list[dict[str, Any]]:
    """Each process's own growth (Ray's helper processes aside): from its first sample ``from_s``
    into its life (into the run, for one there from the start) to its last, where that spans at least
    ``min_span_s``. A process a fault started is young at the run's 2nd minute and the one it
    replaced was old: only the same process, past its own start-up, tells a leak from a restart. A
    warm standby's life counts from when it took over (its start-up at nice 19 may outlast minutes)."""
    seen: dict[str, list[tuple[float, str, float]]] = {}
    for x in samples:
        for pid, (role, mb) in x.get("procs", {}).items():
            seen.setdefault(pid, []).append((x["t_s"], role, mb))
    out = []
    for pid, points in seen.items():
        points = [p for p in points if p[1] != STANDBY]
        if not points or points[0][1] == "other":
            continue
        born, role = points[0][0], points[0][1]
        start = from_s if born == samples[0]["t_s"] else born + from_s
        window = [p for p in points if p[0] >= start]
        if len(window) < 2 or window[-1][0] - window[0][0] < min_span_s:
            continue
        (t_a, _, mb_a), (t_b, _, mb_b) = window[0], window[-1]
        out.append(
            {
                "pid": int(pid),
                "role": role,
                "from_s": t_a,
                "to_s": t_b,
                "mb_from": mb_a,
                "mb_to": mb_b,
                "growth_pct": round(100 * (mb_b / mb_a - 1), 2) if mb_a else None,
            }
        )
    return out


def hang_errors(faults: Sequence[dict[str, Any]], records: Sequence[Record]) -> None:
    """For each stop-engine fault, ``hang_error_s``: seconds from the SIGSTOP to the first error a
    request got that names the hang (the watchdog's 503), None when none did."""
    for f in faults:
        if f["name"] != "stop-engine" or "skipped" in f:
            continue
        times = [
            r.finished - f["at_s"]
            for r in records
            if r.finished >= f["at_s"] and "hung" in str((r.reply.error or {}).get("message", ""))
        ]
        f["hang_error_s"] = round(min(times), 3) if times else None


def page_accounting(metrics: dict[str, float]) -> dict[str, Any]:
    """free + cached + in-use == total from /metrics' gauges (summed over engines), and in-use 0 (the
    server is idle when this is read: a page still held privately is leaked)."""
    get = lambda name: metrics.get(f"radixserve:{name}")  # noqa: E731
    free, cached, used, total = (
        get(n) for n in ("kv_pages_free", "kv_pages_cached", "kv_pages_used", "kv_pages_total")
    )
    known = None not in (free, cached, used, total)
    return {
        "free": free,
        "cached": cached,
        "in_use": used,
        "total": total,
        "pinned": get("pinned_pages"),
        "balanced": bool(known and free + cached + used == total),  # type: ignore[operator]
        "leaked": None if not known else used,
        # What the tiers saw over the server's life (summed over tiers and engines): disk files
        # rejected as torn or corrupt, loads that failed and were recomputed.
        "tier_counters": {
            k.removeprefix("radixserve:kv_tier_"): v
            for k, v in sorted(metrics.items())
            if k.startswith("radixserve:kv_tier_") and k.endswith("_total")
        },
        "running": get("num_requests_running"),
        "waiting": get("num_requests_waiting"),
    }
