"""``step_bench --modes``: issue 21's modes (benchmarks/lib/modes.py), one engine each, as served.

For each mode: decode at every batch x context, prefill, and extend over a cached prefix, each beside
its bytes and its physical limit (the limit at the arithmetic the mode actually runs, and the
bandwidth, all measured in this run). The modes of a cheaper prefill arithmetic skip decode (it has
too few rows to take that arithmetic) unless ``--arith-decode``.

What a mode stores is read off the engine once built, not assumed from its name: the weight formats
(the GGUF file's own tensor types for gguf), the KV dtype of the pool, the prefill arithmetic of its
config, so a preset is accounted for as what it picked. A mode this build cannot run is a row
"unavailable: <why>".

Decode rows start with pages as they are (``--prefill-decode`` computes their K/V first): what the
pages hold changes no kernel's work, and it spares prefilling 32 x 2048 tokens per mode.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.lib.common import args_json, write_results
from benchmarks.lib.modes import (
    PREFILL_ARITHMETIC,
    Formats,
    Limits,
    Mode,
    Shapes,
    StepModel,
    engine_options,
    parse_modes,
    unavailable,
)
from benchmarks.lib.plots import plot_bars
from benchmarks.lib.steps import Steps, measure_limits
from benchmarks.step.step_targets import render as render_targets
from benchmarks.step.step_targets import target_rows
from radixserve import Engine

_DTYPE_FORMAT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_KV_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.int8: "int8",
}
GGUF_NAMES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
PAGE_SIZE = 16  # the engine's default
HEADER = ["mode", "step", "arithmetic", "MB read", "limit ms", "ms", "% of limit", "tok/s"]


# -- what an engine actually runs -----------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def gguf_tensors(path: Path) -> dict[str, tuple[str, int]]:
    """Each tensor of the GGUF file: its block type (lower case) and its bytes. Read once a file: the
    reader parses every metadata array, the tokenizer's ~100k strings too, one by one (seconds)."""
    from radixserve.model.gguf_file import gguf_reader

    return {t.name: (t.tensor_type.name.lower(), int(t.n_bytes)) for t in gguf_reader(path).tensors}


def gguf_formats(path: Path, layers: int) -> Formats:
    """Each decoder linear's and the LM head's block type, as the GGUF file stores them (the head:
    ``output.weight``, else the tied ``token_embd.weight``)."""
    types = {name: kind for name, (kind, _) in gguf_tensors(path).items()}
    per_layer = tuple({n: types[f"blk.{i}.{n}.weight"] for n in GGUF_NAMES} for i in range(layers))
    return Formats(per_layer, types.get("output.weight") or types["token_embd.weight"])


def holds_int8(module: torch.nn.Module) -> bool:
    return any(t.dtype == torch.int8 for t in [*module.parameters(), *module.buffers()])


def engine_formats(engine: Engine) -> Formats:
    layers = engine.model.config.num_layers
    quantization = engine.config.quantization
    if quantization == "gguf":
        path = Path(engine.model_path)
        if path.suffix != ".gguf":  # the embedded default model: its own Q4_1 file
            from radixserve.model.default_model import find_default_gguf

            path = find_default_gguf()
        return gguf_formats(path, layers)
    dtype = _DTYPE_FORMAT[engine.dtype]
    if quantization == "int8":
        return Formats.uniform(layers, "int8", "int8" if holds_int8(engine.model.lm_head) else dtype)
    return Formats.uniform(layers, dtype)


def engine_kv_dtype(engine: Engine) -> str:
    """The pool's K/V dtype: its own ``kv_dtype`` where it names one, else its K buffer's dtype."""
    pool = engine.pool
    named = getattr(pool, "kv_dtype", None)
    if isinstance(named, str):
        return named
    dtype = named if isinstance(named, torch.dtype) else pool.k_buffer.dtype
    return _KV_NAMES[dtype]


def engine_arithmetic(engine: Engine, limits: Limits) -> str | None:
    """The arithmetic bounding the prefill linears (None: the weights' own). ``auto`` picks at start-up,
    out of sight: the fastest measured peak is taken, so the limit stays a lower bound."""
    chosen = getattr(engine.config, "prefill_arithmetic", "exact")
    if chosen == "auto":
        return max(limits.peaks_gflop_s, key=lambda a: limits.peaks_gflop_s[a])
    return PREFILL_ARITHMETIC[chosen]


