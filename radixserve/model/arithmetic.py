"""Cheaper arithmetic for steps with many rows (``prefill_arithmetic``): prefill, extend, long
verification batches. Decode steps keep the weights' own (exact) arithmetic, unless
``decode_arithmetic`` int8 (GGUF weights only, ``apply_decode``) puts every product in int8.

Why: prefill is compute-bound (issue 21: 97% of the fp32 peak on an EPYC, 71% on a Xeon), and int8
(``torch._int_mm``, VNNI) or bf16 products run several times faster than fp32 there (4.6x and 2.3x at
512 rows on the EPYC). Decode is bound by reading the weights, which a cheaper product does not change.

- Choices: ``exact`` (default), ``int8`` (per-row dynamic activation quantization and per-channel int8
  weights: ``model/quant.py``'s scheme and code), ``bfloat16`` (a bf16 copy of the weights, x rounded to
  bf16, fp32 out), ``auto`` (the fastest that really runs here, by a start-up timing; logged once).
  The cheaper copy is made beside the fp32 weight (``layers.Linear.use_many_rows_arithmetic``): one more
  copy of the decoder's linear weights in memory (a quarter of them for int8, half for bf16).
- Row threshold: a product uses the cheaper copy above ``many_rows`` rows. The int8 product is faster
  than fp32 from 8 rows up already (issue 21: 3.0x at 8 rows), so the threshold is set by exactness,
  not speed: it is ``max_running_requests``, the most rows a step of decode tokens alone has, so such a
  step stays exact; prefill chunks (up to 512 rows), mixed steps and long verifications above it do not.
  The LM head runs on a few rows per step (each chunk's last token) and stays exact.
- Safety: bf16 runs only where the CPU lists bf16 instructions (``avx512_bf16`` or ``amx_bf16``), and the
  start-up probe runs every candidate product in a subprocess first: a CPU that lists AMX but traps
  kills the subprocess, not the server, and the candidate is dropped (``bfloat16`` asked for explicitly
  then gets a clear error).
- Accuracy: approximate; ``benchmarks/step/step_bench.py`` times prefill at each arithmetic, and the
  agreement of int8 prefill with fp32 is asserted in ``tests/model/test_arithmetic.py`` (>= 95% top-1).
- GGUF weights (``--quantization gguf``): ``int8`` (and ``auto``, which times it against the blocks'
  exact kernel) multiplies on the blocks themselves, no copy: x quantized per 32-block, VNNI integer
  dot products with the blocks' values, the blocks' scales after each (``kernels/gguf_int8.py``); a
  norm-fed product's few massive input channels stay fp32 (``model/outliers.py``, for either int8 mode).
  Where that kernel cannot run (no AVX512-VNNI, or ``RADIXSERVE_GGUF_INT8=0``) the products stay
  exact, said in one log line. ``bfloat16`` (asked for by name; ``auto`` does not pick it) multiplies
  on the blocks too: each tile of weight rows decoded exactly and rounded to bf16, x rounded to bf16,
  AVX512_BF16 dot products summed in fp32 (``kernels/gguf_bf16.py``), every block type; without
  AVX512_BF16 a clear error. Or, where the start-up timing finds it ``COPY_GAIN`` times faster, over a
  dense bf16 copy of the blocks (2 bytes a weight; oneDNN's bf16 product, AMX where it executes: 3.7x
  the exact blocks on a Xeon where the block kernel ran 0.6x; on Zen 4 the two tie on the legacy
  blocks the probe times, and the kernel is kept), logged with the timings.
- ``decode_arithmetic`` int8 (GGUF weights): every product, decode steps and the LM head included, in
  that int8 arithmetic, as llama.cpp runs on CPU: decode over the blocks in fp32 is bound by decoding
  them and by the FMAs, not by their bytes. Each weight's tiles are decoded once at load and kept
  (``GGUFLinear.use_int8_tiles``, ``kernels/csrc/int8_tiles.h``), and the native decode step streams
  them. Approximate (the same per-row arithmetic as int8 prefill); without VNNI one warning and exact.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from radixserve.kernels import gguf_bf16, gguf_int8
from radixserve.model import outliers
from radixserve.model.gguf import GGUFLinear, Weight
from radixserve.model.gguf_blocks import Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, TYPE_NAMES
from radixserve.model.layers import Linear
from radixserve.model.llama import LlamaForCausalLM

logger = logging.getLogger("radixserve.model")

ARITHMETICS = ("exact", "int8", "bfloat16", "auto")
DECODE_ARITHMETICS = ("exact", "int8")
PROBE_ROWS = 256  # rows of the timed products: a prefill chunk's order of size
PROBE_TIMEOUT_S = 120.0
PROBE_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)  # block types gguf.quants.quantize writes
# A dense bf16 copy of GGUF blocks (2 bytes a weight beside them) is made only where its timed product
# beats the bf16 block kernel by this factor: on Zen 4 the two tie on legacy blocks, within noise.
COPY_GAIN = 1.2


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def lists_bf16() -> bool:
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def linear_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """The distinct (out, in) shapes of the decoder layers' Linears."""
    shapes = {(m.out_features, m.in_features) for n, m in model.named_modules() if _is_decoder_linear(n, m)}
    return sorted(shapes)


