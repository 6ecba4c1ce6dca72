"""One engine step against its physical limit: decode, prefill, and extend over a cached prefix.

Runs the engine's own ModelRunner over its paged pool (no scheduler, sampler or HTTP), for each
configuration given (attention backend, compiled or eager), side by side in one process. Beside
the steps it measures the machine's limits in the same run: streaming read bandwidth over a buffer
larger than the last-level cache, and the GFLOP/s of a large matrix product in each arithmetic used.
A step's limit is the larger of its bytes over the bandwidth (every weight once in its format, plus
each row's K/V context at its dtype) and its flops over the peaks; "% of limit" is limit / measured
time (benchmarks/lib/modes.py does the accounting).

    python -m benchmarks.step.step_bench [--configs torch-eager,cpu-eager,cpu-captured] [--batches 1,8,32]
    python -m benchmarks.step.step_bench --modes all [--contexts 512,2048] [--accuracy results.json]

With ``--modes`` it runs issue 21's modes (weights x KV dtype x prefill arithmetic, presets: see
benchmarks/step/step_modes.py) as served, instead of the configurations.

Writes benchmarks/results/step_bench.{json,md} (with --modes: step_modes.{json,md,-decode.png,-prefill.png};
``--out``/``--name`` to write elsewhere).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from benchmarks.lib.common import RESULTS, args_json, write_results
from benchmarks.lib.modes import Formats, Shapes, StepModel
from benchmarks.lib.steps import Steps, measure_limits
from benchmarks.step.step_modes import run_modes
from radixserve import Engine

CONFIGS: dict[str, dict[str, Any]] = {
    "torch-eager": dict(attention_backend="torch", enforce_eager=True),  # before this work
    "cpu-eager": dict(attention_backend="cpu", enforce_eager=True),  # in-place C++ attention
    "cpu-captured": dict(attention_backend="cpu"),  # + the compiled step (the default on CPU)
}


def fp32_model(engine: Engine) -> StepModel:
    cfg = engine.model.config
    return StepModel(Shapes.of(cfg), Formats.uniform(cfg.num_layers, "f32"), "float32")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.step.step_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a = parser.add_argument
    a("--configs", default=",".join(CONFIGS), help=f"comma list of {sorted(CONFIGS)}")
    a("--modes", default=None, help="issue 21's modes (benchmarks/lib/modes.py names, or all, grid, arith)")
    a("--batches", default="1,8,32")
    a("--context", type=int, default=512, help="decode context of the configurations")
    a("--contexts", default="512,2048", help="decode contexts of the modes")
    a("--prefill", type=int, default=512)
    a("--extend", default=None, help="new/cached pairs (default: 100/500,512/512; with --modes 100/500)")
    a("--repeats", type=int, default=7)
    a("--threads", type=int, default=None)
    a("--prefill-decode", action="store_true", help="modes: compute the decode rows' K/V first")
    a("--arith-decode", action="store_true", help="modes: decode in the prefill-arithmetic modes too")
    a("--accuracy", type=Path, default=None, help="modes: an accuracy_bench JSON to show beside the speed")
    a("--out", type=Path, default=RESULTS, help="folder of the result files")
    a("--name", default=None, help="result file stem (default: step_bench, with --modes step_modes)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.modes:
        run_modes(args)
        return
    args.extend = args.extend or "100/500,512/512"
    batches = [int(b) for b in args.batches.split(",")]
    extends = [tuple(int(x) for x in pair.split("/")) for pair in args.extend.split(",")]
    limits = measure_limits()
    print(f"limits: {limits}", flush=True)
    results: dict[str, Any] = {"limits": limits.as_json(), "configs": {}}
    rows: list[list[Any]] = []
    model: StepModel | None = None
    for name in args.configs.split(","):
        engine = Engine(prefix_cache=False, kv_cache_gb=2.0, **CONFIGS[name])
        model = model or fp32_model(engine)
        steps = Steps(engine)
        res: dict[str, Any] = {}
        for b in batches:
            t = steps.decode(b, args.context, args.repeats)
            limit = limits.seconds(*model.decode(b, args.context))
            res[f"decode_b{b}"] = {
                "ms": t * 1e3,
                "limit_ms": limit * 1e3,
                "pct_of_limit": 100 * limit / t,
                "tok_s": b / t,
            }
            rows.append([name, f"decode {b} x {args.context}", t * 1e3, limit * 1e3, 100 * limit / t, b / t])
            print(rows[-1], flush=True)
        for new, cached in [(args.prefill, 0), *extends, *((n, 0) for n, c in extends if c)]:
            t = steps.extend(new, cached, max(3, args.repeats // 2))
            limit = limits.seconds(*model.prefill(new, cached, None))
            key = f"prefill_{new}" if not cached else f"extend_{new}_over_{cached}"
            res[key] = {
                "ms": t * 1e3,
                "limit_ms": limit * 1e3,
                "pct_of_limit": 100 * limit / t,
                "tok_s": new / t,
            }
            label = f"prefill {new}" if not cached else f"extend {new} over {cached} cached"
            rows.append([name, label, t * 1e3, limit * 1e3, 100 * limit / t, new / t])
            print(rows[-1], flush=True)
        for new, cached in extends:
            if cached:
                ratio = res[f"extend_{new}_over_{cached}"]["tok_s"] / res[f"prefill_{new}"]["tok_s"]
                res[f"extend_{new}_over_{cached}"]["vs_plain_prefill"] = ratio
                rows.append(
                    [name, f"extend {new}/{cached} vs prefill {new} (throughput ratio)", "", "", "", ratio]
                )
        results["configs"][name] = res
        del engine, steps
    write_results(
        args.name or "step_bench",
        {"args": args_json(args), **results},
        rows,
        ["config", "step", "ms", "limit ms", "% of limit", "tok/s"],
        f"One engine step vs its physical limit (SmolLM2-135M, fp32; read bandwidth "
        f"{limits.bandwidth_gb_s:.1f} GB/s, fp32 peak {limits.peaks_gflop_s['fp32']:.0f} GFLOP/s, "
        "measured in this run)",
        args.out,
    )


if __name__ == "__main__":
    main()
