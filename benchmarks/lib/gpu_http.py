"""The HTTP part of ``benchmarks/step/gpu_decode.py``: ``radixserve serve`` itself on the GPU, on
127.0.0.1, streamed chat requests through the benchmarks' client; TTFT and ITL beside the engine's own
step time at that batch (from the decode part's JSON)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.gpu_device import on_cuda, parse_capture
from benchmarks.lib.loadgen import RunConfig, run_benchmark
from benchmarks.lib.servers import free_port, radixserve_command, serving
from benchmarks.lib.workloads import WorkloadSpec, build_workload, load_tokenizer


# -- http: the server itself ------------------------------------------------------------------------
def engine_step_ms(path: Path | None, label: str, batch: int) -> float | None:
    """The ``decode`` part's step time at ``batch`` with the overlapped loop (the server's default)."""
    if path is None or not path.is_file():
        return None
    for res in json.loads(path.read_text())["results"]:
        if res["shape"] == label:
            times = [r["step_ms"] for r in res["rows"] if r["batch"] == batch and r["overlap"]]
            return statistics.median(times) if times else None
    return None


def http_part(label: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    port, conc = free_port(), args.http_concurrency
    flags = ["--log-level", "info", "--device", args.device, "--dtype", args.dtype]
    flags += ["--attention-backend", "triton"] if on_cuda(args) else ["--enforce-eager"]
    cmd = radixserve_command(port, *flags, model=str(folder), kv_cache_gb=args.kv_cache_gb)
    tokenizer = load_tokenizer(str(folder))
    spec = WorkloadSpec(
        "nosharing",
        output_tokens=args.http_tokens,
        num_requests=args.http_requests,
        prompt_tokens=args.http_prompt,
    )
    logs = args.out_dir / "logs"
    start = time.perf_counter()
    with serving("gpu-http", cmd, port, logs, timeout_s=args.server_timeout) as url:
        ready_s = time.perf_counter() - start
        cfg = RunConfig(
            url,
            request_rate=None,
            concurrency=conc,
            max_requests=args.http_requests,
            max_duration_s=args.http_duration,
        )
        doc = run_benchmark(cfg, build_workload(spec, tokenizer), tokenizer, progress=False)
    s = doc["summary"]
    step = engine_step_ms(args.engine_json, label, conc)
    itl = s["itl"]["p50_ms"]
    return {
        "shape": label,
        "concurrency": conc,
        "server_ready_s": ready_s,
        "captures": parse_capture((logs / "gpu-http.log").read_text()),
        "requests": s["requests"],
        "errors": s["errors"],
        "error_messages": s["error_messages"],
        "output_tok_s": s["output_throughput"],
        "ttft_ms": {k: s["ttft"][k] for k in ("p50_ms", "p95_ms")},
        "itl_ms": {k: s["itl"][k] for k in ("p50_ms", "p95_ms")},
        "engine_step_ms": step,
        "itl_p50_over_step": itl / step if itl is not None and step else None,
    }