def _is_decoder_linear(name: str, module: nn.Module) -> bool:
    return isinstance(module, Linear) and name.startswith("layers.")


def _decoder_gguf_linears(model: nn.Module) -> list[GGUFLinear]:
    return [m for n, m in model.named_modules() if isinstance(m, GGUFLinear) and n.startswith("layers.")]


def probe(
    candidates: list[str], shapes: list[tuple[int, int]], rows: int = PROBE_ROWS, qtype: int | None = None
) -> dict[str, float]:
    """Seconds for one product of ``rows`` rows by every weight of ``shapes``, per candidate ("exact",
    "int8", "bfloat16"; with ``qtype``, also "bfloat16-copy": bf16 over a dense copy of the blocks),
    timed in a subprocess: fp32 weights, or with ``qtype`` GGUF blocks of that type. A candidate missing
    from the result did not run: its product failed or killed the subprocess (an instruction the CPU
    lists but traps)."""
    arg = json.dumps({"candidates": candidates, "shapes": shapes, "rows": rows, "qtype": qtype})
    code = "import sys; from radixserve.model.arithmetic import _probe_main; _probe_main(sys.argv[1])"
    # The child imports this very package, wherever the caller's working directory is.
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, arg],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            env=env,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode()
        logger.warning("the arithmetic probe timed out after %.0f s", PROBE_TIMEOUT_S)
    else:
        out = done.stdout
        if done.returncode != 0:
            logger.warning(
                "the arithmetic probe exited with %s (a candidate product failed or trapped): %s",
                done.returncode,
                done.stderr.strip().splitlines()[-1:] or "",
            )
    times: dict[str, float] = {}
    for line in out.splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            times[entry["candidate"]] = float(entry["seconds"])
    return times


def _probe_main(arg: str) -> None:
    """The probe's subprocess: time each candidate, one JSON line each, flushed before the next starts."""
    spec = json.loads(arg)
    rows = int(spec["rows"])
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) / k**0.5 for n, k in spec["shapes"]]
    xs = {k: torch.randn(rows, k, generator=gen) for _, k in spec["shapes"]}
    qtype = spec.get("qtype")
    for candidate in spec["candidates"]:
        products: list[tuple[nn.Module, torch.Tensor]] = []
        for w in weights:
            x = xs[w.shape[1]]
            products.append((_probe_linear(w, candidate, qtype), x))
        with torch.no_grad():
            for lin, x in products:  # warm-up, and the first call a trapping instruction would die in
                lin(x)
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                for lin, x in products:
                    lin(x)
                best = min(best, time.perf_counter() - start)
        print(json.dumps({"candidate": candidate, "seconds": best}), flush=True)


def _probe_linear(w: torch.Tensor, candidate: str, qtype: int | None) -> nn.Module:
    """The product the probe times: ``w`` as an fp32 Linear, or as GGUF blocks of ``qtype``."""
    if qtype is not None:
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        blocks = torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType(qtype))).reshape(w.shape[0], -1)
        glin = GGUFLinear([Weight(qtype, blocks, w.shape[1])])
        if candidate == "bfloat16-copy":
            glin.use_many_rows_arithmetic("bfloat16", 1, dense=True)
        elif (candidate == "int8" and gguf_int8.available()) or (
            candidate == "bfloat16" and gguf_bf16.why_unavailable() is None
        ):
            glin.use_many_rows_arithmetic(candidate, 1)
        return glin
    lin = Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data.copy_(w)
    lin.prepack()
    if candidate != "exact":  # above 1 row: the cheaper copy serves the probe's products (0 is never)
        lin.use_many_rows_arithmetic(candidate, 1)
    return lin


def _resolve_gguf(arithmetic: str, model: nn.Module) -> str:
    """``resolve`` for a GGUF model: int8 on the blocks where its kernel runs, else exact (one log line)."""
    if arithmetic == "bfloat16":
        why_not = gguf_bf16.why_unavailable()
        if why_not is not None:
            raise ValueError(
                f"prefill_arithmetic bfloat16 over GGUF blocks: {why_not}; use int8, exact or auto"
            )
        return "bfloat16"
    why = gguf_int8.why_unavailable()
    if why is not None:
        logger.warning(
            "prefill_arithmetic %s over GGUF blocks: products stay exact, as %s (the int8 block kernel "
            "needs AVX512-VNNI)",
            arithmetic,
            why,
        )
        return "exact"
    if arithmetic == "int8":
        return "int8"
    if not any(q in gguf_int8.TYPES for m in _decoder_gguf_linears(model) for q in m.qtypes):
        logger.info("prefill_arithmetic auto: exact (the GGUF decoder weights hold no blocks it takes)")
        return "exact"
    qtype, shapes = _probe_qtype_and_shapes(model)
    return _fastest(probe(["exact", "int8"], shapes, qtype=qtype), "over GGUF blocks")


