"""benchmarks/serving/pin_bench.py's logic against the real server on loopback, on the tiny random model:
the pool its sizing rule gives really evicts the unpinned system prompt under the fillers, and a pin
keeps it; the summary and the plot come from what was measured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from server_util import running_server

from benchmarks.lib.servers import SERVED_NAME
from benchmarks.lib.workloads import load_tokenizer
from benchmarks.serving import pin_bench
from benchmarks.serving.pin_bench import Sample, build_workload, fillers_for, pool_pages, run_phase, summarize
from radixserve.config import EngineConfig

PAGE = 4
SYSTEM, FILLER = 120, 60


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Any:
    return load_tokenizer(str(tiny_llama))


def test_sizing_fills_the_pool_each_round() -> None:
    pages = pool_pages(1500, 700, 16)
    assert pages * 16 >= 1500 + pin_bench.context_tokens(1500, 700)  # the pin and one request fit
    fillers = fillers_for(pages, 16, 700)
    assert fillers * 700 >= pages * 16  # a round's fillers alone fill the pool


def test_summary_percentiles_from_known_samples() -> None:
    samples = [Sample("system", -1, 9999.0, 100, 0)]  # the untimed first request is left out
    samples += [Sample("system", r, float(t), 100, 90) for r, t in enumerate([10, 20, 30, 40, 50])]
    samples += [Sample("filler", 0, 7.0, 50, 0), Sample("filler", 0, None, 50, 0, error="500: x")]
    s = summarize(samples)
    assert s["system"]["requests"] == 5 and s["system"]["ttft_p50_ms"] == 30.0
    assert s["system"]["ttft_p95_ms"] == pytest.approx(48.0)
    assert s["system"]["cached_fraction"] == pytest.approx(0.9)
    assert s["filler"]["requests"] == 1 and s["errors"] == ["500: x"]


def test_the_pin_keeps_the_system_prompt_that_the_fillers_evict_without_it(
    tiny_llama: Path, tokenizer: Any, tmp_path: Path
) -> None:
    pages = pool_pages(SYSTEM, FILLER, PAGE)
    fillers = fillers_for(pages, PAGE, FILLER)
    workload = build_workload(tokenizer, SYSTEM, FILLER, rounds=2, fillers=fillers)
    config = EngineConfig(
        str(tiny_llama),
        page_size=PAGE,
        num_pages=pages,
        max_model_len=pin_bench.context_tokens(SYSTEM, FILLER),
        max_pinned_fraction=0.6,
        enforce_eager=True,
    )
    phases: dict[str, list[Sample]] = {}
    for name in pin_bench.PHASES:  # a fresh server per phase, as the benchmark runs them
        with running_server(config, model_name=SERVED_NAME) as url:
            phases[name] = run_phase(url, workload, pin=name == "pinned", max_tokens=2)
    for name, samples in phases.items():
        assert all(s.error is None for s in samples), (name, [s.error for s in samples])
        assert len(samples) == 1 + 2 * (fillers + 1)
    timed = {
        name: [s for s in samples if s.kind == "system" and s.round >= 0] for name, samples in phases.items()
    }
    system_len = len(tokenizer(workload.system, add_special_tokens=False)["input_ids"])
    # Unpinned: the fillers evicted every page of the system prompt before each system request.
    assert all(s.cached_tokens < PAGE for s in timed["unpinned"]), [
        s.cached_tokens for s in timed["unpinned"]
    ]
    # Pinned: every system request finds the whole system prompt cached, on the device.
    for s in timed["pinned"]:
        assert s.cached_tokens >= system_len // PAGE * PAGE - PAGE, (s.cached_tokens, system_len)
        assert s.cached_tokens_by_tier.get("device") == s.cached_tokens
    summary = {name: summarize(samples) for name, samples in phases.items()}
    assert (
        summary["pinned"]["system"]["cached_fraction"]
        > 0.5
        > summary["unpinned"]["system"]["cached_fraction"]
    )
    png = tmp_path / "pin_bench.png"
    pin_bench.plot(phases, png, "tiny")
    assert png.stat().st_size > 1000
