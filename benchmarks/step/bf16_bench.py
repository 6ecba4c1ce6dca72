"""bf16 on the CPU, side by side with fp32 in one process: K/V in the attention kernel, the products of
bf16 weights, and whole decode steps at the 1B shape (``--dtype bfloat16`` against fp32).

Parts (``--parts``, all by default):
- ``attention``: the C++ paged attention alone (``benchmarks.kernels.attention_cpu``'s shapes:
  SmolLM2-135M, 30 layers, pages shuffled) over fp32 and bf16 K/V: decode of 8 rows at ~1,000 tokens of
  context each (issue 31: bf16 K/V ran at 0.90x fp32 K/V there in whole steps), a 512-token prefill and
  an extend of 100 over 500 cached; over bf16 K/V the many-row items both in fp32 and in bf16 arithmetic
  (``kernels/cpu.py``'s ``bf16_attention``, where the CPU has AVX512_BF16).
- ``prefill``: whole 512-token prefill steps of the served int8 config (the default model's Q4_1 file,
  ``--decode-arithmetic int8``, bf16 K/V) with those items in fp32 and in bf16, in turns.
- ``products``: one decoder layer's linear weights of the 1B shape (``benchmarks/step/big_model.py``) as the
  engine runs them (``layers.Linear``, prepacked): fp32 and bf16 weights at 1, 8 and 512 rows; the few-row
  path is ``csrc/gemv.cpp``, the many-row one oneDNN (fp32: a blocked copy; bf16: torch's bf16 matmul).
  Beside each: the rate at which it reads the weights (GB/s) and computes (GFLOP/s).
- ``steps``: the 1B-shape model's decode step at batch 1 and 8 over 512-token contexts, an engine at
  ``dtype float32`` and then one at ``dtype bfloat16`` (bf16 weights, products and K/V).

Every figure is the best (attention: the arms taken alternately; products) or the median (prefill, steps)
of several turns; on a shared machine quote the ratios.

    python -m benchmarks.step.bf16_bench [--parts attention,prefill,products,steps] [--repeats 5] [--name N]

Writes benchmarks/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import gc
import os
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from benchmarks.lib.common import best_of, machine, markdown_table, write_results


def attention(repeats: int, rounds: int = 3) -> list[dict[str, Any]]:
    from benchmarks.lib import attention_steps as A
    from radixserve.kernels import cpu
    from radixserve.model.attention import get_backend

    backend = get_backend("cpu")
    layers = 30
    cases = [
        A.Case("decode 8 x ~1000", [], [1000 + 3 * i for i in range(8)]),
        A.Case("prefill 512", [(512, 0)], []),
        A.Case("extend 100 over 500 cached", [(100, 500)], []),
    ]
    # (K/V dtype, bf16 arithmetic in the many-row items: csrc/gemm_bf16.cpp), where this CPU has it
    was = cpu.bf16_attention()  # restored after: RADIXSERVE_ATTENTION_BF16=0 stays off
    arms = [("float32", False), ("bfloat16", False)] + [("bfloat16", True)] * was
    out = []
    try:
        for case in cases:
            step = A.Step(case, layers)
            kv = {"float32": (step.k, step.v), "bfloat16": (step.k.bfloat16(), step.v.bfloat16())}
            best: dict[tuple[str, bool], float] = {}
            for _ in range(rounds):
                for arm in arms:
                    step.k, step.v = kv[arm[0]]
                    cpu.use_bf16_attention(arm[1])
                    step.plan(backend)
                    t = best_of(partial(_layers, step, backend, layers), repeats)
                    best[arm] = min(best.get(arm, float("inf")), t)
            out += [
                {
                    "case": f"{case.name}, 30 layers (SmolLM2-135M shapes)",
                    "kv": arm[0],
                    "arithmetic": "bf16" if arm[1] else "fp32",
                    "ms": best[arm] * 1e3,
                    "vs_fp32_kv": best[("float32", False)] / best[arm],
                }
                for arm in arms
            ]
    finally:
        cpu.use_bf16_attention(was)
    return out


def prefill(rounds: int, tokens: int = 512) -> list[dict[str, Any]]:
    """Whole prefill steps of the served int8 config (the default model's Q4_1 file,
    ``--decode-arithmetic int8``, bf16 K/V, compiled step) with the bf16 attention items off and on,
    in turns; medians of ``rounds``."""
    import statistics
    import time

    from benchmarks.lib.steps import Steps
    from radixserve import Engine
    from radixserve.kernels import cpu
    from radixserve.model.default_model import find_default_gguf

    engine = Engine(
        model=str(find_default_gguf()),
        decode_arithmetic="int8",
        kv_cache_dtype="bfloat16",
        prefix_cache=False,
        kv_cache_gb=0.25,
    )
    step, _ = Steps(engine).extend_step(tokens, 0)  # the same prefill into the same pages each call

    def seconds() -> float:
        start = time.perf_counter()
        step()
        return time.perf_counter() - start

    was = cpu.bf16_attention()
    arms = [False] + [True] * was
    times: dict[bool, list[float]] = {arm: [] for arm in arms}
    try:
        for arm in arms:  # warm-up: each arm's compiled step
            cpu.use_bf16_attention(arm)
            seconds()
        for _ in range(rounds):
            for arm in arms:
                cpu.use_bf16_attention(arm)
                times[arm].append(seconds())
    finally:
        cpu.use_bf16_attention(was)
    base = statistics.median(times[False])
    return [
        {
            "case": f"prefill {tokens}, Q4_1 int8 + bf16 K/V (the served int8 config)",
            "attention": "bf16" if arm else "fp32",
            "ms": statistics.median(times[arm]) * 1e3,
            "rounds_ms": [round(t * 1e3, 1) for t in times[arm]],
            "vs_fp32_attention": base / statistics.median(times[arm]),
        }
        for arm in arms
    ]


def _layers(step: Any, backend: Any, layers: int) -> None:
    for i in range(layers):
        step.layer(backend, i)


def _calls(pairs: list[tuple[Any, torch.Tensor]]) -> Callable[[], None]:
    def run() -> None:
        for lin, x in pairs:
            lin(x)

    return run


def products(repeats: int, rows_list: tuple[int, ...] = (1, 8, 512)) -> list[dict[str, Any]]:
    from benchmarks.lib.bench_models import LLAMA_1B
    from radixserve.model.layers import Linear

    s = LLAMA_1B
    kv = s.kv_heads * s.head_dim
    shapes = [
        (s.hidden + 2 * kv, s.hidden),
        (s.hidden, s.hidden),
        (2 * s.intermediate, s.hidden),
        (s.hidden, s.intermediate),
    ]
    gen = torch.Generator().manual_seed(0)
    out: list[dict[str, Any]] = []
    for dtype in (torch.float32, torch.bfloat16):
        lins = []
        for n, k in shapes:
            lin = Linear(k, n, bias=False)
            lin.weight.data = (torch.randn(n, k, generator=gen) * 0.02).to(dtype)
            lin.prepack()
            lins.append(lin)
        weight_bytes = sum(lin.weight.numel() * lin.weight.element_size() for lin in lins)
        flops_row = 2 * sum(lin.weight.numel() for lin in lins)
        for rows in rows_list:
            xs = [torch.randn(rows, lin.in_features, generator=gen).to(dtype) for lin in lins]
            pairs = list(zip(lins, xs))
            with torch.no_grad():
                t = best_of(_calls(pairs), repeats)
            out.append(
                {
                    "weights": str(dtype).removeprefix("torch."),
                    "rows": rows,
                    "ms": t * 1e3,
                    "GB/s": weight_bytes / t / 1e9,
                    "GFLOP/s": flops_row * rows / t / 1e9,
                }
            )
        del lins
        gc.collect()
    fp32 = {r["rows"]: r["ms"] for r in out if r["weights"] == "float32"}
    for r in out:
        r["vs_fp32"] = fp32[r["rows"]] / r["ms"]
    return out


def steps(
    repeats: int, layers: int = 16, batches: tuple[int, ...] = (1, 8), context: int = 512
) -> list[dict[str, Any]]:
    """One engine at a time, each dtype's steps medians of ``repeats``. ``layers``: of the 1B shape's 16
    (every layer is the same work; the fp32 engine of all 16, 4.3 GB of weights plus oneDNN's blocked
    copy, was killed for memory on a shared 24 GiB machine)."""
    import dataclasses

    from benchmarks.lib.bench_models import LLAMA_1B, build
    from benchmarks.lib.steps import Steps
    from radixserve import Engine

    shape = (
        LLAMA_1B
        if layers == LLAMA_1B.layers
        else dataclasses.replace(LLAMA_1B, name=f"{LLAMA_1B.name}-{layers}-layers", layers=layers)
    )
    folder = str(build(shape))
    out: list[dict[str, Any]] = []
    for dtype in ("float32", "bfloat16"):
        engine = Engine(model=folder, dtype=dtype, prefix_cache=False, kv_cache_gb=0.5)
        runner = Steps(engine)
        for b in batches:
            t = runner.decode(b, context, repeats, prefill=False)
            out.append({"dtype": dtype, "layers": layers, "batch": b, "context": context, "ms": t * 1e3})
            print(out[-1], flush=True)
        del runner, engine
        gc.collect()
    ref = {r["batch"]: r["ms"] for r in out if r["dtype"] == "float32"}
    for r in out:
        r["vs_fp32"] = ref[r["batch"]] / r["ms"]
    return out


def render(results: dict[str, Any]) -> str:
    lines = [
        "# bf16 on the CPU: K/V in attention, bf16 weights' products, 1B-shape decode steps",
        "",
        f"Machine: {results['machine']}",
        "",
        f"1-minute load average at the start: {results['load']:.1f} (a shared machine: quote the ratios).",
        "",
    ]
    sections: list[tuple[str, str, list[str], list[list[str]]]] = [
        (
            "attention",
            "Attention alone: bf16 vs fp32 K/V, and bf16 arithmetic over bf16 K/V (prefill, extend)",
            ["case", "K/V", "arithmetic", "ms", "vs fp32 K/V"],
            [
                [r["case"], r["kv"], r.get("arithmetic", "fp32"), f"{r['ms']:.2f}", f"{r['vs_fp32_kv']:.2f}x"]
                for r in results.get("attention", [])
            ],
        ),
        (
            "prefill",
            "Whole prefill steps: the many-row attention in fp32 and in bf16 (medians, arms in turns)",
            ["case", "attention", "ms", "vs fp32 attention"],
            [
                [r["case"], r["attention"], f"{r['ms']:.1f}", f"{r['vs_fp32_attention']:.2f}x"]
                for r in results.get("prefill", [])
            ],
        ),
        (
            "products",
            "One 1B-shape decoder layer's products (qkv, o, gate+up, down), as the engine runs them",
            ["weights", "rows", "ms", "weights read GB/s", "GFLOP/s", "vs fp32"],
            [
                [r["weights"], str(r["rows"]), f"{r['ms']:.2f}", f"{r['GB/s']:.1f}", f"{r['GFLOP/s']:.0f}"]
                + [f"{r['vs_fp32']:.2f}x"]
                for r in results.get("products", [])
            ],
        ),
        (
            "steps",
            "1B-shape decode step (benchmarks/lib/bench_models.py): --dtype bfloat16 vs float32",
            ["dtype", "layers (of 16)", "batch", "context", "ms / step", "vs fp32"],
            [
                [r["dtype"], str(r["layers"]), str(r["batch"]), str(r["context"]), f"{r['ms']:.1f}"]
                + [f"{r['vs_fp32']:.2f}x"]
                for r in results.get("steps", [])
            ],
        ),
    ]
    for part, title, header, rows in sections:
        if part in results:
            lines += [f"## {title}", "", *markdown_table(header, rows), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="attention,prefill,products,steps")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--name", default="bf16_bench")
    parser.add_argument("--layers", type=int, default=16, help="steps: layers of the 1B shape's 16")
    args = parser.parse_args()
    results: dict[str, Any] = {"machine": machine(), "load": os.getloadavg()[0], "args": vars(args)}
    for part in args.parts.split(","):
        if part == "steps":
            results[part] = steps(args.repeats, args.layers)
        elif part == "products":
            results[part] = products(args.repeats)
        elif part == "prefill":
            results[part] = prefill(args.repeats)
        else:
            results[part] = attention(args.repeats)
        print(part, results[part], flush=True)
        # After each part: a later part's failure keeps it.
        write_results(args.name, results, markdown=render(results))


if __name__ == "__main__":
    main()