def resolved(engine: Engine) -> dict[str, Any]:
    """The engine's settings of issue 21's knobs, as it runs them (a preset resolved)."""
    cfg = engine.config
    return {
        "quantization": cfg.quantization,
        "kv_cache_dtype": engine_kv_dtype(engine),
        "prefill_arithmetic": getattr(cfg, "prefill_arithmetic", "exact"),
        "preset": getattr(cfg, "preset", None),
    }


# -- one mode ------------------------------------------------------------------------------------------
def pages_needed(args: argparse.Namespace, page_size: int, batches: list[int], contexts: list[int]) -> int:
    decode = max(batches) * -(-(max(contexts) + args.repeats + 4) // page_size)
    prefill = -(-(max([args.prefill, *(n + c for n, c in extends_of(args))]) + 1) // page_size)
    return decode + 2 * prefill + 8


def extends_of(args: argparse.Namespace) -> list[tuple[int, int]]:
    return [(int(n), int(c)) for n, c in (pair.split("/") for pair in args.extend.split(","))]


def _entry(nbytes: float, limit: float | None, seconds: float, tokens: int) -> dict[str, Any]:
    return {
        "mb_read": nbytes / 1e6,
        "limit_ms": None if limit is None else limit * 1e3,
        "ms": seconds * 1e3,
        "pct_of_limit": None if limit is None else 100 * limit / seconds,
        "tok_s": tokens / seconds,
    }


def _limit(limits: Limits, nbytes: float, flops: dict[str, float]) -> float | None:
    try:
        return limits.seconds(nbytes, flops)
    except ValueError:  # an arithmetic whose peak did not run here
        return None


def run_mode(
    mode: Mode, args: argparse.Namespace, limits: Limits, batches: list[int], contexts: list[int]
) -> tuple[dict[str, Any], list[list[Any]]]:
    """One mode's results (JSON) and table rows; an unavailable mode gives one row saying why."""
    options = engine_options(mode)
    why = unavailable(options)
    engine = None
    if why is None:
        try:
            pages = pages_needed(args, PAGE_SIZE, batches, contexts)
            longest = max([*contexts, args.prefill, *(n + c for n, c in extends_of(args))]) + args.repeats + 8
            engine = Engine(
                prefix_cache=False, page_size=PAGE_SIZE, num_pages=pages, max_model_len=longest, **options
            )
        except (TypeError, ValueError, RuntimeError, NotImplementedError) as exc:
            why = f"{type(exc).__name__}: {exc}"
    if engine is None:
        return {"options": options, "unavailable": why}, [[mode.name, f"unavailable: {why}"] + [""] * 6]
    formats = engine_formats(engine)
    model = StepModel(Shapes.of(engine.model.config), formats, engine_kv_dtype(engine))
    arithmetic = engine_arithmetic(engine, limits)
    body, head = model.weight_bytes()
    res: dict[str, Any] = {
        "options": options,
        "resolved": resolved(engine),
        "formats": formats.describe(),
        "weight_mb": {"decoder_linears": body / 1e6, "lm_head": head / 1e6},
        "kv_bytes_per_token": model.kv_bytes(1),
        "steps": {},
    }
    rows: list[list[Any]] = [
        [mode.name, f"weights: {formats.describe()}; K/V {model.kv}", "", (body + head) / 1e6] + [""] * 4
    ]
    steps = Steps(engine)

    def record(key: str, label: str, nbytes: float, flops: dict[str, float], seconds: float, n: int) -> None:
        limit = _limit(limits, nbytes, flops)
        res["steps"][key] = entry = _entry(nbytes, limit, seconds, n)
        entry["arithmetic"] = sorted(flops, key=lambda a: -flops[a])
        rows.append(
            [mode.name, label, ",".join(entry["arithmetic"]), entry["mb_read"], entry["limit_ms"]]
            + [entry["ms"], entry["pct_of_limit"], entry["tok_s"]]
        )
        print(rows[-1], flush=True)

    try:
        run_steps(mode, args, steps, model, arithmetic, batches, contexts, record)
    except (RuntimeError, ValueError, NotImplementedError) as exc:  # a kernel that fails mid-run
        res["failed"] = f"{type(exc).__name__}: {exc}"
        rows.append([mode.name, f"failed: {res['failed']}"] + [""] * 6)
    del steps, engine
    gc.collect()
    return res, rows


def run_steps(
    mode: Mode,
    args: argparse.Namespace,
    steps: Steps,
    model: StepModel,
    arithmetic: str | None,
    batches: list[int],
    contexts: list[int],
    record: Callable[[str, str, float, dict[str, float], float, int], None],
) -> None:
    """Time each step of ``mode`` and ``record`` it: decode (unless the mode is of a prefill
    arithmetic), prefill, extend."""
    if mode.arithmetic in ("exact", None) or args.arith_decode:
        for context in contexts:
            for b in batches:
                seconds = steps.decode(b, context, args.repeats, prefill=args.prefill_decode)
                nbytes, flops = model.decode(b, context)
                record(f"decode_b{b}_c{context}", f"decode {b} x {context}", nbytes, flops, seconds, b)
    for new, cached in [(args.prefill, 0), *extends_of(args)]:
        seconds = steps.extend(new, cached, max(3, args.repeats // 2))
        key = f"prefill_{new}" if not cached else f"extend_{new}_over_{cached}"
        label = f"prefill {new}" if not cached else f"extend {new} over {cached} cached"
        record(key, label, *model.prefill(new, cached, arithmetic), seconds, new)


# -- the run -------------------------------------------------------------------------------------------
def accuracy_rows(path: Path, names: list[str]) -> tuple[dict[str, Any], list[list[Any]]]:
    """Each mode's accuracy from an accuracy_bench JSON, as table rows beside its speed."""
    modes = json.loads(path.read_text()).get("modes", {})
    rows = []
    for name in names:
        acc = modes.get(name, {}).get("accuracy")
        if acc:
            rows.append(
                [
                    name,
                    f"accuracy vs fp32 ({acc['tokens']} tokens): mean abs d loglik "
                    f"{acc['mean_abs_dloglik']:.4f}, max {acc['max_abs_dloglik']:.3f}, top-1 agreement "
                    f"{100 * acc['top1_agreement']:.1f}%",
                ]
                + [""] * 6
            )
    return modes, rows


def used_arithmetics(modes: list[Mode]) -> set[str]:
    """The peaks the modes' limits need (a preset may pick any: all)."""
    used = {"fp32"}
    for m in modes:
        if m.weights == "bf16":
            used.add("bf16")
        if m.weights == "int8" or m.arithmetic == "int8" or m.decode == "int8":
            used.add("int8")
        if m.arithmetic == "bfloat16":
            used.add("bf16")
        if m.preset is not None or m.arithmetic is None:
            used |= {"int8", "bf16"}
    return used


def run_modes(args: argparse.Namespace) -> None:
    modes = parse_modes(args.modes)
    args.extend = args.extend or "100/500"
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    limits = measure_limits(arithmetics=used_arithmetics(modes))
    print(f"limits: {limits}", flush=True)
    results: dict[str, Any] = {"limits": limits.as_json(), "modes": {}}
    rows: list[list[Any]] = []
    for mode in modes:
        results["modes"][mode.name], mode_rows = run_mode(mode, args, limits, batches, contexts)
        rows += mode_rows
    accuracy: dict[str, Any] = {}
    if args.accuracy:
        results["accuracy_source"] = str(args.accuracy)
        accuracy, acc_rows = accuracy_rows(args.accuracy, [m.name for m in modes])
        rows += acc_rows
    results["targets"] = target_rows(results["modes"], accuracy)
    name = args.name or "step_modes"
    peaks = ", ".join(f"{a} {p:.0f}" for a, p in limits.peaks_gflop_s.items())
    write_results(
        name,
        {"args": args_json(args), **results},
        rows,
        HEADER,
        f"Issue 21's modes, one engine step each vs its physical limit (SmolLM2-135M; read bandwidth "
        f"{limits.bandwidth_gb_s:.1f} GB/s, peaks GFLOP/s: {peaks}; measured in this run)",
        args.out,
    )
    with (args.out / f"{name}.md").open("a") as md:
        md.write(render_targets(results["targets"]))
    plot_steps(results["modes"], args.out, name, limits)


def plot_steps(by_mode: dict[str, Any], out: Path, name: str, limits: Limits) -> list[Path]:
    """Two bar charts of step time by mode: the decode steps, and the prefill and extend steps."""
    decode: dict[str, dict[str, float | None]] = {}
    prefill: dict[str, dict[str, float | None]] = {}
    for mode, res in by_mode.items():
        for key, entry in res.get("steps", {}).items():
            target = decode if key.startswith("decode") else prefill
            target.setdefault(key.replace("_", " "), {})[mode] = entry["ms"]
    note = f"bandwidth {limits.bandwidth_gb_s:.1f} GB/s"
    return plot_bars(decode, out / f"{name}-decode.png", "ms per step (median)", f"decode steps; {note}") + (
        plot_bars(prefill, out / f"{name}-prefill.png", "ms per step (median)", f"prefill and extend; {note}")
    )
