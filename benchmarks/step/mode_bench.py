"""Modes against fp32, side by side in one process: step time, bytes held and read, and accuracy.

Every mode of benchmarks/lib/modes.py named in ``--modes`` (``int8``, ``gguf``, ``fp32+kv-bf16``, ...) is
built as one engine beside the ``fp32`` reference, as served (the compiled step, C++ attention):

- Steps: decode of each ``--batches`` over ``--context`` tokens, and a ``--prefill``-token prefill
  (0: none). For each step every engine's call runs in turn, ``--repeats`` times after one warm-up,
  and the median counts (``common.alternate``), so a shared machine's load falls on all alike; the
  figure to quote is the ratio, fp32 median / mode median. ``--cpu-time`` runs one thread and times by
  this process's CPU time, which other processes' load does not inflate.
- Bytes: the weights each engine holds (the decoder's linears, and all of them), and the K/V a decode
  step reads at the dtype the pool really has.
- Accuracy (``--accuracy``): ``offline``, the prompt logprobs of ``benchmarks/lib/accuracy.TEXTS`` through
  each engine's offline API; ``served``, each mode served (``radixserve serve``) and the texts scored
  through ``/v1/completions`` echo; per prompt token |d loglik| against fp32 and whether the top-1
  next tokens agree. ``none`` skips it.
- Kernels (``--kernels``): the decoder's linear shapes at each batch's rows through fp32 (aten and
  oneDNN-packed), our int8 path (per-row activations, ``torch._int_mm``) and torch.ao's
  ``quantized::linear_dynamic`` under each quantized engine of this build.

    python -m benchmarks.step.mode_bench --modes int8,gguf [--batches 1,8] [--context 512] [--prefill 512]

The three benchmarks this one replaced are these runs (their result files keep their names):

    python -m benchmarks.step.mode_bench --modes int8 --context 512 --prefill 0 --repeats 15 \\
        --kernels --accuracy served --name quant_bench
    python -m benchmarks.step.mode_bench --modes fp32+kv-bf16,fp32+kv-int8 --batches 8 --context 2048 \\
        --prefill 0 --repeats 9 --accuracy offline --name kv_dtype_bench
    python -m benchmarks.step.mode_bench --modes gguf --prefill 512 --repeats 25 --cpu-time --name gguf_bench

Writes benchmarks/results/<name>.{json,md,png} (``--name``, default mode_bench; ``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.lib.accuracy import TEXTS, Scored, agreement, offline_scores, served_scores
from benchmarks.lib.common import RESULTS, alternate, args_json, write_results
from benchmarks.lib.modes import MODES, Mode, engine_options, kv_token_bytes, parse_modes, unavailable
from benchmarks.lib.plots import plot_bars
from benchmarks.lib.servers import server_flags
from benchmarks.lib.steps import Steps
from benchmarks.step.step_modes import engine_kv_dtype, resolved
from radixserve import Engine
from radixserve.model.quant import int8_linear, quantize_rows, weight_bytes

REFERENCE = "fp32"
PAGE_SIZE = 16  # the engine's default
TEXT_TOKENS = 512  # room for each text of accuracy.TEXTS (SmolLM2 cuts the longest into 67 tokens)
HEADER = ["mode", "measure", "fp32", "mode's", "fp32 / mode's"]


# -- engines -------------------------------------------------------------------------------------------
def build_engines(modes: list[Mode], args: argparse.Namespace) -> tuple[dict[str, Engine], dict[str, str]]:
    """One engine per mode that this build can run, the reference first, and why the others cannot."""
    batches = [int(b) for b in args.batches.split(",")]
    longest = max(args.context, args.prefill) + args.repeats + 8
    pages = max(batches) * -(-longest // PAGE_SIZE) + 2 * -(-(args.prefill + 1) // PAGE_SIZE) + 8
    if args.accuracy == "offline":  # every text scored at once, each well under TEXT_TOKENS
        longest = max(longest, TEXT_TOKENS)
        pages += len(TEXTS) * -(-TEXT_TOKENS // PAGE_SIZE)
    engines: dict[str, Engine] = {}
    skipped: dict[str, str] = {}
    for mode in modes:
        options = engine_options(mode)
        why = unavailable(options)
        if why is None:
            try:
                engines[mode.name] = Engine(
                    args.model,
                    prefix_cache=False,
                    page_size=PAGE_SIZE,
                    num_pages=pages,
                    max_model_len=longest,
                    enforce_eager=args.eager,
                    **options,
                )
            except (TypeError, ValueError, RuntimeError, NotImplementedError) as exc:
                why = f"{type(exc).__name__}: {exc}"
        if why is not None:
            skipped[mode.name] = why
            print(f"{mode.name} unavailable: {why}", flush=True)
    return engines, skipped


def kv_mb(engine: Engine, tokens: int) -> float:
    """MB of K/V over every layer for ``tokens`` tokens, at the dtype the engine's pool has."""
    cfg = engine.model.config
    return (
        tokens * kv_token_bytes(engine_kv_dtype(engine), cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) / 1e6
    )


