"""benchmarks/step/gpu_decode.py's dry run on the CPU with the tiny model: every part's code runs (the
GPU figures themselves come from benchmarks/gpu_check.sh on a GPU), and the capture line it parses is
the one model/cuda_graphs.py logs."""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path

import pytest

from benchmarks.lib import gpu_device
from benchmarks.step import gpu_decode
from radixserve.model import cuda_graphs

FORMAT = "captured decode CUDA graphs at batch %s in %.2f s, %.1f MiB"
DRY = ["--device", "cpu", "--dtype", "float32", "--kv-cache-gb", "0.05", "--copy-mib", "8"]


def test_the_capture_line_is_parsed_as_cuda_graphs_logs_it() -> None:
    assert FORMAT in inspect.getsource(cuda_graphs.capture)  # the line the parser reads
    with gpu_device.capture_log() as log:
        logging.getLogger("radixserve.model").info(FORMAT, "1,2,4,8", 1.234, 56.78)
    assert log.captures == [{"buckets": [1, 2, 4, 8], "seconds": 1.23, "pool_mib": 56.8}]
    assert gpu_device.parse_capture("x INFO radixserve.model: " + FORMAT % ("1,2", 0.5, 3.0)) == [
        {"buckets": [1, 2], "seconds": 0.5, "pool_mib": 3.0}
    ]


def test_the_dry_run_measures_every_in_process_part(tiny_llama: Path, tmp_path: Path) -> None:
    argv = [
        *DRY,
        "--model",
        str(tiny_llama),
        "--parts",
        "graphs",
        "decode",
        "tier",
        "--out-dir",
        str(tmp_path),
    ]
    argv += ["--batches", "1", "2", "--prompt-len", "12", "--new-tokens", "6", "--probe", "3"]
    argv += ["--probe-tokens", "4", "--tier-prefix", "48", "--host-cache-gb", "0.01"]
    assert gpu_decode.main(argv) == 0
    graphs = json.loads((tmp_path / "gpu_decode-graphs.json").read_text())["results"][0]
    assert graphs["identical"] == 1.0 and len(graphs["tokens"]["on"]) == 3
    decode = json.loads((tmp_path / "gpu_decode-decode.json").read_text())
    rows = decode["results"][0]["rows"]
    assert {(r["batch"], r["overlap"]) for r in rows} == {(1, True), (1, False), (2, True), (2, False)}
    assert all(r["tok_s"] > 0 and r["steps"] > 0 and r["pct_of_copy_peak"] > 0 for r in rows)
    assert decode["hbm"]["copy_bytes_per_s"] > 0 and len(decode["results"][0]["recompute_ttft_ms"]) == 2
    tier = json.loads((tmp_path / "gpu_decode-tier.json").read_text())["results"][0]
    assert all(h["cached_tokens"] >= 48 and h["host_pages"] == 3 for h in tier["hits"])
    assert tier["recompute_ttft_ms"] == decode["results"][0]["recompute_ttft_ms"]
    md = (tmp_path / "gpu_decode-tier.md").read_text()
    assert "| tiny-llama-0 |" in md and "3 of 3" in md


def test_the_dry_run_serves_over_http(tiny_llama: Path, tmp_path: Path) -> None:
    decode = {
        "results": [{"shape": tiny_llama.name, "rows": [{"batch": 2, "overlap": True, "step_ms": 4.0}]}]
    }
    (tmp_path / "gpu_decode-decode.json").write_text(json.dumps(decode))
    argv = [*DRY, "--model", str(tiny_llama), "--parts", "http", "--out-dir", str(tmp_path)]
    argv += ["--http-concurrency", "2", "--http-requests", "2", "--http-prompt", "24", "--http-tokens", "4"]
    assert gpu_decode.main(argv) == 0
    http = json.loads((tmp_path / "gpu_decode-http.json").read_text())["results"][0]
    assert http["errors"] == 0 and http["requests"] == 2 and http["engine_step_ms"] == 4.0
    assert http["ttft_ms"]["p50_ms"] > 0 and http["itl_ms"]["p50_ms"] == pytest.approx(
        4.0 * http["itl_p50_over_step"]
    )