def _probe_qtype_and_shapes(model: nn.Module) -> tuple[int, list[tuple[int, int]]]:
    """The block type the probe times (the decoder's commonest that gguf's writer makes: both block
    kernels take every block type) and its weight shapes."""
    linears = _decoder_gguf_linears(model)
    # gguf's writer writes no k-quant or IQ4_NL: Q5_0 (a Q4_K_M file's commonest type) stands in for a
    # file of those only.
    writable = [q for m in linears for q in m.qtypes if q in PROBE_TYPES] or [Q5_0]
    return max(set(writable), key=writable.count), sorted({(m.out_features, m.in_features) for m in linears})


def _bf16_over_blocks(model: nn.Module) -> bool:
    """bf16 over the blocks, asked for by name: its block kernel, a dense bf16 copy and the exact blocks
    timed at start-up. True where the copy is to be made (at least ``COPY_GAIN`` times faster than the
    block kernel: a Xeon whose vdpbf16ps does no more multiply-adds a cycle than its two fp32 FMAs, but
    whose AMX runs oneDNN's bf16 product). A warning where the product chosen is slower than the exact
    blocks; it stays as asked."""
    qtype, shapes = _probe_qtype_and_shapes(model)
    times = probe(["exact", "bfloat16", "bfloat16-copy"], shapes, qtype=qtype)
    blocks, copy = times.get("bfloat16"), times.get("bfloat16-copy")
    dense = copy is not None and (blocks is None or copy * COPY_GAIN < blocks)
    logger.info(
        "prefill_arithmetic bfloat16 over GGUF blocks: %s (timed at %d rows over %s blocks: %s)",
        "a dense bf16 copy of the decoder's blocks, 2 bytes a weight" if dense else "the bf16 block kernel",
        PROBE_ROWS,
        TYPE_NAMES.get(qtype, qtype),
        ", ".join(f"{c} {t * 1e3:.1f} ms" for c, t in sorted(times.items())) or "no candidate ran",
    )
    chosen = copy if dense else blocks
    if chosen is not None and "exact" in times and chosen > times["exact"]:
        logger.warning(
            "prefill_arithmetic bfloat16 over GGUF blocks is slower than the exact blocks on this CPU (%.1f "
            "ms against %.1f ms at %d rows) and approximate: exact or int8 would serve faster",
            chosen * 1e3,
            times["exact"] * 1e3,
            PROBE_ROWS,
        )
    return dense


def resolve(arithmetic: str, model: nn.Module) -> str:
    """The arithmetic to use for ``model``'s many-row products: ``exact``, ``int8`` or ``bfloat16``.
    ValueError where the asked one cannot run here (naming why and the choices)."""
    if arithmetic not in ARITHMETICS:
        raise ValueError(f"prefill_arithmetic must be one of {', '.join(ARITHMETICS)}, got {arithmetic!r}")
    if arithmetic == "exact":
        return "exact"
    if getattr(model, "quantization", None) == "gguf":
        return _resolve_gguf(arithmetic, model)
    linears = [m for n, m in model.named_modules() if _is_decoder_linear(n, m)]
    fp32_cpu = bool(linears) and all(
        m.weight.dtype == torch.float32 and m.weight.device.type == "cpu" and m.packed_linear is not None
        for m in linears
    )
    if not fp32_cpu:
        why = (
            "the model's decoder weights are not plain float32 Linears on CPU with the C++ kernels loaded "
            f"(quantization {getattr(model, 'quantization', None)}, its own arithmetic serves every step)"
        )
        if arithmetic == "auto" or (arithmetic == "int8" and getattr(model, "quantization", None) == "int8"):
            logger.info("prefill_arithmetic %s: the weights' own, as %s", arithmetic, why)
            return "exact"
        raise ValueError(f"prefill_arithmetic {arithmetic} needs float32 weights on CPU: {why}")
    if arithmetic == "int8":
        return "int8"
    if not lists_bf16():
        if arithmetic == "bfloat16":
            raise ValueError(
                "prefill_arithmetic bfloat16: this CPU lists no bf16 instructions (avx512_bf16 or amx_bf16), "
                "so bf16 products would be emulated, slower than fp32; use int8, exact or auto"
            )
        candidates = ["exact", "int8"]
    else:
        candidates = ["exact", "int8", "bfloat16"] if arithmetic == "auto" else ["exact", "bfloat16"]
    times = probe(candidates, linear_shapes(model))
    if arithmetic == "bfloat16":
        if "bfloat16" not in times:
            raise ValueError(
                "prefill_arithmetic bfloat16: a bf16 product failed or trapped on this CPU in the start-up "
                "probe (it lists bf16 but does not execute it); use int8, exact or auto"
            )
        return "bfloat16"
    return _fastest({c: t for c, t in times.items() if c in candidates}, "over the decoder's weights")