# -- steps ---------------------------------------------------------------------------------------------
def time_steps(
    engines: dict[str, Engine], args: argparse.Namespace, clock: Callable[[], float]
) -> dict[str, dict[str, float]]:
    """Milliseconds of each step (``decode B x C``, ``prefill N``) by engine, every engine in turn."""
    steps = {name: Steps(e) for name, e in engines.items()}
    cases = [f"decode {b} x {args.context}" for b in args.batches.split(",")]
    cases += [f"prefill {args.prefill}"] if args.prefill else []
    out: dict[str, dict[str, float]] = {name: {} for name in engines}
    for case in cases:
        fns: dict[str, Callable[[], None]] = {}
        tables: dict[str, list[list[int]]] = {}
        for name, s in steps.items():
            if case.startswith("decode"):
                fns[name], tables[name] = s.decode_step(int(case.split()[1]), args.context, args.repeats + 2)
            else:
                fns[name], tables[name] = s.extend_step(args.prefill, 0)
        for name, seconds in alternate(fns, args.repeats, clock).items():
            out[name][case] = seconds * 1e3
            steps[name].release(tables[name])
        print(case, {n: round(ms[case], 2) for n, ms in out.items()}, flush=True)
    return out


# -- kernels -------------------------------------------------------------------------------------------
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
        return {k: 1e3 * v for k, v in alternate(kernels, repeats).items()}


def _linear_dynamic(xs: list[torch.Tensor], prepacked: list[Any]) -> list[torch.Tensor]:
    # reduce_range as torch.ao's dynamic Linear passes it on x86
    return [torch.ops.quantized.linear_dynamic(x, w, True) for x, w in zip(xs, prepacked)]


