"""Ahead-of-time compilation of the Triton kernels for a GPU target, on a machine without a GPU.

``python -m radixserve.kernels.aot --arch 80 --arch 90`` compiles every (kernel, dtype, constexpr)
variant the engine launches for the model shapes in ``MODEL_SHAPES`` and prints one JSON line per
variant with the sizes of the PTX and cubin produced. The constexprs come from the same functions the
launch wrappers use, so the variants here are exactly the ones launched. Must run without
``TRITON_INTERPRET`` (the interpreter replaces the JIT functions).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import triton
from triton.backends.compiler import GPUTarget

from . import decode_attention as dec
from . import extend_attention as ext
from . import kv_ops

# (q_heads, kv_heads, head_dim): SmolLM2-135M, Qwen2.5-0.5B, Llama-3-8B.
MODEL_SHAPES: tuple[tuple[int, int, int], ...] = ((9, 3, 64), (14, 2, 64), (32, 8, 128))
DTYPES: tuple[str, ...] = ("fp16", "bf16")
# Scalar kernel arguments that are floats; every other non-pointer, non-constexpr argument is an int.
FLOAT_ARGS = frozenset({"qk_scale"})


@dataclass(frozen=True)
class Variant:
    kernel: Any  # a triton JITFunction
    pointers: dict[str, str] = field(hash=False)
    constexprs: dict[str, int | bool] = field(hash=False)

    @property
    def key(self) -> str:
        return json.dumps([self.kernel.__name__, self.pointers, self.constexprs], sort_keys=True)

    def signature(self) -> dict[str, str]:
        sig = {}
        for name in self.kernel.arg_names:
            if name in self.constexprs:
                sig[name] = "constexpr"
            elif name in self.pointers:
                sig[name] = "*" + self.pointers[name]
            else:
                sig[name] = "fp32" if name in FLOAT_ARGS else "i32"
        return sig


def variants(
    shapes: tuple[tuple[int, int, int], ...] = MODEL_SHAPES, dtypes: tuple[str, ...] = DTYPES
) -> list[Variant]:
    """The distinct kernel variants for ``shapes`` with K/V, q and output all in one of ``dtypes``."""
    found: dict[str, Variant] = {}
    index = {"page_table_ptr": "i32", "seq_lens_ptr": "i32"}
    mid = {"mid_max_ptr": "fp32", "mid_sum_ptr": "fp32", "mid_acc_ptr": "fp32"}
    for q_heads, kv_heads, head_dim in shapes:
        for dt in dtypes:
            qkv = {"q_ptr": dt, "k_ptr": dt, "v_ptr": dt}
            # Float K/V pass placeholder scale pointers (the K cache); int8 K/V their fp32 scales.
            kv_kinds = [
                ({**qkv, "k_scale_ptr": dt, "v_scale_ptr": dt}, {"SCALED": False}),
                (
                    {"q_ptr": dt, "k_ptr": "i8", "v_ptr": "i8", "k_scale_ptr": "fp32", "v_scale_ptr": "fp32"},
                    {"SCALED": True},
                ),
            ]
            candidates = [
                Variant(
                    kv_ops._store_kv_kernel,
                    {"src_ptr": dt, "cache_ptr": dt, "slot_ptr": "i64"},
                    kv_ops.store_kv_blocks(kv_heads, head_dim),
                ),
                *(
                    Variant(
                        kv_ops._copy_pages_kernel,
                        {"src_ptr": dt, "dst_ptr": dt, "pages_ptr": "i64"},
                        {"GATHER": gather, **kv_ops.copy_pages_blocks(head_dim)},
                    )
                    for gather in (True, False)
                ),
                Variant(dec._decode_stage2_kernel, {**mid, "out_ptr": dt}, dec.reduce_blocks(head_dim)),
            ]
            for ptrs, scaled in kv_kinds:
                candidates.append(
                    Variant(
                        dec._decode_stage1_kernel,
                        {**ptrs, **index, **mid},
                        {**dec.decode_blocks(q_heads // kv_heads, head_dim), **scaled},
                    )
                )
                candidates.append(
                    Variant(
                        ext._extend_kernel,
                        {**ptrs, **index, "cu_q_lens_ptr": "i32", "out_ptr": dt},
                        {**ext.extend_blocks(head_dim), **scaled},
                    )
                )
            for variant in candidates:
                found.setdefault(variant.key, variant)
    return list(found.values())


def compile_variant(variant: Variant, arch: int) -> Any:
    """Compile one variant for ``sm_<arch>``; returns triton's CompiledKernel (``.asm`` holds ptx/cubin)."""
    source = triton.compiler.ASTSource(
        fn=variant.kernel, signature=variant.signature(), constexprs=variant.constexprs
    )
    return triton.compile(source, target=GPUTarget("cuda", arch, 32))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arch", type=int, action="append", help="compute capability, e.g. 80 or 90 (repeatable)"
    )
    parser.add_argument(
        "--dtype", action="append", choices=["fp16", "bf16", "fp32"], help="K/V dtype (repeatable)"
    )
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter cannot compile kernels", file=sys.stderr)
        return 2
    for arch in args.arch or [80, 90]:
        for variant in variants(dtypes=tuple(args.dtype or DTYPES)):
            asm = compile_variant(variant, arch).asm
            record = {
                "arch": arch,
                "kernel": variant.kernel.__name__,
                "pointers": variant.pointers,
                "constexprs": variant.constexprs,
                "ptx_target": next(
                    (ln.split()[1] for ln in asm["ptx"].splitlines() if ln.startswith(".target")), ""
                ),
                "ptx_bytes": len(asm.get("ptx", "")),
                "cubin_bytes": len(asm.get("cubin", b"")),
            }
            print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