def _fastest(times: dict[str, float], over: str) -> str:
    """The fastest candidate that ran (exact if none did), logged with every timing."""
    choice = min(times, key=times.__getitem__) if times else "exact"
    logger.info(
        "prefill_arithmetic auto: %s (timed at %d rows %s: %s)",
        choice,
        PROBE_ROWS,
        over,
        ", ".join(f"{c} {t * 1e3:.1f} ms" for c, t in sorted(times.items())) or "no candidate ran",
    )
    return choice


def apply_decode(model: LlamaForCausalLM, decode: str) -> bool:
    """``decode_arithmetic``: for "int8", every GGUF decoder weight of a type the int8 kernel takes gets
    its int8 tiles, and every product of it (decode and prefill alike) runs on them. True where that
    is so; False (exact decode) for "exact", or after one warning where the kernel cannot run here.
    ValueError for a model without GGUF blocks."""
    if decode not in DECODE_ARITHMETICS:
        raise ValueError(f"decode_arithmetic must be one of {', '.join(DECODE_ARITHMETICS)}, got {decode!r}")
    if decode == "exact":
        return False
    if getattr(model, "quantization", None) != "gguf":
        raise ValueError(
            "decode_arithmetic int8 runs on GGUF blocks (a .gguf model, or --quantization gguf); "
            f"this model's weights are {getattr(model, 'quantization', None) or 'dense'}"
        )
    why = gguf_int8.why_unavailable()
    if why is not None:
        logger.warning(
            "decode_arithmetic int8: products stay exact, as %s (the int8 block kernel needs AVX512-VNNI)",
            why,
        )
        return False
    outliers.apply(model)  # calibrated in exact arithmetic: before any product turns int8
    exact: set[int] = set()
    # The LM head too: at a decode step it is as many bytes as a fifth of the decoder (135M), and as
    # llama.cpp runs its output layer.
    head: list[GGUFLinear] = [model.lm_head] if isinstance(model.lm_head, GGUFLinear) else []
    linears = _decoder_gguf_linears(model) + head
    for g in linears:
        exact.update(g.use_int8_tiles())
    tile_bytes = sum(t.numel() for g in linears for t in g.tiles if t is not None)
    logger.info(
        "decode_arithmetic int8: every product over the GGUF decoder weights and LM head runs in int8, "
        "decode and prefill (approximate), on int8 tiles made at load (%.0f MiB)%s",
        tile_bytes / 2**20,
        f"; {', '.join(sorted(TYPE_NAMES.get(q, str(q)) for q in exact))} stay exact" if exact else "",
    )
    model.arithmetic = model.decode_arithmetic = "int8"
    return True


def apply(model: LlamaForCausalLM, arithmetic: str, many_rows: int, decode: str = "exact") -> str:
    """Resolve ``arithmetic`` and give every decoder Linear its cheaper copy for more than ``many_rows``
    rows; returns the arithmetic in use (recorded as ``model.arithmetic``). ``decode`` int8
    (``apply_decode``) makes every product int8 and supersedes it."""
    if apply_decode(model, decode):
        return "int8"
    chosen = resolve(arithmetic, model)
    if chosen != "exact" and getattr(model, "quantization", None) == "gguf":
        linears = _decoder_gguf_linears(model)
        model.bf16_copy = chosen == "bfloat16" and _bf16_over_blocks(model)
        if chosen == "int8":
            outliers.apply(model)
        for g in linears:
            g.use_many_rows_arithmetic(chosen, many_rows, dense=model.bf16_copy)
        # Both block kernels take every block type, so no part stays exact.
        logger.info(
            "products of more than %d rows run in %s on the GGUF blocks (approximate); fewer stay exact",
            many_rows,
            chosen,
        )
    elif chosen != "exact":
        for name, m in model.named_modules():
            if _is_decoder_linear(name, m):
                assert isinstance(m, Linear)
                m.use_many_rows_arithmetic(chosen, many_rows)
        logger.info(
            "products of more than %d rows run in %s (approximate); fewer stay exact", many_rows, chosen
        )
    model.arithmetic = chosen
    return chosen