# -- the run -------------------------------------------------------------------------------------------
def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every figure of the run, as the JSON document (without the machine)."""
    modes = parse_modes(args.modes)
    modes = [MODES[REFERENCE], *(m for m in modes if m.name != REFERENCE)]
    clock = time.process_time if args.cpu_time else time.perf_counter
    engines, skipped = build_engines(modes, args)
    if REFERENCE not in engines:
        raise SystemExit(f"the fp32 reference did not build: {skipped.get(REFERENCE)}")
    doc: dict[str, Any] = {"args": args_json(args), "reference": REFERENCE, "skipped": skipped}
    doc["load_average_before"] = os.getloadavg()  # other work on a shared machine skews the times
    doc["clock"] = "process CPU time, 1 thread" if args.cpu_time else "wall time"
    batches = [int(b) for b in args.batches.split(",")]
    by_mode: dict[str, dict[str, Any]] = {
        name: {
            "options": engine_options(MODES[name]),
            "resolved": resolved(e),
            "weights": weight_bytes(e.model),
            "kv_mb_per_decode_step": {f"b{b}": kv_mb(e, b * args.context) for b in batches},
        }
        for name, e in engines.items()
    }
    for name, ms in time_steps(engines, args, clock).items():
        by_mode[name]["steps_ms"] = ms
    if args.accuracy == "offline":
        scored = {name: offline_scores(e) for name, e in engines.items()}
        for name in engines:
            by_mode[name]["accuracy"] = asdict(agreement(scored[REFERENCE], scored[name]))
    if args.kernels:
        doc["kernels"] = {
            f"rows{b}": kernel_times(engines[REFERENCE], b, args.kernel_repeats) for b in batches
        }
    names = list(engines)
    engines.clear()  # the servers below need the cores and the memory
    gc.collect()
    if args.accuracy == "served":
        log_dir = args.out / "logs" / args.name
        served: dict[str, list[Scored]] = {}
        for name in names:
            flags = (["--model", args.model] if args.model else []) + server_flags(by_mode[name]["options"])
            flags += ["--enforce-eager"] if args.eager else []
            served[name] = served_scores(name, flags, log_dir, args.threads, args.chunk_tokens)
            by_mode[name]["accuracy"] = asdict(agreement(served[REFERENCE], served[name]))
    doc["modes"] = by_mode
    doc["load_average_after"] = os.getloadavg()
    return doc


def table(doc: dict[str, Any]) -> list[list[Any]]:
    """Rows of [mode, measure, fp32, the mode's, fp32 / the mode's]."""
    ref = doc["modes"][REFERENCE]
    rows: list[list[Any]] = []
    for name, res in doc["modes"].items():
        if name == REFERENCE:
            continue
        for case, ms in res["steps_ms"].items():
            rows.append([name, f"{case} (ms)", ref["steps_ms"][case], ms, ref["steps_ms"][case] / ms])
        for what, label in (("linear_bytes", "decoder linear weights"), ("total_bytes", "all weights")):
            fp32, mine = ref["weights"][what], res["weights"][what]
            rows.append([name, f"{label} (MB)", fp32 / 1e6, mine / 1e6, fp32 / mine])
        for key, mb in res["kv_mb_per_decode_step"].items():
            ref_mb = ref["kv_mb_per_decode_step"][key]
            rows.append([name, f"K/V read per decode step, batch {key[1:]} (MB)", ref_mb, mb, ref_mb / mb])
        if acc := res.get("accuracy"):
            rows.append(
                [
                    name,
                    f"mean abs d-loglik per token (nats, {acc['tokens']} tokens)",
                    "",
                    acc["mean_abs_dloglik"],
                    "",
                ]
            )
            rows.append([name, "max abs d-loglik per token (nats)", "", acc["max_abs_dloglik"], ""])
            rows.append([name, "greedy top-1 agreement with fp32", "", acc["top1_agreement"], ""])
    for rows_key, kernels in doc.get("kernels", {}).items():
        base = kernels["fp32 (aten linear)"]
        for kernel, ms in kernels.items():
            rows.append(
                ["kernels", f"the layers' linears, {rows_key[4:]} row(s): {kernel} (ms)", base, ms, base / ms]
            )
    rows += [[name, f"unavailable: {why}", "", "", ""] for name, why in doc["skipped"].items()]
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.step.mode_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a = parser.add_argument
    a("--model", default=None, help="model folder (default: the embedded SmolLM2-135M)")
    a("--modes", default="int8,gguf", help="benchmarks/lib/modes.py names or groups; fp32 always runs")
    a("--batches", default="1,8")
    a("--context", type=int, default=512, help="decode context")
    a("--prefill", type=int, default=512, help="prefill tokens (0: no prefill step)")
    a("--repeats", type=int, default=9, help="calls of each step per engine (median)")
    a("--cpu-time", action="store_true", help="one thread, timed by this process's CPU time")
    a("--eager", action="store_true", help="eager steps instead of the compiled (served) ones: a quick check")
    a("--accuracy", choices=["offline", "served", "none"], default="offline")
    a("--chunk-tokens", type=int, default=0, help="served accuracy: --max-batched-tokens (0: the default)")
    a("--kernels", action="store_true", help="also time the decoder's linear shapes per kernel")
    a("--kernel-repeats", type=int, default=20)
    a("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a("--out", type=Path, default=RESULTS, help="folder of the result files")
    a("--name", default="mode_bench", help="result file stem")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.cpu_time:
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    doc = measure(args)
    steps = {
        case: {name: res["steps_ms"][case] for name, res in doc["modes"].items()}
        for case in doc["modes"][REFERENCE]["steps_ms"]
    }
    how = f"{doc['clock']}, median of {args.repeats}, engines in turn"
    model = Path(args.model).name if args.model else "SmolLM2-135M"
    png = args.out / f"{args.name}.png"
    plots = plot_bars(steps, png, "step (ms, median)", f"{model} steps by mode ({how})")
    write_results(
        args.name,
        doc,
        table(doc),
        HEADER,
        f"Modes against fp32: {model} steps ({'eager' if args.eager else 'compiled, as served'}; {how}), "
        "weights, K/V bytes"
        + (
            ""
            if args.accuracy == "none"
            else f", accuracy ({args.accuracy} prompt-logprob scoring of accuracy.TEXTS)"
        ),
        args.out,
        plots=plots,
    )


if __name__ == "__main__":
    main()
