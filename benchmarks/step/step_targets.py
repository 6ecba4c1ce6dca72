"""Issue 21's step-level targets, checked against one ``step_bench --modes`` run (and, where given,
``accuracy_bench``'s figures of the same modes).

The speed-ups are against the ``fp32`` mode of the same run. Once the small-row kernels are merged,
that fp32 is itself faster than the issue's "today's fp32", so a ratio here understates the gain over
the issue's figures; the issue's own baseline was measured on another machine and is not used.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Target:
    what: str
    kind: str  # "pct": a mode's % of its limit; "speedup": fp32 ms / mode ms; "accuracy": a field
    mode: str
    step: str
    goal: float
    higher: bool = True
    field: str = ""  # kind "accuracy": the accuracy_bench field


ARITH_MODES = ("fp32+prefill-int8", "fp32+prefill-bf16", "gguf+prefill-int8", "gguf+prefill-bf16")
TARGETS = (
    Target("fp32 decode 1 x 512 at >= 60% of its byte limit", "pct", "fp32", "decode_b1_c512", 60.0),
    Target("GGUF-exact decode 8 x 512 >= 2.5x fp32", "speedup", "gguf", "decode_b8_c512", 2.5),
    Target("GGUF-exact decode 1 x 512 >= 3x fp32", "speedup", "gguf", "decode_b1_c512", 3.0),
    Target("bf16 KV decode 8 x 2048 >= 1.3x fp32 KV", "speedup", "fp32+kv-bf16", "decode_b8_c2048", 1.3),
    Target(
        "bf16 KV mean abs d loglik <= 0.01",
        "accuracy",
        "fp32+kv-bf16",
        "",
        0.01,
        higher=False,
        field="mean_abs_dloglik",
    ),
    *(Target(f"{m}: prefill 512 >= 2x fp32", "speedup", m, "prefill_512", 2.0) for m in ARITH_MODES),
    *(
        Target(f"{m}: top-1 agreement >= 95%", "accuracy", m, "", 0.95, field="top1_agreement")
        for m in ARITH_MODES
    ),
)


def _step(modes: Mapping[str, Any], mode: str, step: str) -> dict[str, Any] | None:
    entry = modes.get(mode, {}).get("steps", {}).get(step)
    return entry if isinstance(entry, dict) else None


def measured(target: Target, modes: Mapping[str, Any], accuracy: Mapping[str, Any]) -> float | None:
    """The figure ``target`` is about, or None where its modes or steps did not run."""
    if target.kind == "accuracy":
        acc = accuracy.get(target.mode, {}).get("accuracy") or {}
        value = acc.get(target.field)
        return None if value is None else float(value)
    entry = _step(modes, target.mode, target.step)
    if entry is None:
        return None
    if target.kind == "pct":
        pct = entry.get("pct_of_limit")
        return None if pct is None else float(pct)
    base = _step(modes, "fp32", target.step)
    return None if base is None else float(base["ms"]) / float(entry["ms"])


def target_rows(modes: Mapping[str, Any], accuracy: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Each target with its measured figure and whether it is met (None: not run)."""
    out = []
    for t in TARGETS:
        value = measured(t, modes, accuracy or {})
        met = None if value is None else (value >= t.goal if t.higher else value <= t.goal)
        out.append({"target": t.what, "goal": t.goal, "value": value, "met": met})
    return out


def render(rows: list[dict[str, Any]]) -> str:
    """The targets as a Markdown section."""
    lines = ["", "## Targets (issue 21; speed-ups against this run's fp32 mode)", ""]
    lines += ["| target | measured | met |", "|---|---|---|"]
    for r in rows:
        value = "-" if r["value"] is None else f"{r['value']:.3g}"
        met = "not run" if r["met"] is None else ("yes" if r["met"] else "no")
        lines.append(f"| {r['target']} | {value} | {met} |")
    return "\n".join(lines) + "\n"
