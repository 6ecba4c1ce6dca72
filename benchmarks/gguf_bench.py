"""GGUF-native weights against fp32: the decode step at batch 1 and 8 and a 512-token prefill, for the
default model as served (compiled step, C++ attention), both engines in one process.

The fp32 engine's weights are the exact dequantization of the GGUF file the gguf engine multiplies in
its blocks, so the two compute the same products (up to summation order). The engines' steps are
timed in turns, round after round, and each figure is the median over its rounds, so a shared
machine's load falls on both alike; the ratio is the figure to quote.

    python -m benchmarks.gguf_bench [--batches 1,8] [--context 512] [--rounds 5] [--cpu-time]

``--cpu-time`` runs one thread and times each step by this process's CPU time, which other load on a
shared machine does not inflate (wall time there can be 30x the idle figure).

Writes benchmarks/results/gguf_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import step_bench
from benchmarks.common import write_results
from benchmarks.step_bench import Steps
from radixserve import Engine
from radixserve.model.quant import weight_bytes


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line), "")


def cpu_median(fn: Callable[[], Any], repeats: int) -> float:
    """``step_bench.median_of`` by this process's CPU time."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5, help="steps per round (median)")
    parser.add_argument("--cpu-time", action="store_true", help="one thread, timed by CPU time")
    args = parser.parse_args()
    if args.cpu_time:
        torch.set_num_threads(1)
        step_bench.median_of = cpu_median  # Steps times its steps through this
    engines = {
        "fp32": Engine(prefix_cache=False, kv_cache_gb=1.0),
        "gguf": Engine(prefix_cache=False, kv_cache_gb=1.0, quantization="gguf"),
    }
    steps = {name: Steps(engine) for name, engine in engines.items()}
    cases = [f"decode {b} x {args.context}" for b in args.batches.split(",")] + [f"prefill {args.prefill}"]
    times: dict[str, dict[str, list[float]]] = {n: {c: [] for c in cases} for n in engines}
    for _ in range(args.rounds):
        for case in cases:
            for name, s in steps.items():
                if case.startswith("decode"):
                    batch = int(case.split()[1])
                    t = s.decode(batch, args.context, args.repeats)
                else:
                    t = s.extend(args.prefill, 0, max(2, args.repeats // 2))
                times[name][case].append(t)
    median = {n: {c: sorted(v)[len(v) // 2] * 1e3 for c, v in cs.items()} for n, cs in times.items()}
    sizes = {n: weight_bytes(e.model)["total_bytes"] for n, e in engines.items()}
    rows: list[list[Any]] = [
        [case, median["fp32"][case], median["gguf"][case], median["fp32"][case] / median["gguf"][case]]
        for case in cases
    ]
    rows.append(["weight MB held", sizes["fp32"] / 1e6, sizes["gguf"] / 1e6, sizes["fp32"] / sizes["gguf"]])
    for row in rows:
        print(row, flush=True)
    how = ", 1 thread, timed by CPU time" if args.cpu_time else ""
    write_results(
        "gguf_bench",
        {"cpu": cpu_name(), "args": vars(args), "median_ms": median, "weight_bytes": sizes},
        rows,
        ["step", "fp32 ms", "gguf ms", "fp32 / gguf"],
        title=f"GGUF-native weights against fp32 ({cpu_name()}{how})",
    )


if __name__ == "__main__":
    main()
