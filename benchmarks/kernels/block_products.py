"""Many-row products over GGUF blocks, kernel by kernel: exact (``gguf_linear``: tiles decoded to fp32,
sgemm), bf16 on the blocks (``gguf_bf16_linear``: tiles rounded to bf16, vdpbf16ps) and int8 on the
blocks (``gguf_int8_linear``: x in int8 per 32-block, vpdpbusd), beside torch's bf16 product over a
dense bf16 copy of the weight (the fp32 weights' bfloat16 mode; oneDNN, with AMX where it executes), in
one process on random weights: no model is needed, so it runs on any machine with the C++ kernels (a
lent machine's host CPU included).

Each product is one decoder layer's of SmolLM2-135M (qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536) or of Llama-3.2-1B's shape (``--shape 1b``), at ``--rows`` rows (a prefill chunk), for a
4-bit and an 8-bit type (a random normal weight quantized by gguf); with ``--gguf FILE``, instead, the
seven weights of layer ``--layer`` of a real file, as stored (types gguf's writer cannot make, such as
llama-quantize's k-quants), totalled by type. The kernels are interleaved round by round, the best of
``--rounds``; GFLOP/s is 2 * rows * N * K over the time. A kernel that does not run here (no
AVX512_BF16 or VNNI) is left out with the reason.

    python -m benchmarks.kernels.block_products [--rows 512] [--rounds 5] [--threads N] [--shape 135m]
        [--gguf FILE --layer 0]

Writes benchmarks/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from benchmarks.lib.common import RESULTS, args_json, write_results
from radixserve.kernels import cpu_build, gguf_bf16, gguf_int8
from radixserve.model.gguf_blocks import TYPE_NAMES, dequantize, is_blocks
from radixserve.model.gguf_file import read_gguf

SHAPES = {
    "135m": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
    "1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
}
TYPES = (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)
LAYER_WEIGHTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def random_blocks(qtype: GGMLQuantizationType, n: int, k: int) -> torch.Tensor:
    """A random weight [n, k] in ``qtype``'s blocks, as gguf's writer quantizes it (as the start-up
    arithmetic probe makes its blocks)."""
    w = np.random.default_rng(0).standard_normal((n, k), dtype=np.float32) / k**0.5
    return torch.from_numpy(quantize(w, qtype)).reshape(n, -1)


def weights(args: argparse.Namespace) -> list[tuple[str, int, torch.Tensor]]:
    """(type name, type id, blocks [N, row bytes]) of every weight timed: random ones of ``TYPES`` in
    the ``--shape``'s layer, or layer ``--layer`` of ``--gguf`` (its block-typed weights)."""
    if args.gguf is None:
        return [(q.name, int(q), random_blocks(q, n, k)) for q in TYPES for n, k in SHAPES[args.shape]]
    file = read_gguf(args.gguf)
    out = []
    for name in LAYER_WEIGHTS:
        w = file.weight(f"blk.{args.layer}.{name}.weight")
        if is_blocks(w.qtype):
            out.append((TYPE_NAMES[w.qtype], w.qtype, w.data))
    return out


def bf16_copy(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The fp32 weights' ``bfloat16`` mode for comparison: a dense bf16 copy of the weight (made once,
    outside the timing), x rounded to bf16, torch's product (oneDNN: AMX where it executes), fp32 out."""
    return torch.nn.functional.linear(x.to(torch.bfloat16), weight).float()


def kernels() -> tuple[dict[str, Callable[..., torch.Tensor]], dict[str, str]]:
    """The kernels that run here, and why each of the others does not. Each takes x, the blocks, their
    type and the dense bf16 copy (which only "bf16 copy" reads)."""
    run: dict[str, Callable[..., torch.Tensor]] = {
        "exact": lambda x, b, q, w: torch.ops.radixserve_cpu.gguf_linear(x, b, q, x.shape[1], None),
        "bf16 copy": lambda x, b, q, w: bf16_copy(x, w),
    }
    skipped = {}
    for name, module in (("bf16", gguf_bf16), ("int8", gguf_int8)):
        why = module.why_unavailable()
        if why is None:
            run[name] = lambda x, b, q, w, m=module: m.linear(x, b, q, None)  # type: ignore[misc]
        else:
            skipped[name] = why
    return run, skipped


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="135m")
    p.add_argument("--gguf", type=Path, default=None, help="time this file's weights, not random ones")
    p.add_argument("--layer", type=int, default=0, help="with --gguf: the layer whose weights are timed")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--name", default="block_products")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_build.load():
        raise SystemExit("the C++ CPU kernels do not build here")
    run, skipped = kernels()
    results = []
    for type_name, qtype, blocks in weights(args):
        dense = dequantize(blocks, qtype).to(torch.bfloat16)
        n, k = dense.shape
        x = torch.randn(args.rows, k)
        best = dict.fromkeys(run, float("inf"))
        for f in run.values():  # warm-up
            f(x, blocks, qtype, dense)
        for _ in range(args.rounds):
            for name, f in run.items():
                start = time.perf_counter()
                f(x, blocks, qtype, dense)
                best[name] = min(best[name], time.perf_counter() - start)
        for name, s in best.items():
            gflops = 2 * args.rows * n * k / s / 1e9
            results.append({"type": type_name, "n": n, "k": k, "kernel": name, "s": s, "gflops": gflops})
    rows = []
    for type_name in dict.fromkeys(r["type"] for r in results):  # totals by type, in order
        mine = [r for r in results if r["type"] == type_name]
        flops = sum(2 * args.rows * r["n"] * r["k"] for r in mine if r["kernel"] == "exact")
        totals = {name: sum(r["s"] for r in mine if r["kernel"] == name) for name in run}
        for name, s in totals.items():
            rows.append(
                [type_name, name, f"{s * 1e3:.2f}", f"{flops / s / 1e9:.0f}", f"{totals['exact'] / s:.2f}x"]
            )
    source = f"{args.gguf.name}, layer {args.layer}" if args.gguf else args.shape
    notes = "".join(f"\n- {name} left out: {why}\n" for name, why in skipped.items())
    write_results(
        args.name,
        {"args": args_json(args), "threads": torch.get_num_threads(), "products": results, "skipped": skipped}
        | {"cpu_capability": torch.backends.cpu.get_cpu_capability()},
        rows,
        ["type", "kernel", "layer's products ms", "GFLOP/s", "vs exact"],
        f"One decoder layer's products ({source}) at {args.rows} rows over GGUF blocks, best of "
        f"{args.rounds} interleaved rounds",
        out_dir=args.out_dir,
        notes=notes,
    )


if __name__ == "__main__":
    main()
