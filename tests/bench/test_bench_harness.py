"""The load generator against a real target: our server (real uvicorn, loopback port) on the tiny
random model. Checks the workloads' sharing structure and that every run's JSON is complete."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_util import running_server

# benchmarks/ is a top-level folder of the repository, not part of the installed package.
from benchmarks.lib.common import write_results
from benchmarks.lib.loadgen import RunConfig, run_benchmark, runs_markdown
from benchmarks.lib.metrics import LATENCIES, PERCENTILES
from benchmarks.lib.workloads import Corpus, WorkloadSpec, build_workload, load_tokenizer
from radixserve.config import EngineConfig

SUMMARY_KEYS = {
    "requests",
    "completed",
    "errors",
    "duration_s",
    "prompt_tokens",
    "output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "cached_token_fraction",
    "prefix_hit_rate",
    "prefix_hit_tokens",
    "prefix_query_tokens",
    "error_messages",
    "arrival_lag_p99_ms",
    "timed_out",
    *LATENCIES,
}
ROW_KEYS = {
    "session",
    "turn",
    "kind",
    "sent_ms",
    "ttft_ms",
    "e2e_ms",
    "tpot_ms",
    "itl_ms",
    "prompt_tokens",
    "output_tokens",
    "cached_tokens",
    "error",
}


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Any:
    return load_tokenizer(str(tiny_llama))


@pytest.fixture(scope="module")
def corpus(tokenizer: Any) -> Corpus:
    return Corpus(tokenizer)


@pytest.fixture(scope="module")
def url(tiny_llama: Path) -> Iterator[str]:
    config = EngineConfig(str(tiny_llama), page_size=4, num_pages=4096, max_running_requests=16)
    with running_server(config) as base:
        yield base


def _check_complete(run: dict[str, Any], expected: int, output_tokens: int) -> None:
    s = run["summary"]
    assert set(s) >= SUMMARY_KEYS
    for name in LATENCIES:
        assert {f"p{q}_ms" for q in PERCENTILES} | {"mean_ms"} == set(s[name])
        assert all(v is not None and v >= 0 for v in s[name].values())
    assert (s["requests"], s["completed"], s["errors"]) == (expected, expected, 0), s["error_messages"]
    assert s["output_tokens"] == expected * output_tokens  # ignore_eos: every request runs to max_tokens
    assert s["output_throughput"] > 0 and s["request_throughput"] > 0
    assert len(run["requests"]) == expected
    for row in run["requests"]:
        assert set(row) == ROW_KEYS
        assert row["error"] is None and row["output_tokens"] == output_tokens
        assert row["ttft_ms"] <= row["e2e_ms"]
    assert {"base_url", "mode", "model", "workload"} <= set(run["meta"])


def test_workloads_share_what_they_claim(tokenizer: Any, corpus: Corpus) -> None:
    spec = WorkloadSpec(name="rag", seed=7, num_docs=3, questions_per_doc=2, doc_tokens=40)
    rag = build_workload(spec, tokenizer, corpus)
    prompts = [s.turns[0].user for s in rag.sessions]
    assert prompts == [s.turns[0].user for s in build_workload(spec, tokenizer, corpus).sessions]
    docs = [p.split("\n\n")[0] for p in prompts]
    assert docs[:3] == docs[3:] and len(set(docs)) == 3  # interleaved: d0 d1 d2 d0 d1 d2
    doc_len = len(tokenizer(docs[0].removeprefix("Document:\n"), add_special_tokens=False)["input_ids"])
    assert abs(doc_len - 40) <= 4  # calibrated in the model's tokens
    unique = build_workload(
        WorkloadSpec(name="nosharing", seed=1, num_requests=6, prompt_tokens=30), tokenizer, corpus
    )
    starts = [s.turns[0].user[:60] for s in unique.sessions]
    assert len(set(starts)) == 6
    few = build_workload(
        WorkloadSpec(name="fewshot", num_examples=2, example_tokens=20, num_requests=3), tokenizer, corpus
    )
    heads = {s.turns[0].user.rsplit("Passage:", 1)[0] for s in few.sessions}
    assert len(heads) == 1 and next(iter(heads)).count("Topic:") == 2


def test_closed_loop_multiturn_json_is_complete(
    url: str, tokenizer: Any, corpus: Corpus, tmp_path: Path
) -> None:
    spec = WorkloadSpec(name="multiturn", num_sessions=2, turns=3, turn_tokens=24, output_tokens=5)
    workload = build_workload(spec, tokenizer, corpus)
    cfg = RunConfig(base_url=url, request_rate=None, concurrency=2, max_requests=50, max_duration_s=120)
    run = run_benchmark(cfg, workload, tokenizer, progress=False)
    _check_complete(run, 6, 5)
    assert all(len(s.answers) == 3 for s in workload.sessions)
    by_turn = {(r["session"], r["turn"]): r for r in run["requests"]}
    for session in range(2):  # each turn's prompt holds the previous turn's prompt and answer
        assert by_turn[(session, 1)]["prompt_tokens"] > by_turn[(session, 0)]["prompt_tokens"] + 5
        assert by_turn[(session, 2)]["prompt_tokens"] > by_turn[(session, 1)]["prompt_tokens"] + 5
    doc = {"machine": {"date": "d", "cpu": "c", "cpus": 2}, "runs": [run]}
    json_path, md_path = write_results("t", doc, out_dir=tmp_path, markdown=runs_markdown("t", doc))
    assert json.loads(json_path.read_text())["runs"][0]["summary"]["completed"] == 6
    assert md_path.read_text().count("| multiturn |") == 1


def test_open_loop_rag_reports_prefix_hits_and_respects_bounds(
    url: str, tokenizer: Any, corpus: Corpus
) -> None:
    spec = WorkloadSpec(name="rag", seed=3, num_docs=2, questions_per_doc=3, doc_tokens=64, output_tokens=4)
    cfg = RunConfig(
        base_url=url,
        endpoint="completions",
        request_rate=50.0,
        scenario="burst",
        burst_start_s=0.0,
        max_requests=5,
        max_duration_s=120,
    )
    run = run_benchmark(cfg, build_workload(spec, tokenizer, corpus), tokenizer, progress=False)
    _check_complete(run, 5, 4)  # bounded at 5 of the 6 requests
    s = run["summary"]
    assert s["prefix_query_tokens"] == s["prompt_tokens"]  # /metrics deltas cover exactly this run
    assert 0 < s["prefix_hit_rate"] < 1  # later questions reuse their document
    assert s["arrival_lag_p99_ms"] is not None and run["meta"]["burst_factor"] == 5.0


def test_hf_quant_bench_draws_its_speed_plot(tmp_path: Path) -> None:
    from benchmarks.serving import hf_quant_bench

    speed = {
        "radix-awq": {"1 stream": 63.4, "8 streams": 141.0},
        "vllm-awq": {"1 stream": 34.9, "8 streams": 99.0},
    }
    png = tmp_path / "speed.png"
    assert hf_quant_bench.plot_speed(speed, png) == [png]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert hf_quant_bench.plot_speed({}, tmp_path / "none.png") == []  # nothing measured: no plot
