"""bf16 against fp32 weights in the few-row product (``radixserve_cpu::gemv``), before and after the
bf16 tile of issue 31: the 1B-shape layer's products at 1 and 8 rows, alternating in one process.

"Before" is the few-row kernel of a base commit (``--base``, default the commit before the bf16 tile),
compiled from that commit's ``gemv.cpp``/``dense_rows.h`` under another op namespace
(``radixserve_base::gemv``), so both kernels load side by side. Each product is timed in turn with the
others (``common.alternate``) while a whole layer's weights (116 MB in bf16) are cycled, so no weight is
read from cache. Ratios are what to quote; the machine is shared.

    python -m benchmarks.kernels.bf16_rows_bench [--repeats 15] [--rows 1,8]
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.lib import common
from radixserve.kernels import cpu_build

BASE = "b917b2a"  # the commit before the AVX-512 bf16 tile
# Llama-3.2-1B's decoder-layer products (out, in): q and o, k and v (8 kv heads x 64), gate and up, down.
SHAPES = [(2048, 2048), (512, 2048), (8192, 2048), (2048, 8192)]
LAYER = [(2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (8192, 2048), (8192, 2048), (2048, 8192)]
SHIM = Path(__file__).with_name("bf16_rows_base.cpp")  # registers the base kernel under its own name


def load_base(commit: str) -> Any:
    """``radixserve_base::gemv``: the few-row kernel of ``commit``, built (once, cached) beside today's."""
    root = Path(tempfile.mkdtemp(prefix="bf16_base_"))
    repo = Path(__file__).resolve().parents[2]
    names = ("gemv.cpp", "gemv.h", "dense_rows.h")
    archive = subprocess.run(
        ["git", "archive", commit, *(f"kernels/csrc/{n}" for n in names)],
        cwd=repo,
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    src = root / "kernels" / "csrc"
    shutil.copy(SHIM, src / "shim.cpp")
    target = cpu_build.isa()
    # The macro renames the C++ namespace and the op library alike, so nothing clashes with today's.
    flags = [*cpu_build.compile_flags(target), "-Dradixserve_cpu=radixserve_base"]
    state = cpu_build.build_and_load(
        "radixserve_base_gemv",
        target,
        [src / "gemv.cpp", src / "shim.cpp"],
        [src / "gemv.h", src / "dense_rows.h"],
        flags,
        cpu_build.cache_root() / "bench_base",
    )
    if not state.loaded:
        raise RuntimeError(f"could not build the base kernel: {state.reason}")
    return torch.ops.radixserve_base.gemv


def measure(rows: list[int], repeats: int, base: Any) -> list[dict[str, Any]]:
    new = torch.ops.radixserve_cpu.gemv
    gen = torch.Generator().manual_seed(0)
    w32 = [torch.randn(n, k, generator=gen) / k**0.5 for n, k in LAYER]
    w16 = [w.to(torch.bfloat16) for w in w32]
    # the base kernel reads its own copy: a weight the previous call just read would sit in L3
    w16_base = [w.clone() for w in w16]
    out = []
    for m in rows:
        x32 = {k: torch.randn(m, k, generator=gen) for k in {k for _, k in LAYER}}
        x16 = {k: v.to(torch.bfloat16) for k, v in x32.items()}
        fns: dict[tuple[str, int], Callable[[], Any]] = {}
        for i, (_, k) in enumerate(LAYER):
            fns[("fp32", i)] = partial(new, x32[k], w32[i], None)
            fns[("bf16 before", i)] = partial(base, x16[k], w16_base[i], None)
            fns[("bf16 after", i)] = partial(new, x16[k], w16[i], None)
        # one layer's products in turn, each kernel on every weight (its own copy): between two reads of
        # a weight, 464 MB of others are read, so none is still in the 32 MB L3
        by_weight = sorted(fns, key=lambda key: key[1])
        times = common.alternate({f"{a}|{b}": fns[(a, b)] for a, b in by_weight}, repeats)
        for n, k in SHAPES:
            i = LAYER.index((n, k))
            t = {kind: times[f"{kind}|{i}"] for kind in ("fp32", "bf16 before", "bf16 after")}
            out.append(
                {
                    "rows": m,
                    "out": n,
                    "in": k,
                    "ms": {kind: v * 1e3 for kind, v in t.items()},
                    "gb_s": {kind: n * k * (4 if kind == "fp32" else 2) / v / 1e9 for kind, v in t.items()},
                    "bf16_over_fp32_speed_before": t["fp32"] / t["bf16 before"],
                    "bf16_over_fp32_speed_after": t["fp32"] / t["bf16 after"],
                    "after_over_before": t["bf16 before"] / t["bf16 after"],
                }
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--base", default=BASE, help="the commit whose few-row kernel is 'before'")
    parser.add_argument("--name", default="bf16_rows")
    args = parser.parse_args()
    if not cpu_build.load():
        raise SystemExit("the C++ CPU kernels did not load")
    base = load_base(args.base)
    results = measure([int(r) for r in args.rows.split(",")], args.repeats, base)
    table = [
        [
            r["rows"],
            f"{r['out']}x{r['in']}",
            r["ms"]["fp32"],
            r["ms"]["bf16 before"],
            r["ms"]["bf16 after"],
            r["gb_s"]["fp32"],
            r["gb_s"]["bf16 before"],
            r["gb_s"]["bf16 after"],
            r["bf16_over_fp32_speed_before"],
            r["bf16_over_fp32_speed_after"],
        ]
        for r in results
    ]
    header = [
        "rows",
        "out x in",
        "fp32 ms",
        "bf16 before ms",
        "bf16 after ms",
        "fp32 GB/s",
        "bf16 before GB/s",
        "bf16 after GB/s",
        "bf16/fp32 speed before",
        "bf16/fp32 speed after",
    ]
    notes = (
        "\nMedians of alternating calls over one 1B layer's weights (q, k, v, o, gate, up, down), each "
        "kernel on every weight (its own copy) in turn; speed ratio = fp32 time / bf16 time "
        "(> 1: bf16 faster). "
        f"Before: `{args.base}`'s kernel (zero-extending widening, 16 words a load); after: 32 words a "
        "load widened by a shift and a mask (exact).\n"
    )
    common.write_results(
        args.name,
        {"args": common.args_json(args), "results": results},
        table,
        header,
        "bf16 weights against fp32 in the few-row product, before and after (issue 31)",
        notes=notes,
    )


if __name__ == "__main__":
    main()
