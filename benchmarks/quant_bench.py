"""int8 weights against fp32 (``--quantization int8``): decode step time, weight bytes, accuracy; one run.

- Kernels: the 30 layers' linear shapes of the default model at 1 and 8 rows, through fp32 (plain and
  oneDNN-packed), the int8 path of ``model/quant.py`` (per-row activations, ``torch._int_mm``), and
  ``quantized::linear_dynamic`` (torch.ao's kernel) under each quantized engine of this build.
- Steps: an fp32 and an int8 engine (both as served: the compiled step) in this process, their decode
  steps at each batch timed alternately, so a shared machine's load falls on both alike; the ratio is
  fp32 median / int8 median.
- Accuracy: both served (``radixserve serve``), each text of ``TEXTS`` scored through our own
  ``/v1/completions`` (``echo``, ``logprobs: 1``, ``max_tokens: 0``); per prompt token, |int8 loglik -
  fp32 loglik| and whether the two top-1 next tokens agree.

    python -m benchmarks.quant_bench [--batches 1,8] [--context 512] [--repeats 15]

Writes benchmarks/results/quant_bench.{json,md,png}.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from benchmarks.accuracy import agreement, served_scores
from benchmarks.common import RESULTS, write_results
from benchmarks.plots import plot_bars
from benchmarks.step_bench import Steps
from radixserve import Engine
from radixserve.model.quant import int8_linear, quantize_rows, weight_bytes


# -- kernels ------------------------------------------------------------------------------------------
def kernel_times(engine: Engine, rows: int, repeats: int) -> dict[str, float]:
    """Milliseconds per pass over every decoder-layer linear shape of ``engine``'s model, per kernel."""
    shapes = [
        (m.out_features, m.in_features)
        for name, m in engine.model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.startswith("layers.")
    ]
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, i, generator=gen) * 0.05 for o, i in shapes]
    xs = [torch.randn(rows, i, generator=gen) for _, i in shapes]
    qs = [quantize_rows(w) for w in ws]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in ws]
    kernels: dict[str, Callable[[], object]] = {
        "fp32 (aten linear)": lambda: [torch.nn.functional.linear(x, w) for x, w in zip(xs, ws)],
        "fp32 (oneDNN packed)": lambda: [
            torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for x, p in zip(xs, packed)
        ],
        "int8 _int_mm, per-row activations (ours, eager)": lambda: [
            int8_linear(x, q, s.squeeze(1), None) for x, (q, s) in zip(xs, qs)
        ],
    }
    with warnings.catch_warnings():  # quantized tensors are deprecated in torch 2.13
        warnings.simplefilter("ignore")
        for qengine in ("fbgemm", "onednn", "x86"):
            if qengine not in torch.backends.quantized.supported_engines:
                continue
            torch.backends.quantized.engine = qengine
            prepacked = [
                torch.ops.quantized.linear_prepack(
                    torch.quantize_per_channel(
                        w, s.squeeze(1).double(), torch.zeros(len(w), dtype=torch.long), 0, torch.qint8
                    ),
                    None,
                )
                for w, (_, s) in zip(ws, qs)
            ]
            kernels[f"int8 linear_dynamic, {qengine} (torch.ao)"] = functools.partial(
                _linear_dynamic, xs, prepacked
            )
    times: dict[str, list[float]] = {k: [] for k in kernels}
    for _ in range(repeats):  # alternately, so that load on a shared machine falls on all alike
        for name, fn in kernels.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: 1e3 * sorted(v)[len(v) // 2] for k, v in times.items()}


def _linear_dynamic(xs: list[torch.Tensor], prepacked: list[Any]) -> list[torch.Tensor]:
    # reduce_range as torch.ao's dynamic Linear passes it on x86
    return [torch.ops.quantized.linear_dynamic(x, w, True) for x, w in zip(xs, prepacked)]


# -- steps --------------------------------------------------------------------------------------------
def alternate(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median seconds of each of ``fns``, called in turn ``repeats`` times after one warm-up each."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--kernel-repeats", type=int, default=20)
    parser.add_argument("--no-accuracy", dest="accuracy", action="store_false")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()}", flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    engines = {
        q or "fp32": Engine(prefix_cache=False, kv_cache_gb=0.5, quantization=q) for q in (None, "int8")
    }
    rows: list[list[Any]] = []
    results: dict[str, Any] = {"weights": {}, "kernels": {}, "decode": {}}
    for name, engine in engines.items():
        results["weights"][name] = weight_bytes(engine.model)
    for what in ("linear_bytes", "total_bytes"):
        fp32, int8 = results["weights"]["fp32"][what], results["weights"]["int8"][what]
        label = "decoder linear weights" if what == "linear_bytes" else "all weights"
        rows.append([f"{label} (MB)", fp32 / 1e6, int8 / 1e6, fp32 / int8])
    for b in batches:
        steps = {
            name: Steps(e).decode_step(b, args.context, args.repeats + 2)[0] for name, e in engines.items()
        }
        t = alternate(steps, args.repeats)
        results["decode"][f"b{b}"] = {"fp32_ms": 1e3 * t["fp32"], "int8_ms": 1e3 * t["int8"]}
        rows.append(
            [
                f"decode step, batch {b} x {args.context} (ms)",
                1e3 * t["fp32"],
                1e3 * t["int8"],
                t["fp32"] / t["int8"],
            ]
        )
        print(rows[-1], flush=True)
    for b in batches:
        k = kernel_times(engines["fp32"], b, args.kernel_repeats)
        results["kernels"][f"rows{b}"] = k
        base = k["fp32 (aten linear)"]
        for name, ms in k.items():
            rows.append([f"30 layers' linears, {b} row(s): {name} (ms)", base, ms, base / ms])
    del engines
    if args.accuracy:
        log_dir = RESULTS / "logs" / "quant_bench"
        ref, test = (
            served_scores(name, flags, log_dir, args.threads)
            for name, flags in (("fp32", []), ("int8", ["--quantization", "int8"]))
        )
        acc = agreement(ref, test)
        results["accuracy"] = asdict(acc)
        rows.append(
            [f"mean abs d-loglik per token (nats, {acc.tokens} tokens)", "", acc.mean_abs_dloglik, ""]
        )
        rows.append(["max abs d-loglik per token (nats)", "", acc.max_abs_dloglik, ""])
        rows.append(["greedy top-1 agreement with fp32", "", acc.top1_agreement, ""])
    results["load_average_after"] = os.getloadavg()  # other work on a shared machine skews the times
    write_results(
        "quant_bench",
        {"args": vars(args), **results},
        rows,
        ["measure", "fp32", "int8", "fp32 / int8"],
        "int8 weights (--quantization int8) against fp32: SmolLM2-135M decode steps (compiled, as served), "
        "weight bytes, kernels, and accuracy (echo-logprob scoring of benchmarks/quant_bench.TEXTS)",
    )
    plot_bars(
        {
            f"decode batch {b}": {"fp32": d["fp32_ms"], "int8": d["int8_ms"]}
            for b, d in zip(batches, results["decode"].values())
        },
        RESULTS / "quant_bench.png",
        "decode step (ms, median)",
        _plot_title(results),
    )


def _plot_title(results: dict[str, Any]) -> str:
    w = results["weights"]
    linear = w["fp32"]["linear_bytes"] / w["int8"]["linear_bytes"]
    total = w["fp32"]["total_bytes"] / w["int8"]["total_bytes"]
    title = f"SmolLM2-135M, fp32 vs int8: linear weights {linear:.1f}x, all weights {total:.2f}x smaller"
    if "accuracy" in results:
        a = results["accuracy"]
        title += (
            f"\ntop-1 agreement {100 * a['top1_agreement']:.1f}%, |d loglik| per token: "
            f"mean {a['mean_abs_dloglik']:.3f}, max {a['max_abs_dloglik']:.2f} nats"
        )
    return title


if __name__ == "__main__":
    main()
