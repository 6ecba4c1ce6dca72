"""The native decode step against the torch step it replaces, side by side in one run.

For each mode (benchmarks/lib/modes.py names: fp32, gguf, bf16+kv-bf16 (``--dtype bfloat16``), ...), one
engine; for each batch x context, the
same decode steps timed alternately through the torch model (``runner.native`` off: the step as it was
before) and through the native step (``model/native_step.py``), so a shared machine's load falls on
both alike. Each is quoted against the step's physical limit (bytes over the measured bandwidth, or
flops over the measured fp32 peak, whichever is larger; benchmarks/lib/modes.py), and as a ratio.

    python -m benchmarks.step.native_step_bench [--modes fp32,gguf,bf16+kv-bf16] [--batches 1,8] \
        [--contexts 512] [--model FOLDER]

``--model``: another HF folder (the 1B shape: ``python -m benchmarks.step.big_model``), not a GGUF file.

Writes benchmarks/results/<name>.{json,md} (``--name``, default native_step).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from benchmarks.lib.common import RESULTS, args_json, write_results
from benchmarks.lib.modes import Shapes, StepModel, engine_options, parse_modes
from benchmarks.lib.steps import Steps, measure_limits
from benchmarks.step.step_modes import PAGE_SIZE, engine_formats, engine_kv_dtype, used_arithmetics
from radixserve import Engine
from radixserve.model.runner import ModelRunner

HEADER = ["mode", "step", "limit ms", "torch ms", "% of limit", "native ms", "% of limit", "speed-up"]


def alternate(steps: Steps, batch: int, context: int, repeats: int) -> tuple[float, float]:
    """Median seconds of the torch step and of the native step, run in turns over the same sequences."""
    runner = steps.runner
    assert isinstance(runner, ModelRunner)
    native = runner.native
    step, tables = steps.decode_step(batch, context, 2 * repeats + 2, prefill=True)
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(2 * repeats + 2):
        on = i % 2 == 1
        runner.native = native if on else None
        start = time.perf_counter()
        step()
        if i >= 2:  # one warm-up each
            times[on].append(time.perf_counter() - start)
    runner.native = native
    steps.release(tables)
    return tuple(sorted(t)[len(t) // 2] for t in (times[False], times[True]))  # type: ignore[return-value]


def products(engine: Engine, rows: list[int], repeats: int) -> dict[int, float]:
    """Median seconds of one pass of ``rows`` activation rows through every decoder linear (the
    weight objects' own products, the few-row kernels), the row counts timed in turns."""
    linears = [
        m for name, m in engine.model.named_modules() if name.startswith("layers.") and name.endswith("proj")
    ]
    gen = torch.Generator().manual_seed(0)
    dtype = engine.model.norm.weight.dtype  # the activations' dtype (bf16 weights: bf16)
    ks = {m.in_features for m in linears}
    xs = {r: {k: torch.randn(r, k, generator=gen).to(dtype) for k in ks} for r in rows}
    times: dict[int, list[float]] = {r: [] for r in rows}
    with torch.no_grad():
        for i in range(repeats + 1):
            for r in rows:
                start = time.perf_counter()
                for m in linears:
                    m(xs[r][m.in_features])
                if i:
                    times[r].append(time.perf_counter() - start)
    return {r: sorted(t)[len(t) // 2] for r, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step.native_step_bench", description=__doc__)
    parser.add_argument("--modes", default="fp32,gguf")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--contexts", default="512")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--name", default="native_step")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--model", default=None, help="an HF model folder (default: the default model)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    modes = parse_modes(args.modes)
    limits = measure_limits(arithmetics=used_arithmetics(modes))
    print(f"limits: {limits}", flush=True)
    results: dict[str, Any] = {"limits": limits.as_json(), "modes": {}}
    rows: list[list[Any]] = []
    for mode in modes:
        pages = max(batches) * -(-(max(contexts) + 2 * args.repeats + 8) // PAGE_SIZE) + 8
        engine = Engine(
            prefix_cache=False,
            page_size=PAGE_SIZE,
            num_pages=pages,
            max_model_len=max(contexts) + 64,
            model=args.model,
            **engine_options(mode),
        )
        if not isinstance(engine.runner, ModelRunner) or engine.runner.native is None:
            rows.append([mode.name, "native step not chosen for this mode (see the log)"] + [""] * 6)
            continue
        model = StepModel(Shapes.of(engine.model.config), engine_formats(engine), engine_kv_dtype(engine))
        steps = Steps(engine)
        res: dict[str, Any] = {}
        for context in contexts:
            for b in batches:
                torch_s, native_s = alternate(steps, b, context, args.repeats)
                limit = limits.seconds(*model.decode(b, context, "int8" if mode.decode == "int8" else None))
                res[f"decode_b{b}_c{context}"] = {
                    "limit_ms": limit * 1e3,
                    "torch_ms": torch_s * 1e3,
                    "torch_pct_of_limit": 100 * limit / torch_s,
                    "native_ms": native_s * 1e3,
                    "native_pct_of_limit": 100 * limit / native_s,
                    "speedup": torch_s / native_s,
                }
                e = res[f"decode_b{b}_c{context}"]
                rows.append(
                    [
                        mode.name,
                        f"decode {b} x {context}",
                        e["limit_ms"],
                        e["torch_ms"],
                        e["torch_pct_of_limit"],
                    ]
                    + [e["native_ms"], e["native_pct_of_limit"], e["speedup"]]
                )
                print(rows[-1], flush=True)
        cost = products(engine, [1, 8], args.repeats)
        res["products_ms"] = {str(r): t * 1e3 for r, t in cost.items()}
        rows.append(
            [mode.name, "decoder linears only, 1 row -> 8 rows (ms; 8-row / 1-row cost)", "", cost[1] * 1e3]
            + ["", cost[8] * 1e3, "", cost[8] / cost[1]]
        )
        print(rows[-1], flush=True)
        results["modes"][mode.name] = res
        del steps, engine
    peaks = ", ".join(f"{a} {p:.0f}" for a, p in limits.peaks_gflop_s.items())
    write_results(
        args.name,
        {"args": args_json(args), **results},
        rows,
        HEADER,
        f"Decode step, torch model vs native step, alternating in one run ({args.model or 'SmolLM2-135M'}; "
        f"read bandwidth {limits.bandwidth_gb_s:.1f} GB/s, peaks GFLOP/s: {peaks}, measured in this run)",
        RESULTS,
    )


if __name__ == "__main__":
    main()
